"""No single call does unbounded work on the routing loop (issue #16 item 1).

EvictHint ranks at most ``max_evict_blocks`` and at most what the worker holds; ExportIndex
walks a worker in steps and yields to the loop between them, so events applied meanwhile
must leave the export well-formed.
"""

from __future__ import annotations

import asyncio
import random

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, EventBatch, EvictRequest, Removed, Stored
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.snapshot import export_chunks

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
