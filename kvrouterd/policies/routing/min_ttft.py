"""``min_ttft``: Mooncake's scheduler as DualMap evaluates it (DualMap sections 2.2, 3.2, B).

Every eligible worker gets an estimated TTFT = queueing delay of its pending prefill tokens
(estimated by the latency model's ``pending_model``) + prefill time of the request's uncached tokens on it (``TTFT(r, i) = T_q + T_c``, DualMap
Eq. 7), from the shared latency model (``policies.latency``), calibrated online from
``Complete``. The request goes to the minimum (ties to fewer pending tokens, then slot).

Parameters: those of ``LatencyParams`` (``policies.latency``), nothing else.
"""

from __future__ import annotations

from ...index import native
from ...index.workers import Worker
from ...protocols import CandidateScore, Decision
from ..base import RoutingContext
from ..latency import CalibratedRoutingPolicy, LatencyModel, LatencyParams

__all__ = ["MinTTFTPolicy"]


class MinTTFTPolicy(CalibratedRoutingPolicy):
    params: LatencyParams

    def __init__(self, params: LatencyParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self.latency = LatencyModel(params)

    def select(self, ctx: RoutingContext) -> Decision:
        model = self.latency
        if not getattr(ctx, "explain", True) and native.module is not None:
            # one native pass over the loads by slot: pricing every worker here is ~2 us each,
            # ~2 ms a Route at 1,024 workers; this loop, which lists each one's price, is its reference
            picked = native.module.min_ttft_pick(*model.pricing_args(ctx))
            if picked is not NotImplemented:
                index, ttft, pending = picked
                chosen = ctx.candidates[index]
                return self._decided(ctx, chosen, ttft, model.queue_ms(pending, chosen.inflight_requests), [])
        rows = []
        for w in ctx.candidates:
            pending = model.pending_tokens(w, ctx.now)
            queue = model.queue_ms(pending, w.inflight_requests)
            ttft = model.ttft_ms(ctx.uncached_tokens(w), pending, w.inflight_requests)
            rows.append((ttft, queue, ttft - queue, w, pending))
        ttft, queue, _, chosen, _ = min(rows, key=lambda r: (r[0], r[4], r[3].slot))
        scored = []
        if getattr(ctx, "explain", True):
            scored = [ctx.candidate(w, -t, queue_ms=round(q, 3), compute_ms=round(c, 3), ttft_ms=round(t, 3),
                                    pending_tokens=float(pt)) for t, q, c, w, pt in rows]
        return self._decided(ctx, chosen, ttft, queue, scored)

    def _decided(self, ctx: RoutingContext, chosen: Worker, ttft: float, queue: float,
                 scored: list[CandidateScore]) -> Decision:
        decision = self.decide(ctx, chosen, "min_ttft", scored, queue_ms=round(queue, 3), compute_ms=round(ttft - queue, 3),
                               calibrated=int(self.latency.calibrated))
        decision.estimated_ttft_ms = ttft
        return decision
