"""``random``: a uniformly random eligible worker. The baseline every paper compares against.

No parameters. Randomness comes from the seeded generator the registry passes in.
"""

from __future__ import annotations

from ...protocols import Decision
from ..base import RoutingContext, RoutingPolicyBase


class RandomPolicy(RoutingPolicyBase):
    def select(self, ctx: RoutingContext) -> Decision:
        chosen = ctx.candidates[self.rng.randrange(len(ctx.candidates))]
        listed = [ctx.candidate(w) for w in ctx.explained(chosen)] if ctx.explain else []
        return self.decide(ctx, chosen, "random", listed)
