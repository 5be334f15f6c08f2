"""min_ttft's choice in one native pass (``min_ttft_pick``) against its explained pass, which
prices every worker through the latency model and is its reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, EventBatch, RouteRequest, Stored

from .fleets import BS, TOKENS, decided_alike, needs_native, policy_fleet

_PARAMS = st.fixed_dictionaries({
    "prefill_model": st.sampled_from(["linear", "power_law"]),
    "pending_model": st.sampled_from(["drain", "inflight"]),
    "attention_context_tokens": st.sampled_from([0.0, 500.0, 8192.0]),
    "prefill_chunk_tokens": st.sampled_from([1, 7, 64, 2048]),
})


@needs_native
@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 30), params=_PARAMS, data=st.data())
def test_the_native_pick_chooses_and_prices_as_the_explained_pass(size, params, data):
    router, clock = policy_fleet({"name": "min_ttft", **params}, size)
    model = router.routing_policy("min_ttft").latency
    for _ in range(data.draw(st.integers(0, 40))):  # calibrated or not: the coefficients move
        model.observe(data.draw(st.integers(1, 50_000)), data.draw(st.integers(1, 8)), data.draw(st.floats(0.5, 5_000.0)))
    clock.advance(data.draw(st.floats(0.0, 30.0)))
    # few values: ties on the TTFT and on the pending tokens, down to the slot; pending tokens a
    # block apart tie on the TTFT where the worker with more holds a block more of the prompt
    few = st.integers(0, 3) | st.sampled_from([BS, 2 * BS, 3 * BS])
    for w in router.workers:
        held = data.draw(st.integers(0, 8))
        if held:
            router.apply(EventBatch(w.id, 0, (Stored(tuple(TOKENS[: held * BS]), None),)))
        w.pending_prefill_tokens = data.draw(few | st.integers(0, 200_000))
        w.inflight_requests = data.draw(few)
        if data.draw(st.booleans()):  # a backlog set some time ago (or ahead: a clock behind it)
            model._backlog[w.id] = (float(data.draw(st.integers(0, 300_000))), clock.now() + data.draw(st.floats(-20.0, 5.0)))
    removed = data.draw(st.integers(0, size - 1)) if size > 2 and data.draw(st.booleans()) else None
    if removed is not None:  # a freed slot, then a worker that takes it: slots out of registration order
        router.remove_worker(f"w{removed}")
        router.add_worker(WorkerSpec("late", "late:1", mode=CacheMode.EVENTS))
    ids = sorted(w.id for w in router.workers)
    # or among named workers, as deadline admission reroutes past capacity: their slots read for the Route
    named = tuple(data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))) if data.draw(st.booleans()) else ()
    req = RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS), candidate_workers=named)
    _, ctx, _ = router.decide(req, explain=False)
    backlog, rate, cost = model.pricing_inputs()
    picked = native.module.min_ttft_pick(ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed,
                                         ctx.request.prompt_tokens, ctx.block_size, ctx.now, backlog, rate, cost)
    assert picked is not NotImplemented
    rows = [(model.ttft_ms(ctx.uncached_tokens(w), model.pending_tokens(w, ctx.now), w.inflight_requests),
             model.pending_tokens(w, ctx.now), w.slot, i) for i, w in enumerate(ctx.candidates)]
    ttft, pending, _, index = min(rows)
    assert picked == (index, ttft, pending)
    decided_alike(router, req)


@needs_native
def test_a_cold_prompt_goes_to_the_idle_worker_and_a_cached_one_where_it_is_cheaper():
    router, _ = policy_fleet({"name": "min_ttft"}, 6)
    for n, wid in enumerate(("w0", "w1", "w0")):  # routed to each by name: prefill queued there
        tokens = [2 * 10**6 + 10**4 * n + t for t in range(125 * BS)]
        router.route(RouteRequest("", router.keys_for_tokens(tokens), len(tokens), candidate_workers=(wid,)))
    cold = RouteRequest("", router.keys_for_tokens([10**6 + t for t in range(8 * BS)]), 8 * BS)
    assert decided_alike(router, cold).worker_id == "w2"  # the lowest idle slot
    router.apply(EventBatch("w4", 0, (Stored(tuple(TOKENS), None),)))
    assert decided_alike(router, RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS))).worker_id == "w4"  # nothing to prefill


@needs_native
def test_the_native_pick_declines_what_it_cannot_price_exactly():
    router, _ = policy_fleet({"name": "min_ttft"}, 4)
    model = router.routing_policy("min_ttft").latency
    _, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS)), explain=False)
    backlog, rate, cost = model.pricing_inputs()

    def pick(**changed):
        args = {"candidates": ctx.candidates, "slots": ctx.candidate_slots, "overlaps": ctx.match.overlaps,
                "claimed": ctx.claimed, "prompt_tokens": ctx.request.prompt_tokens, "block_size": ctx.block_size,
                "now": ctx.now, "backlog": backlog, "rate": rate, "cost": cost} | changed
        return native.module.min_ttft_pick(*args.values())

    assert pick()[0] == 0
    assert pick(slots=None) is NotImplemented and pick(candidates=ctx.candidates[:3]) is NotImplemented
    assert pick(cost=cost[:1] + (1,) + cost[2:]) is NotImplemented  # an int coefficient: Python's exact arithmetic
    assert pick(prompt_tokens=2**53) is NotImplemented
    ctx.candidates[1].pending_prefill_tokens = 5
    assert pick(backlog={"w1": (3, "soon")}) is NotImplemented  # a backlog the model does not keep
    assert pick(backlog={"w1": (float("inf"), 0.0)}) is NotImplemented  # round() raises there
    # past what int64 arithmetic holds (the Python pass's ints do not overflow)
    assert pick(prompt_tokens=-2**63) is NotImplemented
    w0 = ctx.candidates[0]
    assert pick(overlaps={w0.slot: -2**63}, claimed={w0.slot: 1}) is NotImplemented
    w0.pending_prefill_tokens = -2**63
    assert pick() is NotImplemented
    with pytest.raises(TypeError):
        native.module.min_ttft_pick(ctx.candidates)


@needs_native
@pytest.mark.parametrize("left, pending", [(1003.5, 1004), (1002.5, 1002), (1002.4, 1002), (-0.5, 0), (7e9, 5000)])
def test_a_draining_backlog_is_rounded_as_the_model_rounds_it(left, pending):
    """round(): to the nearest, ties to even, then held between 0 and what is committed."""
    router, clock = policy_fleet({"name": "min_ttft"}, 1)
    model = router.routing_policy("min_ttft").latency
    worker = next(iter(router.workers))
    worker.pending_prefill_tokens = 5000
    model._backlog[worker.id] = (left, clock.now())
    _, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS)), explain=False)
    backlog, rate, cost = model.pricing_inputs()
    picked = native.module.min_ttft_pick(ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed,
                                         ctx.request.prompt_tokens, ctx.block_size, ctx.now, backlog, rate, cost)
    assert picked[2] == model.pending_tokens(worker, ctx.now) == pending


@needs_native
@pytest.mark.parametrize("prefill_model", ["linear", "power_law"])
def test_a_tie_on_the_ttft_goes_to_the_fewer_pending_tokens_before_the_slot(prefill_model):
    """w0 holds a block of the prompt and has a block's worth of prefill pending: the same work
    as w1's whole prompt, so the same TTFT; the one with less queued goes first."""
    router, _ = policy_fleet({"name": "min_ttft", "prefill_model": prefill_model, "pending_model": "inflight"}, 2)
    w0, w1 = sorted(router.workers, key=lambda w: w.slot)
    router.apply(EventBatch(w0.id, 0, (Stored(tuple(TOKENS[:BS]), None),)))
    w0.pending_prefill_tokens = BS
    assert decided_alike(router, RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS))).worker_id == w1.id
