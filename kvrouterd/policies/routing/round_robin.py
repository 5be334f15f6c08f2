"""``round_robin``: eligible workers in turn, ignoring cache and load.

The cursor advances over the candidate list of each request, so workers joining or leaving
only shift the rotation. No parameters.
"""

from __future__ import annotations

from ...protocols import Decision
from ..base import RoutingContext, RoutingPolicyBase


class RoundRobinPolicy(RoutingPolicyBase):
    def __init__(self, params: object, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self._next = 0

    def select(self, ctx: RoutingContext) -> Decision:
        chosen = ctx.candidates[self._next % len(ctx.candidates)]
        listed = [ctx.candidate(w) for w in ctx.explained(chosen)] if ctx.explain else []
        return self.decide(ctx, chosen, "rotation", listed)

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        # Advance only when the decision is committed, so select() stays side-effect free.
        self._next += 1
