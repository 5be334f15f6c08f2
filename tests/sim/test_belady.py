"""The simulator's clairvoyant ``belady`` eviction: optimal on one cache (against a brute force),
better than LRU where LRU thrashes, run by ``sim cluster`` and refused by the daemon."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError, UnknownPolicy
from kvrouterd.index.radix import RadixIndex
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies import registry
from kvrouterd.policies.base import AccessInfo, EvictionContext, NoParams, drop_blocks
from kvrouterd.protocols import CacheMode, EvictRequest
from kvrouterd.router import Router, RouterSettings
from kvrouterd.sim.belady import BeladyEviction, NextUse
from kvrouterd.sim.cluster import ClusterSettings, simulate
from kvrouterd.sim.engine import EngineParams
from kvrouterd.sim.policy_specs import build_eviction, policy_spec
from kvrouterd.sim.workloads import SimRequest, Workload

#: a small prefix tree of block keys: key -> parent (None: a root)
PARENT = {1: None, 2: None, 3: 1, 4: 1, 5: 2, 6: 3, 7: 2}


def chain(leaf: int) -> tuple[int, ...]:
    """The root-to-``leaf`` chain of keys: one request's prompt."""
    out = []
    node: int | None = leaf
    while node is not None:
        out.append(node)
        node = PARENT[node]
    return tuple(reversed(out))


def belady_for(requests: list[tuple[int, ...]]) -> BeladyEviction:
    uses: dict[int, list[int]] = {}
    for n, keys in enumerate(requests):
        for k in keys:
            uses.setdefault(k, []).append(n)
    return BeladyEviction(NoParams(), random.Random(0), NextUse(uses))


def replay(policy, requests: list[tuple[int, ...]], capacity: int) -> int:
    """Prefix-hit blocks of ``requests`` served in order by one cache of ``capacity`` blocks that
    caches every prompt (demand caching), as a ``SimEngine`` admits: the policy frees exactly the
    room the request's missing blocks need, never one of the request's own blocks."""
    index = RadixIndex()
    index.add_slot(0)
    hits = 0
    for n, keys in enumerate(requests):
        match = index.match(keys, 1)
        hit = match.overlap(0)
        need = index.count(0) + len(keys) - hit - capacity
        if need > 0:
            victims = policy.rank(EvictionContext(index, 0, float(n)), need, frozenset(keys))
            assert len(victims) == need
            drop_blocks(policy, index, 0, victims)
        admitting = getattr(policy, "admitting", None)
        if admitting is not None:
            admitting(n)
        if hit:
            index.touch_path(0, match.path[:hit], float(n))
            policy.on_accessed(index, 0, match.path[:hit], AccessInfo(), float(n))
        hits += hit
        if hit < len(keys):
            blocks = index.store(0, keys[hit - 1] if hit else None, keys[hit:], float(n))
            policy.on_stored(index, 0, blocks, AccessInfo(), float(n))
    return hits


def brute_force(requests: list[tuple[int, ...]], capacity: int) -> int:
    """The most prefix-hit blocks any demand-caching eviction gets: every choice of ``need``
    unpinned blocks whose removal leaves a prefix-closed cache, at every request."""
    parent = {k: keys[i - 1] if i else None for keys in requests for i, k in enumerate(keys)}

    @functools.lru_cache(maxsize=None)
    def best(n: int, cached: frozenset[int]) -> int:
        if n == len(requests):
            return 0
        keys = requests[n]
        hit = 0
        while hit < len(keys) and keys[hit] in cached:
            hit += 1
        need = len(cached) + len(keys) - hit - capacity
        choices = [cached]
        if need > 0:
            evictable = sorted(cached - set(keys))
            choices = [cached - set(out) for out in itertools.combinations(evictable, need)
                       if all(parent[k] is None or parent[k] in cached - set(out) for k in cached - set(out))]
        return hit + max(best(n + 1, kept | set(keys)) for kept in choices)

    return best(0, frozenset())


def test_hand_made_sequence_gets_the_optimal_hit_count():
    # 3 blocks of cache; a hot chain 1-3 reused between visits to the 2-5 and 1-4 chains
    requests = [chain(3), chain(5), chain(4), chain(3), chain(5), chain(7), chain(3), chain(4), chain(5)]
    optimal = brute_force(requests, 3)
    assert replay(belady_for(requests), requests, 3) == optimal
    assert replay(registry.build("eviction", "lru"), requests, 3) < optimal


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_get_the_optimal_hit_count(seed):
    rng = random.Random(seed)
    requests = [chain(rng.choice(list(PARENT))) for _ in range(10)]
    capacity = rng.choice([3, 4])
    assert replay(belady_for(requests), requests, capacity) == brute_force(requests, capacity)


def test_beats_lru_where_lru_thrashes():
    # four one-block prompts in a loop through three blocks of cache: LRU always evicts the next one
    requests = [(k,) for k in (11, 12, 13, 14) * 6]
    lru = replay(registry.build("eviction", "lru"), requests, 3)
    assert lru == 0
    # after the first four misses MIN misses about once every three requests: 14 of the 20 later hit
    assert replay(belady_for(requests), requests, 3) == brute_force(requests, 3) == 14


def test_a_leaf_whose_use_went_elsewhere_is_scored_again():
    # block 5's use at request 1 goes to another worker: this cache never touches it, so only
    # the re-scoring before a ranking sees its next use is now request 4, later than 3's
    uses = {1: [0, 2, 3], 3: [0, 3], 2: [1, 4], 5: [1, 4]}
    policy = BeladyEviction(NoParams(), random.Random(0), NextUse(uses))
    index = RadixIndex()
    index.add_slot(0)
    policy.admitting(0)
    policy.on_stored(index, 0, index.store(0, None, [1, 3], 0.0), AccessInfo(), 0.0)
    policy.on_stored(index, 0, index.store(0, None, [2, 5], 0.0), AccessInfo(), 0.0)
    policy.admitting(2)  # requests 1 (elsewhere) and 2 (root 1 only) are past
    victims = policy.rank(EvictionContext(index, 0, 2.0), 1, frozenset({1}))
    assert [b.key for b in victims] == [5]


def tiny_loop(rounds: int = 6) -> Workload:
    """Four one-block-chain sessions taking turns, one request a second."""
    reqs = []
    for t in range(4 * rounds):
        s = t % 4
        reqs.append(SimRequest(float(t), 4 * 64, 4, (1000 + s, 2000 + s, 3000 + s, 4000 + s), f"s{s}"))
    return Workload("loop", 64, reqs, {})


def test_simulator_runs_belady_in_its_engines():
    cfg = parse_config({})
    wl = tiny_loop()
    settings = ClusterSettings(workers=1, engine=EngineParams(capacity_blocks=12))
    lru = simulate(cfg, wl, settings, routing="round_robin", eviction="lru")
    bound = simulate(cfg, wl, settings, routing="round_robin", eviction="belady")
    assert bound.eviction == "belady"
    assert bound.summary.hit_ratio > lru.summary.hit_ratio
    assert policy_spec(cfg, "eviction", "belady") == {"name": "belady"}
    with pytest.raises(ConfigError, match="belady"):
        policy_spec(cfg, "eviction", "belady", {"belady": {"horizon": 3}})
    with pytest.raises(ConfigError, match="events"):
        simulate(cfg, wl, ClusterSettings(workers=1, engine=EngineParams(capacity_blocks=12),
                                          cache_mode=CacheMode.APPROXIMATE), routing="round_robin", eviction="belady")
    with pytest.raises(ConfigError, match="future"):
        build_eviction({"name": "belady"}, random.Random(0), None)


def test_the_daemon_refuses_belady_saying_why():
    with pytest.raises(ConfigError, match="simulator") as err:
        registry.build("eviction", "belady")
    assert "unknown" not in str(err.value)
    assert "belady" not in registry.names("eviction")
    with pytest.raises(ConfigError, match="eviction.*simulator"):
        parse_config({"eviction": "belady"})
    router = Router(RouterSettings(block_size=4), ManualClock())
    router.add_worker(WorkerSpec("w0", "h0:1"))
    with pytest.raises(UnknownPolicy, match="simulator"):
        router.evict_hint(EvictRequest("w0", 3, policy="belady"))
