"""LBGR's choice in one native pass (``lbgr_pick``) against its explained pass, which estimates
every worker (``LBGRPolicy.estimates``) and is its reference."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.index import native
from kvrouterd.protocols import Completion, EventBatch, RouteRequest, Stored

from .fleets import BS, TOKENS, decided_alike, needs_native, policy_fleet

_PARAMS = st.fixed_dictionaries({
    "learning_rule": st.sampled_from(["rls", "nlms", "none"]),
    "residual_scope": st.sampled_from(["worker", "fleet"]),
    "residual_target": st.sampled_from(["penalty", "signed"]),
    # one feature (the published router's) on every Python; all four where sum() adds as C does
    "features": st.sampled_from([("bias",), ("load",)] + ([("hit", "miss", "load", "bias")]
                                                         if sys.version_info < (3, 12) else [])),
    "engine_ms_per_1k": st.sampled_from([0.0, 40.0]),
    "alpha_cached_ms_per_1k": st.sampled_from([0.0, 100.0]),
})


@needs_native
@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 24), params=_PARAMS, data=st.data())
def test_the_native_pick_chooses_as_the_explained_pass(size, params, data):
    router, clock = policy_fleet({"name": "lbgr", **params}, size)
    for w in router.workers:
        held = data.draw(st.integers(0, 8))
        if held:
            router.apply(EventBatch(w.id, 0, (Stored(tuple(TOKENS[: held * BS]), None),)))
    ids = sorted(w.id for w in router.workers)
    # requests routed by name and completed: loads that decay, residuals that learn
    for n in range(data.draw(st.integers(0, 30))):
        tokens = [10**6 + 1000 * n + t for t in range(data.draw(st.integers(1, 8)) * BS)]
        routed = router.route(RouteRequest(f"r{n}", router.keys_for_tokens(tokens), len(tokens),
                                           candidate_workers=(data.draw(st.sampled_from(ids)),)))
        clock.advance(data.draw(st.floats(0.0, 0.2)))
        if data.draw(st.booleans()):
            ms = data.draw(st.floats(1.0, 3000.0))
            router.complete(Completion(routed.request.request_id, ttft_ms=ms, e2e_ms=ms + 100.0))
    clock.advance(data.draw(st.floats(0.0, 0.5)))  # the loads decay until the decision
    named = tuple(data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))) if data.draw(st.booleans()) else ()
    decided_alike(router, RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS), candidate_workers=named))


@needs_native
def test_a_worker_that_learned_it_is_slow_loses_the_tie_it_would_win_on_its_slot():
    router, _ = policy_fleet({"name": "lbgr", "learning_rule": "rls", "engine_ms_per_1k": 40.0}, 3)
    w0 = min(router.workers, key=lambda w: w.slot)
    for n in range(20):  # w0 keeps taking far longer than its estimate
        tokens = [10**6 + 1000 * n + t for t in range(4 * BS)]
        routed = router.route(RouteRequest(f"r{n}", router.keys_for_tokens(tokens), len(tokens),
                                           candidate_workers=(w0.id,)))
        router.complete(Completion(routed.request.request_id, ttft_ms=2000.0, e2e_ms=2100.0))
    assert decided_alike(router, RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS))).worker_id == "w1"


@needs_native
def test_the_native_pick_declines_what_it_cannot_estimate_exactly():
    router, _ = policy_fleet({"name": "lbgr"}, 3)
    policy = router.routing_policy("lbgr")
    _, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS)), explain=False)
    args = [ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.prompt_tokens, ctx.block_size, {}, 1.0,
            0.0, 1.0, 1000.0, (3,), {}, None, -1e9, 1e9]
    pick = native.module.lbgr_pick
    assert pick(*args) == (0, float(len(TOKENS)))
    assert pick(*args[:5], {"w0": 5}, *args[6:]) is NotImplemented  # a load the policy keeps as a float
    w0 = min(router.workers, key=lambda w: w.slot)
    policy._learners[w0.id] = type("Fit", (), {"theta": [7]})()
    assert pick(*args[:11], policy._learners, *args[12:]) is NotImplemented  # an int coefficient
    policy._learners[w0.id].theta = [7.0]
    assert pick(*args[:11], policy._learners, *args[12:]) == (1, float(len(TOKENS)))  # w0 learned it is slower
    assert pick(*args[:11], None, [0.5], *args[13:]) == (0, len(TOKENS) + 0.5)  # one fit for the fleet
    # w0's 7 ms held to 0.25 by the residual's range: less than the others' 1 ms of load
    assert pick(*args[:5], {"w1": 1.0, "w2": 1.0}, *args[6:11], policy._learners, None, -1e9, 0.25) == (
        0, len(TOKENS) + 0.25)
    # w0's 100 ms of load decayed by half since; w1 is 60 ms behind: w0 (+50) then goes after it
    assert pick(*args[:5], {"w0": 100.0, "w1": 60.0}, 0.5, *args[7:]) == (2, float(len(TOKENS)))
    assert pick(*args[:5], {"w0": 100.0, "w1": 60.0, "w2": 70.0}, 0.5, *args[7:]) == (1, len(TOKENS) + 30.0)
    assert pick(*args[:3], 2**53, *args[4:]) is NotImplemented
    shrunk = list(ctx.candidates)  # a learner's theta is Python: a getter that empties the list is declined

    class Shrinking:
        @property
        def theta(self) -> list[float]:
            shrunk.clear()
            return [0.0]

    assert pick(shrunk, *args[1:11], {w.id: Shrinking() for w in shrunk}, *args[12:]) is NotImplemented
    assert pick(ctx.candidates, None, *args[2:]) is NotImplemented
    with pytest.raises(TypeError):
        pick(*args[:14])
