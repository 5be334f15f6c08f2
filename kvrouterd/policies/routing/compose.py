"""``compose``: one policy restricts the candidates, another chooses among them.

DualMap's routing has two halves that other policies can reuse (DualMap section 3.2): a
*candidate set* (the two workers its dual hash ring gives a prefix) and a *choice* between
them (its SLO-aware rule). ``compose`` keeps the first and swaps the second for any routing
policy's own choice, e.g. DualMap's pair scored by LBGR's learned latency estimate (LBGR
section 4.2): the scorer sees a ``RoutingContext`` holding only the restricting policy's
candidates and selects among them exactly as it would among all workers. No paper runs
such a pair; it is how issue #13 asks combinations to be tried.

The restricting policy must offer ``candidate_ids(ctx) -> list[str]`` (``dualmap`` does);
when it names none of the eligible workers, the scorer sees all of them. Both policies get
every hook (``on_dispatch`` with the full context, ``on_complete``, ``tick``, worker
changes), so DualMap's hotness window and latency model and LBGR's queue load stay current.
The decision is the scorer's, with ``policy = "compose"`` (completions come back to this
object) and the candidate set in ``candidates``.

Parameters (``ComposeParams``):

- ``candidates`` = "dualmap": the restricting policy.
- ``scorer`` = "lbgr": the policy that chooses.
- ``candidates_params`` = {}, ``scorer_params`` = {}: their parameters, as in their own specs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ...index.workers import Worker
from ...protocols import Completion, Decision, RouteRequest
from ..base import RoutingContext, RoutingPolicyBase
from ..registry import build, build_params, policy_class  # a client: builds its two policies by name

__all__ = ["ComposeParams", "ComposePolicy"]


@dataclass(frozen=True)
class ComposeParams:
    candidates: str = field(default="dualmap", metadata={"help": "routing policy that restricts the candidates"})
    scorer: str = field(default="lbgr", metadata={"help": "routing policy that chooses among them"})
    candidates_params: dict[str, Any] = field(default_factory=dict, metadata={"help": "parameters of `candidates`"})
    scorer_params: dict[str, Any] = field(default_factory=dict, metadata={"help": "parameters of `scorer`"})

    def validate(self) -> None:
        for what in ("candidates", "scorer"):
            if getattr(self, what) == "compose":
                raise ValueError(f"{what} cannot be compose itself")
            if not isinstance(getattr(self, f"{what}_params"), dict):
                raise ValueError(f"{what}_params must be a mapping of parameter names to values")
        # unknown names and bad parameters fail here, naming the inner policy and field
        build_params("routing", self.scorer, self.scorer_params)
        build_params("routing", self.candidates, self.candidates_params)
        if not callable(getattr(policy_class("routing", self.candidates), "candidate_ids", None)):
            raise ValueError(f"candidates: routing policy {self.candidates!r} does not restrict candidates "
                             "(it has no candidate_ids); use dualmap")


class ComposePolicy(RoutingPolicyBase):
    params: ComposeParams

    def __init__(self, params: ComposeParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self.restrict = build("routing", {"name": params.candidates, **params.candidates_params}, rng)
        self.scorer = build("routing", {"name": params.scorer, **params.scorer_params}, rng)

    def select(self, ctx: RoutingContext) -> Decision:
        allowed = set(self.restrict.candidate_ids(ctx))
        subset = [w for w in ctx.candidates if w.id in allowed] or list(ctx.candidates)
        sub = RoutingContext(ctx.request, subset, ctx.match, ctx.block_size, ctx.now, ctx.index, ctx.explain, ctx.claimed)
        decision = self.scorer.select(sub)
        decision.policy = self.name
        decision.attributes["candidates"] = ",".join(w.id for w in subset)
        decision.attributes["scorer"] = self.params.scorer
        return decision

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        self.restrict.on_dispatch(decision, ctx)
        self.scorer.on_dispatch(decision, ctx)

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        self.restrict.on_complete(worker, request, completion, now)
        self.scorer.on_complete(worker, request, completion, now)

    def on_worker_added(self, worker: Worker) -> None:
        self.restrict.on_worker_added(worker)
        self.scorer.on_worker_added(worker)

    def on_worker_removed(self, worker: Worker) -> None:
        self.restrict.on_worker_removed(worker)
        self.scorer.on_worker_removed(worker)

    def tick(self, now: float) -> None:
        self.restrict.tick(now)
        self.scorer.tick(now)

    def counters(self) -> dict[str, int]:
        out = dict(self.restrict.counters())
        for key, n in self.scorer.counters().items():
            out[key] = out.get(key, 0) + n
        return out
