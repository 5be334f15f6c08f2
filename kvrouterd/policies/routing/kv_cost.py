"""``kv_cost``: Dynamo's KV-router cost as DualMap describes it (DualMap sections 2.2 and B).

For each worker: ``cost = overlap_weight * prefill_blocks + active_blocks`` where
``prefill_blocks`` are the prompt blocks the worker would compute (uncached tokens / block
size) and ``active_blocks`` the blocks it would hold if it took the request: the prompt and
expected output blocks of requests routed to it and not yet completed, plus this request's.
Lower is better. With ``temperature`` = 0 the cheapest worker wins (ties broken at random, as
Dynamo does); above 0 a worker is sampled with probability proportional to
``exp(-c / temperature)``, ``c`` the cost min-max normalised to [0, 1] over the candidates.

This is the paper's simplified form, kept for its experiments. Dynamo's current router
differs (audited against ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector/default.rs``
and ``config.rs``): its prefill term also counts the prefill tokens already in flight on the
worker, ``(active_prefill_tokens + prompt) / block - cached blocks``; its active blocks count
prompt blocks only (``router_track_output_blocks: false``), a block shared by two active
requests once (``router_assume_kv_reuse: true``), and only the request's blocks not already
active there; ``overlap_score_weight`` is deprecated for ``overlap_score_credit`` (in [0, 1])
and ``prefill_load_scale``. The ``dynamo`` policy follows that source; compare against it.

Parameters (the paper's reading of Dynamo's defaults):

- ``overlap_weight`` = 1.0: weight of prefill blocks; 0 ignores caches (pure load balance).
- ``temperature`` = 0.0: softmax sampling temperature (0 = argmin).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from ...index.workers import Worker
from ...protocols import Completion, Decision, RouteRequest
from ..base import RoutingContext, RoutingPolicyBase

__all__ = ["KVCostParams", "KVCostPolicy"]

_MAX_TRACKED = 200_000


@dataclass(frozen=True)
class KVCostParams:
    overlap_weight: float = field(default=1.0, metadata={"help": "weight of prefill blocks against active blocks"})
    temperature: float = field(default=0.0, metadata={"help": "softmax sampling temperature (0 = argmin)"})

    def validate(self) -> None:
        if self.overlap_weight < 0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def _request_blocks(request: RouteRequest, block_size: int) -> int:
    return -(-(request.prompt_tokens + max(request.expected_output_tokens, 0)) // block_size)


class KVCostPolicy(RoutingPolicyBase):
    params: KVCostParams

    def __init__(self, params: KVCostParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self._active: dict[str, int] = {}
        self._inflight: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def active_blocks(self, worker_id: str) -> int:
        return self._active.get(worker_id, 0)

    def select(self, ctx: RoutingContext) -> Decision:
        p = self.params
        own = _request_blocks(ctx.request, ctx.block_size)
        rows = []
        for w in ctx.candidates:
            prefill = ctx.uncached_tokens(w) / ctx.block_size
            active = self._active.get(w.id, 0) + own
            rows.append((p.overlap_weight * prefill + active, prefill, active, w))
        costs = [r[0] for r in rows]
        lo, hi = min(costs), max(costs)
        if p.temperature == 0.0 or hi == lo:
            best = [r for r in rows if r[0] == lo]
            pick = best[self.rng.randrange(len(best))] if len(best) > 1 else best[0]
            reason = "min_cost"
        else:
            weights = [math.exp(-((c - lo) / (hi - lo)) / p.temperature) for c in costs]
            pick = self.rng.choices(rows, weights=weights)[0]
            reason = "softmax_sample"
        cost, prefill, active, chosen = pick
        scored = []
        if getattr(ctx, "explain", True):
            scored = [ctx.candidate(w, -c, prefill_blocks=round(pb, 3), active_blocks=float(ab), cost=round(c, 3))
                      for c, pb, ab, w in rows]
        return self.decide(ctx, chosen, reason, scored, cost=round(cost, 3), prefill_blocks=round(prefill, 3),
                           active_blocks=active)

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        blocks = _request_blocks(ctx.request, ctx.block_size)
        self._active[decision.worker_id] = self._active.get(decision.worker_id, 0) + blocks
        if ctx.request.request_id:
            self._inflight[ctx.request.request_id] = (decision.worker_id, blocks)
            if len(self._inflight) > _MAX_TRACKED:
                wid, old = self._inflight.popitem(last=False)[1]
                self._active[wid] = max(0, self._active.get(wid, 0) - old)

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        entry = self._inflight.pop(completion.request_id, None)
        if entry is not None and entry[0] in self._active:
            self._active[entry[0]] = max(0, self._active[entry[0]] - entry[1])

    def on_worker_removed(self, worker: Worker) -> None:
        self._active.pop(worker.id, None)
