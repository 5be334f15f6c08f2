"""``RoutingPolicyBase.dispatched_worker``: the candidate a dispatched decision names, without a
pass over the fleet when the policy's own last decision is the one dispatched."""

from __future__ import annotations

import random

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Decision, RouteRequest
from kvrouterd.router import Router, RouterSettings

BS = 16


def _decide(router: Router) -> tuple[Decision, object]:
    tokens = list(range(4 * BS))
    decision, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens(tokens), len(tokens)), explain=False)
    return decision, ctx


def test_the_worker_of_a_decision_is_its_contexts_candidate_whichever_decision_came_last():
    router = Router(RouterSettings(block_size=BS, routing={"name": "min_ttft"}), ManualClock(), random.Random(0))
    for i in range(4):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=CacheMode.EVENTS))
    policy = router.routing_policy("min_ttft")
    first, first_ctx = _decide(router)
    chosen = next(w for w in first_ctx.candidates if w.id == first.worker_id)
    assert policy.dispatched_worker(first, first_ctx) is chosen
    # the chosen worker registers again (a new Worker under the same id), and a second decision
    # is made: the first context's candidate is still the one its decision names
    router.remove_worker(chosen.id)
    router.add_worker(WorkerSpec(chosen.id, "again:1", mode=CacheMode.EVENTS))
    second, second_ctx = _decide(router)
    assert second.worker_id == first.worker_id
    renewed = next(w for w in second_ctx.candidates if w.id == second.worker_id)
    assert renewed is not chosen
    assert policy.dispatched_worker(second, second_ctx) is renewed
    assert policy.dispatched_worker(first, first_ctx) is chosen
    # a decision this policy did not make (another worker named): looked up, or None
    other = next(w for w in second_ctx.candidates if w.id != second.worker_id)
    assert policy.dispatched_worker(Decision(other.id, "x", "x", []), second_ctx) is other
    assert policy.dispatched_worker(Decision("gone", "x", "x", []), second_ctx) is None
