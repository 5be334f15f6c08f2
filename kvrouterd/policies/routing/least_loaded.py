"""``least_loaded``: the worker with the fewest pending prefill tokens.

Pending prefill tokens are the uncached prompt tokens of requests the router dispatched and
that have not completed: a direct proxy for how long a new prompt would queue. Ties go to
fewer in-flight requests, then fewer engine-reported queued requests, then slot order.
No parameters.
"""

from __future__ import annotations

from ...protocols import Decision
from ..base import RoutingContext, RoutingPolicyBase


class LeastLoadedPolicy(RoutingPolicyBase):
    def select(self, ctx: RoutingContext) -> Decision:
        chosen = min(
            ctx.candidates,
            key=lambda w: (w.pending_prefill_tokens, w.inflight_requests, w.reported_queue, w.slot),
        )
        scored = ([ctx.candidate(w, float(w.pending_prefill_tokens)) for w in ctx.explained(chosen)]
                  if ctx.explain else [])
        return self.decide(ctx, chosen, "min_pending_prefill", scored)
