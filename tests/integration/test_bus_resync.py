"""Bus publishers resync the workers whose view lost events, asked by the replicas.

A real nats-server with JetStream on loopback. A replica restored from the bus snapshot replays a
tail with a hole in it (a message the stream no longer holds): its view of the worker lost events.
A NatsEventPublisher cannot read a PublishEvents answer, so the replica asks it on core NATS and
it answers with Cleared + its engine's snapshot on the stream, without an operator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats
from kvrouter_client import NatsEventPublisher

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.config import parse_config
from kvrouterd.events.nats_bus import resync_subject
from kvrouterd.protocols import WorkerState
from kvrouterd.server.app import Daemon

from .test_router_restart_resync import Engine


BS = 4
STREAM = "KVROUTER_EVENTS"


async def start_replica(url: str, **bus: object) -> Daemon:
    daemon = Daemon(parse_config({
        "listen": "127.0.0.1:0", "block_size": BS,
        "workers": [{"id": "gpu", "address": "gpu.local:8000", "capacity_blocks": 10_000, "mode": "events"}],
        "events": {"bus": {"kind": "nats", "url": url, "connect_timeout_s": 2, **bus}},
    }), seed=1)
    await daemon.start()
    return daemon


async def eventually(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


def mirrors(daemon: Daemon, engine: Engine) -> bool:
    worker = daemon.router.workers.get("gpu")
    return (worker.state is WorkerState.READY and not worker.resync_needed
            and daemon.router.index.count(worker.slot) == engine.blocks)


async def test_a_replica_restored_from_the_bus_snapshot_gets_a_hole_healed_by_the_publisher(nats_server):
    engine = Engine(BS)
    first = await start_replica(nats_server.url, snapshot_interval_s=0.1)
    second: Daemon | None = None
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    pub = NatsEventPublisher(nats_server.url, "gpu", block_size=BS, linger_s=0, timeout=1.0, snapshot=engine.snapshot)
    try:
        async with pub:
            for i in range(2):
                engine.store(pub, 100 * i, 2)
                assert await pub.flush(10)  # one batch each
            await eventually(lambda: mirrors(first, engine) and first.bus is not None
                             and first.bus.stats.last_stream_sequence == 2)
            saved = first.bus.stats.snapshots_saved
            await eventually(lambda: first.bus is not None and first.bus.stats.snapshots_saved > saved)
            await first.stop(grace=0)
            for i in range(2, 5):  # batches 2, 3, 4 while no replica runs
                engine.store(pub, 100 * i, 1 + i % 2)
                assert await pub.flush(10)
            last = (await js.stream_info(STREAM)).state.last_seq
            await js.delete_msg(STREAM, last - 1)  # batch 3 is gone from the stream (age limit, a purge)

            second = await start_replica(nats_server.url, snapshot_interval_s=0)
            worker = second.router.workers.get("gpu")
            assert worker.gaps == 1  # the hole, seen while replaying
            await eventually(lambda: mirrors(second, engine))
            stats = second.bus.stats if second.bus is not None else None
            # restored from the snapshot (stream messages 1-2), then only the tail: every message after
            # it but the deleted one (the publisher's resync, on the stream, included)
            assert stats is not None and stats.messages == stats.last_stream_sequence - 3 and stats.stream_skips == 1
            assert stats.resync_requests >= 1
            assert pub.stats.resyncs_requested == 1 and pub.stats.events_dropped == 0
    finally:
        await nc.close()
        await first.stop(grace=0)
        if second is not None:
            await second.stop(grace=0)


async def test_asks_about_batches_before_the_latest_resync_are_ignored(nats_server):
    """Every replica asks, and asks again until it applied the resync: one resync answers all."""
    engine = Engine(BS)
    nc = await nats.connect(nats_server.url)
    pub = NatsEventPublisher(nats_server.url, "gpu", block_size=BS, linger_s=0, timeout=1.0, snapshot=engine.snapshot)
    try:
        async with pub:
            for i in range(3):
                engine.store(pub, 100 * i, 1)
                assert await pub.flush(10)

            async def ask(last_sequence: int) -> None:
                request = pb.WorkerSequence(worker_id="gpu", last_sequence=last_sequence, resync_needed=True)
                await nc.publish(resync_subject("kvrouter.events", "gpu"), request.SerializeToString())
                await nc.flush()

            await ask(2)
            await eventually(lambda: pub.stats.resyncs_requested == 1 and pub.unacknowledged_batches == 0)
            assert pub._last_resync_seq == 3  # Cleared right after the last batch written
            for last_sequence in (2, 1, 2):  # other replicas, repeats: before batch 3, the resync
                await ask(last_sequence)
            await ask(3)  # a replica that applied the resync and lost events again: resync again
            await eventually(lambda: pub.stats.resyncs_requested == 2)
            await asyncio.sleep(0.2)
            assert pub.stats.resyncs_requested == 2
    finally:
        await nc.close()
