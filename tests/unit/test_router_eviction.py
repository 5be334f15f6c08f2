"""The router's eviction side: EvictHint, the approximate cache model with every policy,
and request metadata reaching policies through engine events."""

from __future__ import annotations

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.errors import InvalidRequest, NotFound, UnknownPolicy
from kvrouterd.index.keys import chain_keys, namespace_seed, tokens_to_bytes
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies import registry
from kvrouterd.policies.eviction.unicache import CHAT, EVICT_FIRST, STRUCTURAL
from kvrouterd.protocols import (
    CacheMode,
    Completion,
    EventBatch,
    EvictRequest,
    Removed,
    RouteRequest,
    Stored,
    TaskCategory,
)
from kvrouterd.router import Router, RouterSettings

BS = 4


def make(mode=CacheMode.EVENTS, capacity=0, eviction="lru", n=1):
    clock = ManualClock()
    router = Router(RouterSettings(block_size=BS, routing={"name": "round_robin"}, eviction={"name": eviction}), clock)
    for i in range(n):
        router.add_worker(WorkerSpec(f"w{i}", f"h{i}:1", capacity_blocks=capacity, mode=mode))
    return router, clock


def stored(tokens, hashes, parent=None):
    return Stored(token_ids=tuple(tokens), engine_hashes=tuple(hashes), parent_engine_hash=parent, block_size=BS)


def snapshot(router):
    w = router.workers.get("w0")
    return (router.index.count(w.slot), sorted(b.key for b in router.index.leaves(w.slot)),
            dict(w.engine_keys), dict(router.counters))


def seeded(router):
    # two chains: 0-1-2 (engine hashes 100, 101, 102) stored first, 3-4 (200, 201) a second later
    router.apply(EventBatch("w0", 0, (stored(range(12), [100, 101, 102]),)))
    router.clock.advance(1)
    router.apply(EventBatch("w0", 1, (stored(range(100, 108), [200, 201]),)))


def test_evict_hint_returns_leaves_first_with_engine_hashes():
    router, clock = make()
    seeded(router)
    clock.advance(1)
    advice = router.evict_hint(EvictRequest("w0", 4))
    keys = chain_keys(tokens_to_bytes(range(12)), BS, namespace_seed())
    assert advice.keys[:3] == keys[::-1]  # the older chain, leaf first
    assert advice.engine_hashes == [102, 101, 100, 201]
    assert not advice.exhausted and advice.policy == "lru"


def test_evict_hint_engine_hashes_stay_current_as_events_arrive():
    router, _ = make()
    seeded(router)
    router.evict_hint(EvictRequest("w0", 1))
    router.apply(EventBatch("w0", 2, (Removed((102, 101, 100)), stored(range(200, 204), [300]))))
    advice = router.evict_hint(EvictRequest("w0", 10))
    assert sorted(advice.engine_hashes) == [200, 201, 300]
    assert advice.exhausted  # only three blocks are left to free


def test_evict_hint_honours_pinned_engine_hashes_and_keys():
    router, _ = make()
    seeded(router)
    advice = router.evict_hint(EvictRequest("w0", 5), pinned_engine_hashes=[201])
    # 201 pins its ancestor 200 too; the other chain can all go
    assert advice.engine_hashes == [102, 101, 100] and advice.exhausted
    key_201 = router.workers.get("w0").engine_keys[201]
    assert router.evict_hint(EvictRequest("w0", 5, pinned_keys=frozenset({key_201}))).engine_hashes == [102, 101, 100]


@pytest.mark.parametrize("bad, error", [
    (EvictRequest("nope", 3), NotFound),
    (EvictRequest("w0", 0), InvalidRequest),
    (EvictRequest("w0", -2), InvalidRequest),
    (EvictRequest("w0", 3, policy="no-such-policy"), UnknownPolicy),
])
def test_bad_evict_hint_raises_and_changes_nothing(bad, error):
    router, _ = make()
    seeded(router)
    before = snapshot(router)
    first = router.evict_hint(EvictRequest("w0", 5))
    with pytest.raises(error):
        router.evict_hint(bad)
    assert snapshot(router) == before
    assert router.evict_hint(EvictRequest("w0", 5)) == first


def test_evict_hint_with_another_policy_ranks_from_the_index():
    router, _ = make()
    seeded(router)
    advice = router.evict_hint(EvictRequest("w0", 5, policy="lfu"))
    assert advice.policy == "lfu" and len(advice.keys) == 5


@pytest.mark.parametrize("policy", registry.names("eviction"))
def test_approximate_cache_model_works_with_every_policy(policy):
    router, clock = make(mode=CacheMode.APPROXIMATE, capacity=12, eviction=policy)
    slot = router.workers.get("w0").slot
    system = list(range(1000, 1008))  # a shared 2-block prefix
    tasks = [TaskCategory.CHAT, TaskCategory.AGENTIC, TaskCategory.TEMPLATED, TaskCategory.UNTEMPLATED]
    for i in range(40):
        clock.advance(1.5)
        session = f"s{i % 5}"
        tokens = system + [i % 5] * 4 * (1 + i // 5 % 4) + list(range(i * 10, i * 10 + 8))
        r = router.route(RouteRequest(f"r{i}", router.keys_for_tokens(tokens), len(tokens),
                                      session_id=session, task=tasks[i % 4]))
        router.complete(Completion(r.request.request_id))
        assert router.index.count(slot) <= max(12, len(r.request.keys))
        assert all(router.index.holds(slot, k) for k in r.request.keys)  # the request's own blocks stay
    # a repeat of the last prompt hits it all: its blocks were just stored
    r = router.route(RouteRequest("again", list(r.request.keys), len(tokens)))
    assert r.decision.overlap_blocks == len(r.request.keys)
    assert router.counters["approx_evicted"] > 0


def test_engine_stored_events_carry_the_routed_requests_metadata():
    router, clock = make(eviction="unicache")
    policy = router.eviction
    prompt = list(range(16))  # 4 prompt blocks
    r = router.route(RouteRequest("r1", router.keys_for_tokens(prompt), len(prompt),
                                  session_id="conv", task=TaskCategory.CHAT))
    clock.advance(1)
    generated = list(range(500, 508))
    router.apply(EventBatch("w0", 0, (stored(prompt, [1, 2, 3, 4]), stored(generated, [5, 6], parent=4))))
    keys = router.workers.get("w0").engine_keys
    assert [policy.queue_of(0, keys[h]) for h in (1, 4, 5, 6)] == [CHAT] * 4

    templ = list(range(50, 58))  # a templated single-turn request: its generated blocks go first
    router.route(RouteRequest("r2", router.keys_for_tokens(templ), len(templ), task=TaskCategory.TEMPLATED))
    router.apply(EventBatch("w0", 1, (stored(templ, [7, 8]), stored(range(900, 904), [9], parent=8))))
    assert [policy.queue_of(0, keys[h]) for h in (7, 8, 9)] == [STRUCTURAL, STRUCTURAL, EVICT_FIRST]

    # blocks no routed request explains are unlabelled: structural, as TaskCategory.resolve says
    router.apply(EventBatch("w0", 2, (stored(range(700, 704), [10]),)))
    assert policy.queue_of(0, keys[10]) == STRUCTURAL
    assert r.worker.id == "w0"
