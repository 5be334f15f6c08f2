"""``least_loaded``: the worker with the fewest pending prefill tokens.

Pending prefill tokens are the uncached prompt tokens of requests the router dispatched and
that have not completed: a direct proxy for how long a new prompt would queue. Ties go to
fewer in-flight requests, then fewer engine-reported queued requests, then slot order.
No parameters.
"""

from __future__ import annotations

from ...protocols import Decision
from .._scan import least_loaded_index
from ..base import RoutingContext, RoutingPolicyBase


class LeastLoadedPolicy(RoutingPolicyBase):
    def select(self, ctx: RoutingContext) -> Decision:
        # one native pass reading the loads by slot where the extension is built: a min() over
        # 1,024 workers building a key tuple each was ~150 us (policies/_scan.py)
        chosen = ctx.candidates[least_loaded_index(ctx.candidates, ctx.candidate_slots)]
        scored = ([ctx.candidate(w, float(w.pending_prefill_tokens)) for w in ctx.explained(chosen)]
                  if ctx.explain else [])
        return self.decide(ctx, chosen, "min_pending_prefill", scored)
