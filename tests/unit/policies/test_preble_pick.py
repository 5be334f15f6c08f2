"""Preble's choice in one native pass (``preble_pick``) against its explained pass, which
prices every worker through the latency model and is its reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.index import native
from kvrouterd.protocols import EventBatch, RouteRequest, Stored

from .fleets import BS, TOKENS, decided_alike, needs_native, policy_fleet

_PARAMS = st.fixed_dictionaries({
    "hit_threshold": st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    "prefill_model": st.sampled_from(["linear", "power_law"]),
    "pending_model": st.sampled_from(["drain", "inflight"]),
    "attention_context_tokens": st.sampled_from([0.0, 8192.0]),
})


@needs_native
@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 30), params=_PARAMS, data=st.data())
def test_the_native_pick_chooses_and_prices_as_the_explained_pass(size, params, data):
    router, clock = policy_fleet({"name": "preble", **params}, size)
    model = router.routing_policy("preble").latency
    clock.advance(data.draw(st.floats(0.0, 30.0)))
    few = st.integers(0, 3) | st.sampled_from([BS, 2 * BS])  # ties on the cost, down to the slot
    for w in router.workers:
        held = data.draw(st.sampled_from([0, 0, 2, 4, 4, 8]))  # ties on the hit rate too
        if held:
            router.apply(EventBatch(w.id, 0, (Stored(tuple(TOKENS[: held * BS]), None),)))
        w.pending_prefill_tokens = data.draw(few | st.integers(0, 200_000))
        w.inflight_requests = data.draw(st.integers(0, 3))
        if data.draw(st.booleans()):
            model._backlog[w.id] = (float(data.draw(st.integers(0, 300_000))), clock.now() - data.draw(st.floats(0, 5)))
    ids = sorted(w.id for w in router.workers)
    named = tuple(data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))) if data.draw(st.booleans()) else ()
    # the whole prompt, or a longer one: a hit rate of 1 and below it
    tokens = TOKENS + list(range(10**6, 10**6 + data.draw(st.sampled_from([0, 5, 8 * BS]))))
    req = RouteRequest("", router.keys_for_tokens(tokens), len(tokens), candidate_workers=named)
    _, ctx, _ = router.decide(req, explain=False)
    backlog, rate, cost = model.pricing_inputs()
    assert native.module.preble_pick(ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed,
                                      ctx.request.prompt_tokens, ctx.block_size, ctx.now, backlog, rate, cost,
                                      params["hit_threshold"]) is not NotImplemented
    decided_alike(router, req)


@needs_native
def test_a_held_prefix_wins_above_the_threshold_and_load_below_it():
    router, _ = policy_fleet({"name": "preble", "hit_threshold": 0.5, "pending_model": "inflight"}, 4)
    w0, w1, w2, _ = sorted(router.workers, key=lambda w: w.slot)
    router.apply(EventBatch(w1.id, 0, (Stored(tuple(TOKENS[: 6 * BS]), None),)))  # 6 of 8 blocks
    router.apply(EventBatch(w2.id, 0, (Stored(tuple(TOKENS[: 6 * BS]), None),)))
    w1.pending_prefill_tokens, w1.inflight_requests = 500, 1  # w2 holds as much and is idle
    decision = decided_alike(router, RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS)))
    assert (decision.worker_id, decision.reason) == (w2.id, "prefix_hit")
    longer = TOKENS + list(range(10**6, 10**6 + 8 * BS))  # 6 of 16 blocks: below the threshold
    w0.inflight_requests = 1
    decision = decided_alike(router, RouteRequest("", router.keys_for_tokens(longer), len(longer)))
    assert (decision.worker_id, decision.reason) == (w2.id, "load_cost")


@needs_native
def test_the_native_pick_declines_what_it_cannot_price_exactly():
    router, _ = policy_fleet({"name": "preble"}, 3)
    model = router.routing_policy("preble").latency
    router.apply(EventBatch("w2", 0, (Stored(tuple(TOKENS[: 2 * BS]), None),)))
    _, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS)), explain=False)
    backlog, rate, cost = model.pricing_inputs()
    args = [ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed, ctx.request.prompt_tokens,
            ctx.block_size, ctx.now, backlog, rate, cost, 0.5]
    pick = native.module.preble_pick
    assert pick(*args)[0] == 2 and pick(*args)[3] is False  # w2 holds 2 of 8 blocks: a hit rate of 1/4
    # a prompt said to be shorter than the blocks held: the hit rate is held to 1, as min(1, ...)
    assert pick(*args[:4], BS, *args[5:]) == (2, 0.0, 1.0, True)
    assert pick(*args[:10], "half") is NotImplemented
    assert pick(*args[:9], cost[:1] + (1,) + cost[2:], 0.5) is NotImplemented  # an int coefficient
    assert pick(ctx.candidates, None, *args[2:]) is NotImplemented
    with pytest.raises(TypeError):
        pick(*args[:10])
