"""Speculative blocks (``router/speculative.py``): a routed prompt counts as cached on its events-mode
worker at once, until its engine's Stored confirms it, its TTL passes, or it is dropped."""

from __future__ import annotations

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.errors import ConfigError
from kvrouterd.index.radix import RadixIndex
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Cleared, Completion, Dispatch, EventBatch, EvictRequest, Removed, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings

BS = 16
PROMPT = list(range(8 * BS))  # 8 blocks


def make(n=2, mode=CacheMode.EVENTS, pure=False, **settings):
    settings.setdefault("speculative_ttl_s", 5.0)
    clock = ManualClock()
    router = Router(RouterSettings(block_size=BS, **settings), clock)
    if pure:
        router.index = RadixIndex(pure=True)
    for i in range(n):
        router.add_worker(WorkerSpec(f"w{i}", f"h{i}:1", mode=mode))
    return router, clock


def req(router, tokens, rid=""):
    return RouteRequest(rid, router.keys_for_tokens(tokens), len(tokens))


def stored(worker, seq, tokens, parent=None):
    """What an engine publishing our keys as its hashes sends for ``tokens``."""
    return EventBatch(worker, seq, (Stored(tuple(tokens), None, parent),))


def outcomes(router):
    return dict(router.speculative.outcomes)


def test_a_second_route_with_the_same_prefix_sees_the_first_before_any_stored():
    router, _ = make(n=4)
    first = router.route(req(router, PROMPT))
    second = router.route(req(router, PROMPT + list(range(1000, 1000 + 2 * BS))))
    assert second.worker is first.worker
    assert second.decision.overlap_blocks == 8
    # the follow-up's own new blocks are claimed too: the first's 8 taken over, plus its 2
    assert router.speculative.live == 10 and router.speculative.live_on(first.worker.id) == 10


def test_claimed_blocks_place_a_follow_up_but_are_priced_as_uncached_until_stored():
    """An engine admits a request against what it has computed: one admitted while the claimed
    prefix is still being prefilled computes it again, so policies and the load see its cost."""
    router, _ = make(n=4)
    first = router.route(req(router, PROMPT))
    follow = PROMPT + list(range(1000, 1000 + 2 * BS))
    _, ctx, _ = router.decide(req(router, follow))
    assert ctx.overlap(first.worker) == 8 and ctx.claimed == {first.worker.slot: 8}
    assert ctx.uncached_tokens(first.worker) == len(follow)
    router.apply(stored(first.worker.id, 0, PROMPT[: 6 * BS]))
    _, ctx, _ = router.decide(req(router, follow))
    assert ctx.claimed == {first.worker.slot: 2} and ctx.uncached_tokens(first.worker) == len(follow) - 6 * BS
    second = router.route(req(router, follow))
    assert second.worker.pending_prefill_tokens == len(PROMPT) + len(follow) - 6 * BS


def test_off_by_default_in_router_settings_and_for_approximate_workers():
    router, _ = make(speculative_ttl_s=0.0)
    router.route(req(router, PROMPT))
    assert router.speculative.live == 0 and router.indexed_blocks == 0
    approx, _ = make(mode=CacheMode.APPROXIMATE)
    approx.route(req(approx, PROMPT))
    assert approx.speculative.live == 0 and approx.indexed_blocks == 8  # approximate mode's own model


def test_stored_confirms_the_claimed_blocks_and_they_stay():
    router, clock = make()
    r = router.route(req(router, PROMPT))
    wid = r.worker.id
    router.apply(stored(wid, 0, PROMPT[: 5 * BS]))  # a chunked prefill: part of it so far
    assert outcomes(router) == {"confirmed": 5, "expired": 0, "dropped": 0}
    assert router.speculative.live == 3
    clock.advance(6)
    router.tick()
    # the 3 never stored expire; the 5 confirmed are held as any stored block
    assert outcomes(router) == {"confirmed": 5, "expired": 3, "dropped": 0}
    assert router.index.count(r.worker.slot) == 5 and router.speculative.live == 0


def test_unconfirmed_blocks_expire_after_the_ttl_and_leave_the_index():
    router, clock = make(n=4)
    first = router.route(req(router, PROMPT))
    clock.advance(4.9)
    assert router.decide(req(router, PROMPT))[0].worker_id == first.worker.id
    clock.advance(0.2)
    decision, ctx, _ = router.decide(req(router, PROMPT))
    assert ctx.overlap(first.worker) == 0
    assert outcomes(router)["expired"] == 8 and router.indexed_blocks == 0


def test_a_follow_up_keeps_a_shared_prefix_claimed_past_the_first_ttl():
    router, clock = make()
    first = router.route(req(router, PROMPT))
    clock.advance(3)
    second = router.route(req(router, PROMPT + list(range(1000, 1000 + BS))))
    assert second.worker is first.worker
    clock.advance(3)  # the first claim's TTL has passed, the second's has not
    router.tick()
    assert outcomes(router)["expired"] == 0 and router.speculative.live == 9


def test_removed_drops_claimed_blocks():
    router, _ = make()
    r = router.route(req(router, PROMPT))
    keys = list(r.request.keys)
    router.apply(EventBatch(r.worker.id, 0, (Removed(tuple(keys[6:])),)))
    assert outcomes(router) == {"confirmed": 0, "expired": 0, "dropped": 2}
    assert router.speculative.live == 6 and router.index.count(r.worker.slot) == 6


def test_cleared_drops_every_claim_on_the_worker():
    router, _ = make()
    r = router.route(req(router, PROMPT))
    other = router.route(req(router, list(range(5000, 5000 + 4 * BS))))
    router.apply(EventBatch(r.worker.id, 0, (Cleared(),)))
    assert outcomes(router)["dropped"] == 8
    assert router.speculative.live_on(r.worker.id) == 0
    assert router.speculative.live == (4 if other.worker is not r.worker else 0)


def test_a_failed_request_drops_its_claim_and_a_successful_one_leaves_it_to_confirm_or_expire():
    router, clock = make(n=1)
    failed = router.route(req(router, PROMPT, rid="a"))
    router.complete(Completion("a", success=False))
    assert outcomes(router)["dropped"] == 8 and router.indexed_blocks == 0
    router.route(req(router, PROMPT, rid="b"))
    router.complete(Completion("b"))
    assert router.speculative.live == 8  # its Stored events may still be on the bus
    router.apply(stored(failed.worker.id, 0, PROMPT))
    assert outcomes(router)["confirmed"] == 8


def test_removing_the_worker_drops_its_claims():
    router, _ = make(n=1)
    router.route(req(router, PROMPT))
    router.remove_worker("w0")
    assert router.speculative.live == 0 and outcomes(router)["dropped"] == 8


@pytest.mark.parametrize("per_worker, total", [(10, 1 << 19), (1 << 16, 10)])
def test_claims_are_bounded_per_worker_and_in_all_oldest_first(per_worker, total):
    router, _ = make(n=1, speculative_max_blocks_per_worker=per_worker, speculative_max_blocks=total)
    a = router.route(req(router, PROMPT))
    b = router.route(req(router, list(range(5000, 5000 + 6 * BS))))
    # b's 6 blocks did not fit beside a's 8: a's claim gave way
    assert router.speculative.live == 6 and outcomes(router)["dropped"] == 8
    assert not router.index.holds(a.worker.slot, a.request.keys[0])
    assert router.index.holds(b.worker.slot, b.request.keys[5])
    c = router.route(req(router, list(range(9000, 9000 + 20 * BS))))  # longer than the bound: its first 10
    assert router.speculative.live == 10 and router.index.holds(c.worker.slot, c.request.keys[9])
    assert not router.index.holds(c.worker.slot, c.request.keys[10])


def test_eviction_hints_never_name_claimed_blocks_and_exports_leave_them_out():
    router, _ = make(n=1)
    router.apply(stored("w0", 0, list(range(7000, 7000 + 2 * BS))))
    router.route(req(router, PROMPT))
    advice = router.evict_hint(EvictRequest(worker_id="w0", blocks=10))
    stored_keys = set(router.keys_for_tokens(list(range(7000, 7000 + 2 * BS))))
    assert set(advice.keys) == stored_keys
    assert {key for key, _, _ in router.export_blocks("w0")} == stored_keys


def test_a_replica_claims_what_another_routed_and_its_own_echo_changes_nothing():
    router, clock = make()
    keys = list(router.keys_for_tokens(PROMPT))
    d = Dispatch("r1", "w1", prefill_tokens=len(PROMPT), prompt_tokens=len(PROMPT), keys=keys, age_s=1.0)
    router.apply_dispatch(d)
    assert router.speculative.live_on("w1") == 8
    assert router.decide(req(router, PROMPT))[0].worker_id == "w1"
    clock.advance(4.1)  # routed 1 s before it arrived: expires 5 s after that
    router.tick()
    assert outcomes(router)["expired"] == 8
    router.apply_dispatch(d, own=True)
    assert router.speculative.live == 0


def test_a_dispatch_that_comes_after_its_requests_completion_claims_nothing():
    """A fast refusal's Complete can beat its Route's delta over the bus: the late Dispatch
    charges nothing, and must not claim blocks no completion would ever drop."""
    router, _ = make()
    router.apply_completion(Completion("r1", success=False))
    keys = list(router.keys_for_tokens(PROMPT))
    router.apply_dispatch(Dispatch("r1", "w1", prefill_tokens=len(PROMPT), prompt_tokens=len(PROMPT), keys=keys))
    assert router.speculative.live == 0 and router.workers.inflight_count == 0
    assert router.decide(req(router, PROMPT))[0].overlap_blocks == 0


def test_settings_are_validated():
    for bad in ({"speculative_ttl_s": -1.0}, {"speculative_ttl_s": 1e9}, {"speculative_max_blocks": 0},
                {"speculative_max_blocks_per_worker": -5}):
        with pytest.raises(ConfigError):
            RouterSettings(**bad).validate()


def test_the_pure_python_index_agrees():
    """The same story on the reference index (what CI's pure-Python run uses everywhere)."""
    router, _ = make(n=4, pure=True)
    first = router.route(req(router, PROMPT))
    assert router.route(req(router, PROMPT)).worker is first.worker
    router.apply(stored(first.worker.id, 0, PROMPT))
    assert outcomes(router) == {"confirmed": 8, "expired": 0, "dropped": 0}
