"""No single call does unbounded work on the routing loop (issue #16 item 1).

EvictHint ranks at most ``max_evict_blocks`` and at most what the worker holds; ExportIndex
walks a worker in steps and yields to the loop between them, so events applied meanwhile
must leave the export well-formed.
"""

from __future__ import annotations

import asyncio
import random
import sys

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, EventBatch, EvictRequest, Removed, Stored
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.snapshot import export_chunks

from ..invariants import check_router_invariants
from ..steps import run_in_parts

BS = 4


def fleet(chains: int, depth: int, max_evict_blocks: int = 1024) -> Router:
    r = Router(RouterSettings(block_size=BS, max_evict_blocks=max_evict_blocks), ManualClock(), random.Random(0))
    r.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    for c in range(chains):
        tokens = list(range(c * 10_000, c * 10_000 + depth * BS))
        hashes = tuple(c * 1000 + i + 1 for i in range(depth))
        r.apply(EventBatch("w", c, (Stored(token_ids=tokens, engine_hashes=hashes),)))
    return r


def test_evict_hint_for_every_block_there_is_answers_the_configured_cap():
    r = fleet(chains=20, depth=10, max_evict_blocks=50)
    for policy in ("lru", "lfu", "hybrid", "rlt", "tlru", "unicache"):
        advice = r.evict_hint(EvictRequest("w", 4294967295, policy=policy))
        assert len(advice.keys) == 50, policy
        assert not advice.exhausted, policy  # more are evictable: the engine asks again


def test_evict_hint_on_a_small_worker_answers_what_it_holds_and_says_so():
    r = fleet(chains=2, depth=3, max_evict_blocks=50)
    advice = r.evict_hint(EvictRequest("w", 4294967295))
    assert len(advice.keys) == 6 and advice.exhausted
    # leaves before ancestors, all of it
    assert set(advice.engine_hashes) == {1, 2, 3, 1001, 1002, 1003}


def test_export_steps_survive_events_between_steps():
    r = fleet(chains=30, depth=8)
    slot = r.workers.get("w").slot
    before = {b.key for b in r.index.blocks_of(slot)}
    seen: list[tuple[int, int | None, int]] = []
    seq = 30
    for i, part in enumerate(r.export_steps("w", step=16)):
        seen.extend(part)
        if i % 3 == 1:  # an engine evicts a chain's tail and stores a new chain meanwhile
            chain = i % 30
            new_tokens = list(range(900_000 + i * 100, 900_000 + i * 100 + BS))
            r.apply(EventBatch("w", seq, (Removed((chain * 1000 + 8, chain * 1000 + 7)),
                                          Stored(token_ids=new_tokens, engine_hashes=(5_000_000 + i,)))))
            seq += 1
    after = {b.key for b in r.index.blocks_of(slot)}
    keys = [k for k, _, _ in seen]
    assert len(keys) == len(set(keys)), "a block listed twice"
    position = {k: n for n, k in enumerate(keys)}
    for key, parent, _ in seen:
        if parent in position:
            assert position[parent] < position[key], "a child before its parent"
    assert before - after, "the test removed nothing"
    # held throughout: exported; exported: held at some point
    assert before & after <= set(keys) <= before | after


def test_export_ends_when_the_worker_goes_away():
    r = fleet(chains=10, depth=8)
    parts = r.export_steps("w", step=8)
    next(parts)
    r.remove_worker("w")
    assert list(parts) == []


async def test_export_yields_to_the_loop_while_walking_a_large_worker():
    r = fleet(chains=200, depth=20)  # 4,000 blocks
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    chunks = [c async for c in export_chunks(r, (), max_blocks=0, step=100)]
    done = True
    await task
    assert sum(len(c.keys) for c in chunks) == 4000 and len(chunks) == 1
    # the walk visits 4,000 blocks twice (tops, then chains) in steps of 100: other tasks ran
    # between the steps (the old one-step export let none run until it was done)
    assert ticks >= 60


def test_a_removed_worker_leaves_routing_at_once_and_its_blocks_in_steps():
    r = fleet(chains=20, depth=10)
    slot = r.workers.get("w").slot
    worker, steps = r.detach_worker("w", step=16)
    assert "w" not in r.workers and worker.slot == slot
    first = next(steps)
    assert first == 16 and r.index.count(slot) == 200 - 16
    # a worker registered meanwhile gets a fresh slot, never the one still draining
    r.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    assert r.workers.get("w").slot != slot
    assert sum(steps) == 200 - 16
    assert len(r.index) == 0
    # the slot is free again once drained
    r.add_worker(WorkerSpec(id="v", address="v:1", mode=CacheMode.EVENTS))
    assert r.workers.get("v").slot == slot


async def test_deregistering_a_large_worker_yields_to_the_loop(monkeypatch):
    from kvrouterd.server import service as service_module
    from kvrouterd.server.service import KVRouterService

    monkeypatch.setattr(service_module, "DRAIN_STEP_BLOCKS", 100)
    r = fleet(chains=200, depth=20)
    from opentelemetry.sdk.metrics import MeterProvider

    from kvrouterd.telemetry.metrics import Metrics

    service = KVRouterService(r, None, Metrics(MeterProvider(), lambda: len(r.index), lambda: ()), 65536)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await service.forget_worker("w")
    done = True
    await task
    assert len(r.index) == 0 and "w" not in r.workers
    assert ticks >= 30  # 4,000 blocks in steps of 100: the loop ran between them


# ---- Cleared: a large worker is emptied in steps, not in one call ------------------------------

def _conversations(r: Router, chains: int, depth: int) -> None:
    """Route each chain again under a session of its own (T-LRU and UniCache remember them)."""
    from kvrouterd.protocols import Completion, RouteRequest

    for c in range(chains):
        tokens = list(range(c * 10_000, c * 10_000 + depth * BS))
        r.clock.advance(1.0)  # type: ignore[attr-defined]
        result = r.route(RouteRequest(f"q{c}", r.keys_for_tokens(tokens), len(tokens), session_id=f"s{c}"), explain=False)
        r.complete(Completion(result.request.request_id))


@pytest.mark.parametrize("policy", ["lru", "lfu", "hybrid", "rlt", "tlru", "unicache"])
def test_clearing_a_large_worker_moves_it_to_an_empty_slot_and_drains_the_old_one_in_steps(monkeypatch, policy):
    from kvrouterd.router import slots as router_slots
    from kvrouterd.protocols import Cleared

    monkeypatch.setattr(router_slots, "CLEAR_IN_PLACE_BLOCKS", 50)
    monkeypatch.setattr(router_slots, "DRAIN_STEP_BLOCKS", 16)
    r = Router(RouterSettings(block_size=BS, eviction={"name": policy}), ManualClock(), random.Random(0))
    r.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    for c in range(20):
        tokens = list(range(c * 10_000, c * 10_000 + 10 * BS))
        r.apply(EventBatch("w", c, (Stored(token_ids=tokens, engine_hashes=tuple(c * 1000 + i + 1 for i in range(10))),)))
    _conversations(r, 20, 10)
    r.evict_hint(EvictRequest("w", 5))  # the engine-hash map a hint builds is kept current from now on
    old = r.workers.get("w").slot
    # the resync an engine sends: Cleared, then its whole cache again
    tokens = list(range(900_000, 900_000 + 3 * BS))
    r.apply(EventBatch("w", 20, (Cleared(), Stored(token_ids=tokens, engine_hashes=(7, 8, 9)))))
    worker = r.workers.get("w")
    assert worker.slot != old and r.index.count(worker.slot) == 3
    # routing sees the new state at once: the old blocks match nothing for this worker
    assert r.index.match(r.keys_for_tokens(list(range(10 * BS))), worker.bit).overlaps.get(worker.slot, 0) == 0
    assert r.draining and r.index.count(old) < 200  # apply ran one step of the drain
    # the engine-hash map follows the worker: a hint answers the engine's hashes for new blocks
    assert set(r.evict_hint(EvictRequest("w", 3)).engine_hashes) == {7, 8, 9}
    steps = 0
    while r.drain_step():
        steps += 1
        assert r.index.count(old) in range(0, 200)
    assert steps > 200 // 16  # the blocks, then the policy's state, in parts
    assert not r.draining and len(r.index) == 3
    # the old slot is free again, and nothing of the old state is left in the policy
    assert r.workers.next_slot() == old
    ev = r.eviction
    for attr in ("_slots", "_convs", "_tips", "_trim", "_depth", "_phases"):
        assert old not in getattr(ev, attr, {}), attr
    assert old not in ev._leaves._slots  # type: ignore[attr-defined]
    if policy == "tlru":
        assert all(slot != old for slot, _ in ev._recent)  # type: ignore[attr-defined]
    check_router_invariants(r)


def test_clearing_a_small_worker_stays_in_place():
    from kvrouterd.protocols import Cleared

    r = fleet(chains=2, depth=3)
    slot = r.workers.get("w").slot
    r.apply(EventBatch("w", 2, (Cleared(),)))
    assert r.workers.get("w").slot == slot and len(r.index) == 0 and not r.draining


def test_tlru_forgets_a_cleared_slots_conversations_a_part_at_a_time():
    r = Router(RouterSettings(block_size=BS, eviction={"name": "tlru"}), ManualClock(), random.Random(0))
    r.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    for c in range(40):
        r.apply(EventBatch("w", c, (Stored(token_ids=list(range(c * 10_000, c * 10_000 + 4 * BS)), engine_hashes=None),)))
    _conversations(r, 40, 4)
    ev = r.eviction
    slot = r.workers.get("w").slot
    assert len(ev._convs[slot]) == 40 and ev.session_bytes > 0  # type: ignore[attr-defined]
    steps = ev.clear_steps(slot, 8)
    next(steps)
    assert len(ev._convs[slot]) == 32  # type: ignore[attr-defined]
    for _ in steps:
        pass
    assert ev.session_bytes == 0 and not ev._recent and slot not in ev._convs  # type: ignore[attr-defined]


async def test_publish_events_with_a_cleared_large_worker_yields_to_the_loop(monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider

    from kvrouterd.router import slots as router_slots
    from kvrouterd.protocols import Cleared
    from kvrouterd.server.service import KVRouterService
    from kvrouterd.telemetry.metrics import Metrics

    monkeypatch.setattr(router_slots, "CLEAR_IN_PLACE_BLOCKS", 100)
    monkeypatch.setattr(router_slots, "DRAIN_STEP_BLOCKS", 100)
    r = fleet(chains=200, depth=20)  # 4,000 blocks
    service = KVRouterService(r, None, Metrics(MeterProvider(), lambda: len(r.index), lambda: ()), 65536)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    service.apply_batch(EventBatch("w", 200, (Cleared(),)))
    assert r.index.count(r.workers.get("w").slot) == 0 and len(r.index) > 3000  # emptied at once, dropped later
    await service._slot_drain  # type: ignore[misc]
    done = True
    await task
    assert len(r.index) == 0 and not r.draining
    assert ticks >= 30  # 4,000 blocks in steps of 100: the loop ran between them


def test_a_first_hints_engine_hash_map_is_built_in_parts_and_stays_right_across_events():
    r = fleet(chains=30, depth=8)
    worker = r.workers.get("w")
    parts = r.engine_hash_steps("w", step=16)
    next(parts)
    # a native map is sized for the worker ahead (with room for blocks stored meanwhile): its
    # table never grows inside a part, where rehashing 350k entries held the loop ~10 ms
    table_bytes = sys.getsizeof(r._engine_hashes.by_slot[worker.slot])
    # the map is in place and partial; events between parts keep it current
    r.apply(EventBatch("w", 30, (Removed((1001, 1002, 5008)),
                                 Stored(token_ids=list(range(900_000, 900_000 + 2 * BS)), engine_hashes=(77, 78)))))
    n = 1
    for _ in parts:
        n += 1
    assert n >= 30 * 8 // 16
    expected = {key: eh for eh, key in worker.engine_keys.items()}
    assert dict(r._engine_hashes.by_slot[worker.slot].items()) == expected
    if native.module is not None:
        assert sys.getsizeof(r._engine_hashes.by_slot[worker.slot]) == table_bytes
    assert 77 in expected.values() and 1001 not in expected.values()
    assert list(r.engine_hash_steps("w")) == []  # built: later hints pay nothing


@pytest.mark.parametrize("policy", ["lru", "lfu", "hybrid", "tlru", "unicache"])
def test_a_hint_for_a_policy_without_its_own_order_scores_the_leaves_in_parts(policy):
    """The daemon's policy is rlt, so the hinted one saw no hooks and scores every leaf: the host
    runs that in parts, and the answer is the one the hint computed at once gives."""
    def build() -> Router:
        r = fleet(chains=60, depth=4, max_evict_blocks=50)
        r.eviction = r._policies.eviction_by_name["rlt"] = r.eviction_policy("rlt")
        del r._policies.eviction_by_name["lru"]
        return r

    at_once = build().evict_hint(EvictRequest("w", 4294967295, policy=policy))
    r = build()
    parts, advice = run_in_parts(r.evict_hint_steps(EvictRequest("w", 4294967295, policy=policy), step=8))
    assert parts >= 60 // 8  # 60 leaves, 8 scored per part
    assert advice == at_once and len(advice.keys) == 50


def test_events_between_the_parts_never_make_a_hint_name_a_gone_block_or_a_parent_first():
    r = fleet(chains=40, depth=3, max_evict_blocks=1000)
    r.eviction = r._policies.eviction_by_name["rlt"] = r.eviction_policy("rlt")
    del r._policies.eviction_by_name["lru"]
    steps = r.evict_hint_steps(EvictRequest("w", 4294967295, policy="lfu"), step=4)
    next(steps)
    next(steps)
    # chain 0 loses its last block and chain 1 grows below its last: neither tail is a leaf now
    r.apply(EventBatch("w", 40, (Removed((3,)),
                                 Stored(token_ids=list(range(10_000, 10_000 + 4 * BS)), engine_hashes=(1001, 1002, 1003, 9999)))))
    _, advice = run_in_parts(steps)
    assert 3 not in advice.engine_hashes
    slot = r.workers.get("w").slot
    for n, key in enumerate(advice.keys):
        block = r.index.get(key)
        assert block is not None and block.holders >> slot & 1
        # every held child of a named block is named before it
        for child in block.iter_children():
            if child.holders >> slot & 1:
                assert child.key in advice.keys[:n]


async def test_export_fills_each_chunk_a_step_of_blocks_at_a_time(monkeypatch):
    from kvrouterd.server import snapshot as snapshot_module

    r = fleet(chains=200, depth=20)  # 4,000 blocks
    parts: list[int] = []
    extend = snapshot_module._extend

    def recording(chunk, part):  # type: ignore[no-untyped-def]
        parts.append(len(part))
        extend(chunk, part)

    monkeypatch.setattr(snapshot_module, "_extend", recording)
    chunks = [c async for c in export_chunks(r, (), max_blocks=1500, step=100)]
    assert [len(c.keys) for c in chunks] == [1500, 1500, 1000]
    assert len({k for c in chunks for k in c.keys}) == 4000
    # a 1,500-block message was never built from its blocks in one call
    assert max(parts) <= 100 and sum(parts) == 4000
