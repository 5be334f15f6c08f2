"""``cache_affinity``: always the worker holding the longest cached prefix of the prompt.

The *Cache Affinity* baseline of DualMap (section 2.2, 4.1): it maximises KV reuse and ignores
load entirely, so a hot prefix piles onto one worker. Ties (including a prompt nobody has
cached) go to the worker with fewer pending prefill tokens, then the lower slot, so new
prefixes still spread. No parameters.
"""

from __future__ import annotations

from ...protocols import Decision
from ..base import RoutingContext, RoutingPolicyBase

__all__ = ["CacheAffinityPolicy"]


class CacheAffinityPolicy(RoutingPolicyBase):
    def select(self, ctx: RoutingContext) -> Decision:
        chosen = min(ctx.candidates, key=lambda w: (-ctx.overlap(w), w.pending_prefill_tokens, w.slot))
        scored = []
        if getattr(ctx, "explain", True):
            scored = [ctx.candidate(w, float(ctx.overlap(w))) for w in ctx.candidates]
        return self.decide(ctx, chosen, "longest_prefix", scored)
