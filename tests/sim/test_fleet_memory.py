"""The simulator's pooled-memory bound (``--shared-cache``): one KV memory the whole fleet reads,
fills, pins and reserves in, heard by the router as every worker's."""

from __future__ import annotations

import random

import pytest

from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError
from kvrouterd.policies.base import NoParams
from kvrouterd.policies.eviction.lru import LRUEviction
from kvrouterd.protocols import CacheMode
from kvrouterd.sim.cluster import ClusterSettings, Simulation, simulate
from kvrouterd.sim.engine import EngineParams, FleetMemory, Job, PooledEngine
from kvrouterd.sim.workloads import SimRequest, Workload


def one_prompt_four_times() -> Workload:
    """The same four-block prompt once a second: round robin alternates two workers."""
    reqs = [SimRequest(float(t), 4 * 64, 2, (11, 12, 13, 14), "s") for t in range(4)]
    return Workload("again", 64, reqs, {})


def test_a_shared_cache_is_a_hit_on_every_engine_and_the_router_hears_it_as_each_workers():
    cfg = parse_config({})
    wl = one_prompt_four_times()
    separate = simulate(cfg, wl, ClusterSettings(workers=2), routing="round_robin", eviction="lru")
    sim = Simulation(cfg, wl, ClusterSettings(workers=2, shared_cache=True), routing="round_robin", eviction="lru")
    shared = sim.run()
    # separate: each worker computes the prompt once; shared: only the first request misses
    assert separate.summary.hit_ratio == pytest.approx(2 / 4)
    assert shared.summary.hit_ratio == pytest.approx(3 / 4)
    assert sim.engines[0].index is sim.engines[1].index
    assert sim.engines[0].cached_blocks == 4  # held once, not once per engine
    keys = sim.keys.keys(wl.requests[0].block_ids)
    index = sim.router.index
    for slot in (sim.router.workers.get("w0").slot, sim.router.workers.get("w1").slot):
        assert all(index.holds(slot, k) for k in keys)


def test_pooled_engines_share_their_room_and_pins():
    params = EngineParams(capacity_blocks=8)
    memory = FleetMemory(LRUEviction(NoParams(), random.Random(0)))
    a, b = (PooledEngine(w, params, memory, 64, lambda i: i.to_bytes(128, "little")) for w in ("a", "b"))
    first = Job(0, SimRequest(0.0, 6 * 64, 1, tuple(range(1, 7))), list(range(1, 7)), 6 * 64, 0)
    second = Job(1, SimRequest(0.0, 6 * 64, 1, tuple(range(11, 17))), list(range(11, 17)), 6 * 64, 0)
    a.enqueue(first)
    assert a.start_step(0.0) is not None
    assert memory.reserved == a.reserved == b.reserved == 6
    b.enqueue(second)
    # 2 of the pool's 8 blocks are free and the other 6 are a's: b's request waits for room
    assert b.start_step(0.0) is None
    assert list(b.waiting) == [second]
    a.finish_step(1.0)
    a.finish(first, 1.0)
    assert memory.reserved == 0 and not memory.pins
    # a's blocks are cached and no longer pinned: b evicts them from the pool to start
    assert b.start_step(1.0) is not None
    assert list(b.waiting) == [] and memory.reserved == 6
    assert a.cached_blocks == b.cached_blocks <= 2


def test_the_bound_is_heard_through_events_only():
    cfg = parse_config({})
    with pytest.raises(ConfigError, match="events"):
        simulate(cfg, one_prompt_four_times(),
                 ClusterSettings(workers=2, shared_cache=True, cache_mode=CacheMode.APPROXIMATE),
                 routing="round_robin", eviction="lru")


def test_room_one_engine_frees_wakes_the_engine_waiting_for_it():
    # a pool of 8 blocks: w0's 6-block request runs, w1's waits for room until w0's ends; with
    # no arrival after it, nothing but that end can start it
    reqs = [SimRequest(0.0, 6 * 64, 4, tuple(range(1, 7)), "a"), SimRequest(0.001, 6 * 64, 4, tuple(range(11, 17)), "b")]
    settings = ClusterSettings(workers=2, shared_cache=True, engine=EngineParams(capacity_blocks=4))
    sim = Simulation(parse_config({}), Workload("two", 64, reqs, {}), settings, routing="round_robin", eviction="lru")
    sim.run()
    first, second = sim.records
    assert first is not None and second is not None
    assert [first.worker, second.worker] == [0, 1]
    assert first.e2e_s < second.ttft_s < float("inf")
