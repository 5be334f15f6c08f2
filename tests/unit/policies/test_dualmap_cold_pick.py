"""DualMap's fleet-wide (cold) placement in one native pass (``dualmap_cold_pick``) against its
explained placement, which builds and sorts every worker's view and is its reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.protocols import RouteRequest
from kvrouterd.router import Router

from .fleets import BS, decided_alike, needs_native, policy_fleet

PROMPT = 8 * BS
#: short segments, so an 8-block prompt has a key to hash
SHORT = {"segment_tokens": 2 * BS, "base_segments": 2}

def _fleet(size: int, params: dict) -> tuple[Router, ManualClock]:
    return policy_fleet({"name": "dualmap", **SHORT, **params}, size, BS)


def _cold(router: Router, n: int, candidate_workers: tuple[str, ...] = ()) -> RouteRequest:
    tokens = [10**6 + 1000 * n + t for t in range(PROMPT)]  # a prompt nobody holds
    return RouteRequest("", router.keys_for_tokens(tokens), PROMPT, candidate_workers=candidate_workers)


def _alike(router: Router, req: RouteRequest) -> tuple[str, str]:
    """The two workers of a cold placement decided unexplained, as explained."""
    decision = decided_alike(router, req)
    assert decision.reason == "cold_fleet"
    return decision.worker_id, decision.alternative_worker_id


_PARAMS = st.fixed_dictionaries({
    "slo_test": st.sampled_from(["static_threshold", "latency_model"]),
    "decode_bottleneck_s": st.sampled_from([0.0, 1.0]),
    "decode_bottleneck_gate": st.sampled_from(["paper", "guarded"]),
    "prefill_model": st.sampled_from(["linear", "power_law"]),
    "pending_model": st.sampled_from(["drain", "inflight"]),
    "attention_context_tokens": st.sampled_from([0.0, 4096.0]),
    "default_ttft_slo_ms": st.sampled_from([5.0, 50.0, 5000.0]),
    "slo_threshold_tokens": st.sampled_from([0, 100, 5000]),
})


@needs_native
@settings(max_examples=200, deadline=None)
@given(size=st.integers(2, 30), params=_PARAMS, data=st.data())
def test_the_native_placement_is_the_explained_one(size, params, data):
    router, clock = _fleet(size, params)
    policy = router.routing_policy("dualmap")
    clock.advance(data.draw(st.floats(0.0, 30.0)))
    few = st.integers(0, 3)  # few values: ties on every key, down to the slot
    for w in router.workers:
        w.pending_prefill_tokens = data.draw(few | st.integers(0, 100_000))
        w.inflight_requests = data.draw(few)
        w.queued_requests = data.draw(few)
        w.queued_prefill_tokens = data.draw(few | st.integers(0, 50_000))
        w.reported_queue = data.draw(few)
        w.kv_utilization = data.draw(st.sampled_from([0.0, 0.5, 0.99]))
        if data.draw(st.booleans()):  # busy a while, no prefill since: A.7 may flag it
            policy.a7._busy_since[w.id] = clock.now() - data.draw(st.floats(0.0, 10.0))
        if data.draw(st.booleans()):
            policy.latency._backlog[w.id] = (float(data.draw(st.integers(0, 200_000))),
                                             clock.now() - data.draw(st.floats(0.0, 5.0)))
    ids = sorted(w.id for w in router.workers)
    named = tuple(data.draw(st.lists(st.sampled_from(ids), min_size=2, unique=True))) if data.draw(st.booleans()) else ()
    req = _cold(router, data.draw(st.integers(0, 10**6)), named)
    _, ctx, _ = router.decide(req, explain=False)
    backlog, rate, cost = policy.latency.pricing_inputs()
    slo = policy.slo_ms(req)
    threshold = policy.threshold_tokens(slo)
    picked = native.module.dualmap_cold_pick(
        ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed, ctx.request.prompt_tokens, ctx.block_size,
        ctx.now, backlog, rate, cost, slo, threshold if params["slo_test"] == "static_threshold" else -1,
        policy.bottleneck_ms if policy.a7.limit_s > 0 else None)
    assert picked is not NotImplemented
    _alike(router, req)


@needs_native
def test_a_cold_prompt_skips_the_loaded_and_the_stalled():
    router, clock = _fleet(6, {"decode_bottleneck_s": 1.0})
    policy = router.routing_policy("dualmap")
    workers = sorted(router.workers, key=lambda w: w.slot)
    workers[0].queued_prefill_tokens = 10_000  # prefill waiting for it in the router's queue
    workers[0].queued_requests = 2
    stalled = workers[1]  # busy for 5 s, no prefill finished, its engine reports a queue: A.7
    stalled.inflight_requests, stalled.reported_queue = 1, 3
    policy.a7._busy_since[stalled.id] = clock.now() - 5.0
    assert _alike(router, _cold(router, 1)) == ("w2", "w3")


@needs_native
def test_the_native_placement_declines_what_it_cannot_price_exactly():
    router, _ = _fleet(4, {})
    policy = router.routing_policy("dualmap")
    _, ctx, _ = router.decide(_cold(router, 2), explain=False)
    backlog, rate, cost = policy.latency.pricing_inputs()
    args = [ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed, ctx.request.prompt_tokens,
            ctx.block_size, ctx.now, backlog, rate, cost, 5000.0, 1000, None]
    pick = native.module.dualmap_cold_pick
    assert pick(*args) == (0, 1)
    workers = sorted(router.workers, key=lambda w: w.slot)
    workers[0].queued_requests = 2**64  # past 64 bits: the reference adds it exactly
    assert pick(*args) is NotImplemented
    workers[0].queued_requests = 0
    workers[1].inflight_requests, workers[1].reported_queue = 1, 1
    assert pick(*args[:12], lambda w, now: 1) is NotImplemented  # a stall that is not a float
    assert pick(*args[:12], lambda w, now: 0.0) == (0, 1)  # w1 is asked, and not stalled
    assert pick(*args[:12], lambda w, now: 5.0) == (0, 2)  # w1 stalled: overloaded, last
    with pytest.raises(ZeroDivisionError):
        pick(*args[:12], lambda w, now: 1 / 0)
    # the stall callback is Python: what it changes is read afresh, or declined
    shrunk = list(ctx.candidates)
    assert pick(shrunk, *args[1:12], lambda w, now: shrunk.clear() or 0.0) is NotImplemented
    assert pick(*args[:12], lambda w, now: workers[0].slot_loads.move(5000, 5000) or 0.0) == (0, 1)
    with pytest.raises(TypeError):
        pick(*args[:10])


@needs_native
def test_views_alike_in_overload_and_ttft_go_to_the_less_loaded_before_the_lower_slot():
    """A cost of 1 ms a token makes a stall of 10 ms cost what 10 tokens queued cost: w1 (stalled,
    nothing queued) and w0 (10 tokens queued) tie on the TTFT, every view is over a threshold
    of 0 tokens, and the less loaded goes first."""
    router, _ = _fleet(4, {})
    _, ctx, _ = router.decide(_cold(router, 3), explain=False)
    w0, w1, w2, w3 = sorted(router.workers, key=lambda w: w.slot)
    w0.queued_prefill_tokens = 10
    w1.inflight_requests, w1.reported_queue = 1, 1
    w2.queued_prefill_tokens = w3.queued_prefill_tokens = 100
    one_ms_a_token = (True, 1000.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0)
    picked = native.module.dualmap_cold_pick(
        ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed, ctx.request.prompt_tokens, ctx.block_size,
        ctx.now, None, 1.0, one_ms_a_token, 5000.0, 0, lambda w, now: 10.0 if w is w1 else 0.0)
    assert [ctx.candidates[i] for i in picked] == [w1, w0]
