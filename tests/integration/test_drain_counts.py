"""While a removed or cleared worker's old blocks are dropped in steps, the counts operators read
already leave them out, as routing does (issue #16), over a real daemon: GetStats, ListWorkers
and the Prometheus gauges, read mid-drain.

The drain is held at its start by a gate the test opens (structure, not timing): the index then
still holds every old block, and every count must already be what it will be once they are gone.
"""

from __future__ import annotations

import asyncio

import pytest

from kvrouterd.router import slots as router_slots
from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.server import service as service_module

from .test_daemon import BS, publish, register, stored
from .test_metrics_endpoint import sample, scrape

#: blocks of the chains below: "a" alone, "a" and "b" both, "b" alone
ALONE_A, SHARED, ALONE_B = 300, 100, 200


@pytest.fixture
def daemon_config():
    return {"metrics": {"listen": "127.0.0.1:0"}}


@pytest.fixture
def small_steps(monkeypatch):
    # a worker of 400 blocks is cleared by the slot move, drained 50 blocks a step
    monkeypatch.setattr(router_slots, "CLEAR_IN_PLACE_BLOCKS", 100)
    monkeypatch.setattr(router_slots, "DRAIN_STEP_BLOCKS", 50)
    monkeypatch.setattr(service_module, "DRAIN_STEP_BLOCKS", 50)


def _chain(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BS))


async def _fleet(stub) -> None:  # type: ignore[no-untyped-def]
    await register(stub, "a")
    await register(stub, "b")
    shared = _chain(10_000, SHARED)
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[
        stored(shared, list(range(1, SHARED + 1))),
        stored(_chain(50_000, ALONE_A), list(range(1001, 1001 + ALONE_A)))]))
    await publish(stub, pb.EventBatch(worker_id="b", sequence=0, events=[
        stored(shared, list(range(1, SHARED + 1))),
        stored(_chain(90_000, ALONE_B), list(range(2001, 2001 + ALONE_B)))]))


async def _counts(running) -> tuple[int, dict[str, int], float, dict[str, float]]:  # type: ignore[no-untyped-def]
    stats = await running.stub.GetStats(pb.GetStatsRequest())
    listed = await running.stub.ListWorkers(pb.ListWorkersRequest())
    assert {w.id: w.cached_blocks for w in stats.workers} == {w.id: w.cached_blocks for w in listed.workers}
    _, _, text = await scrape(running)
    per_worker = {w.id: sample(text, "kvrouter_worker_cached_blocks", worker=w.id) for w in listed.workers}
    return (stats.indexed_blocks, {w.id: w.cached_blocks for w in listed.workers},
            sample(text, "kvrouter_index_blocks"), per_worker)


async def test_counts_leave_a_cleared_workers_old_blocks_out_while_they_drain(running, small_steps, monkeypatch):
    stub, router = running.stub, running.router
    await _fleet(stub)
    assert await _counts(running) == (ALONE_A + SHARED + ALONE_B, {"a": ALONE_A + SHARED, "b": SHARED + ALONE_B},
                                      ALONE_A + SHARED + ALONE_B, {"a": ALONE_A + SHARED, "b": SHARED + ALONE_B})
    gate = asyncio.Event()
    drain_step = router.drain_step
    monkeypatch.setattr(router, "drain_step", lambda: drain_step() if gate.is_set() else True)
    try:
        cleared = asyncio.ensure_future(publish(stub, pb.EventBatch(worker_id="a", sequence=1, events=[
            pb.CacheEvent(cleared=pb.AllBlocksCleared())])))
        while not router.draining:
            await asyncio.sleep(0.01)
        # the old slot's blocks are all still in the index: PublishEvents answers after the drain
        assert len(router.index) == ALONE_A + SHARED + ALONE_B and not cleared.done()
        assert await _counts(running) == (SHARED + ALONE_B, {"a": 0, "b": SHARED + ALONE_B},
                                          SHARED + ALONE_B, {"a": 0, "b": SHARED + ALONE_B})
        # blocks the cleared worker stores again count again at once (its answer, too, waits for the drain)
        again = asyncio.ensure_future(publish(stub, pb.EventBatch(worker_id="a", sequence=2, events=[
            stored(_chain(50_000, 10), list(range(1001, 1011)))])))
        while router.index.count(router.workers.get("a").slot) < 10:
            await asyncio.sleep(0.01)
        assert await _counts(running) == (SHARED + ALONE_B + 10, {"a": 10, "b": SHARED + ALONE_B},
                                          SHARED + ALONE_B + 10, {"a": 10, "b": SHARED + ALONE_B})
    finally:
        gate.set()
    await cleared
    await again
    assert not router.draining and len(router.index) == SHARED + ALONE_B + 10
    assert (await _counts(running))[:2] == (SHARED + ALONE_B + 10, {"a": 10, "b": SHARED + ALONE_B})


async def test_counts_leave_a_deregistered_workers_blocks_out_while_they_drain(running, monkeypatch):
    stub, router = running.stub, running.router
    await _fleet(stub)
    gate = asyncio.Event()
    detach_worker = router.detach_worker

    def gated_detach(worker_id, step):  # type: ignore[no-untyped-def]
        worker, steps = detach_worker(worker_id, step)

        def gated():  # type: ignore[no-untyped-def]
            while not gate.is_set():
                yield 0
            yield from steps

        return worker, gated()

    monkeypatch.setattr(router, "detach_worker", gated_detach)
    try:
        deregistered = asyncio.ensure_future(stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="a")))
        while "a" in router.workers:
            await asyncio.sleep(0.01)
        # its blocks are all still in the index: DeregisterWorker answers after the drain
        assert len(router.index) == ALONE_A + SHARED + ALONE_B and not deregistered.done()
        assert await _counts(running) == (SHARED + ALONE_B, {"b": SHARED + ALONE_B}, SHARED + ALONE_B,
                                          {"b": SHARED + ALONE_B})
    finally:
        gate.set()
    await deregistered
    assert len(router.index) == SHARED + ALONE_B
    assert (await _counts(running))[:2] == (SHARED + ALONE_B, {"b": SHARED + ALONE_B})
