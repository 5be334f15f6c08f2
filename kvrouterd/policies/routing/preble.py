"""``preble``: Preble's prefix-hit-or-load rule as DualMap describes it (DualMap sections 2.2, B).

A request's prefix hit rate is the largest fraction of its prompt tokens any eligible worker
holds. Above ``hit_threshold`` (Preble's 50%) the request goes to that worker (cache
affinity; ties to the lower load cost, reason ``prefix_hit``). Otherwise it goes to
the worker with the least load cost: the time to clear the worker's pending prefill work
plus this request's prefill time on it (reason ``load_cost``), from the shared latency model.

Preble itself measures load as the compute a worker spent over a recent time window and adds
an eviction-cost term; the router's in-flight pending prefill tokens stand in for the first
and the second is left out (the router cannot see what an engine would evict).

Parameters: ``hit_threshold`` = 0.5, plus those of ``LatencyParams``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...index import native
from ...index.workers import Worker
from ...protocols import CandidateScore, Decision
from ..base import RoutingContext
from ..latency import CalibratedRoutingPolicy, LatencyModel, LatencyParams

__all__ = ["PrebleParams", "PreblePolicy"]


@dataclass(frozen=True)
class PrebleParams(LatencyParams):
    hit_threshold: float = field(default=0.5, metadata={"help": "prefix hit rate above which cache affinity wins"})

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.hit_threshold <= 1.0:
            raise ValueError(f"hit_threshold must be in [0, 1], got {self.hit_threshold}")


class PreblePolicy(CalibratedRoutingPolicy):
    params: PrebleParams

    def __init__(self, params: PrebleParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self.latency = LatencyModel(params)

    def select(self, ctx: RoutingContext) -> Decision:
        model = self.latency
        if not getattr(ctx, "explain", True) and native.module is not None:
            # one native pass over the loads by slot (index/_native.c: preble_pick): pricing
            # every worker here is ~2 us each; this loop, which lists each one, is its reference
            picked = native.module.preble_pick(*model.pricing_args(ctx), self.params.hit_threshold)
            if picked is not NotImplemented:
                index, cost, best_hit, prefix_hit = picked
                return self._decided(ctx, ctx.candidates[index], "prefix_hit" if prefix_hit else "load_cost",
                                     [], best_hit, cost)
        prompt = max(ctx.prompt_tokens, 1)
        rows = []
        for w in ctx.candidates:
            hit = min(1.0, ctx.overlap(w) * ctx.block_size / prompt)
            cost = model.ttft_ms(ctx.uncached_tokens(w), model.pending_tokens(w, ctx.now), w.inflight_requests)
            rows.append((hit, cost, w))
        best_hit = max(r[0] for r in rows)
        if best_hit > self.params.hit_threshold:
            hit, cost, chosen = min(rows, key=lambda r: (-r[0], r[1], r[2].slot))
            reason = "prefix_hit"
        else:
            hit, cost, chosen = min(rows, key=lambda r: (r[1], r[2].slot))
            reason = "load_cost"
        scored = []
        if getattr(ctx, "explain", True):
            scored = [ctx.candidate(w, h, hit_rate=round(h, 4), load_cost_ms=round(c, 3)) for h, c, w in rows]
        return self._decided(ctx, chosen, reason, scored, best_hit, cost)

    def _decided(self, ctx: RoutingContext, chosen: Worker, reason: str, scored: list[CandidateScore],
                 best_hit: float, cost: float) -> Decision:
        decision = self.decide(ctx, chosen, reason, scored, hit_rate=round(best_hit, 4), load_cost_ms=round(cost, 3))
        decision.estimated_ttft_ms = cost
        return decision
