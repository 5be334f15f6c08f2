"""ZMQ engines on the event bus: real PUB sockets (vLLM / SGLang layouts) -> ``kvrouterd bridge``
-> a real nats-server -> two replicas, compared with a router subscribed to the engines itself."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvrouterd.benchmarks.nats_server import NatsServer, free_port
from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.errors import BusUnavailable, ConfigError
from kvrouterd.events import ZmqEndpoint, ZmqEventsConfig, ZmqEventSource
from kvrouterd.events.bridge import decode_bridged
from kvrouterd.events.parts import MAX_PART_BLOCKS, batch_blocks
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, EventBatch, WorkerState
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.app import Daemon
from kvrouterd.server.bridge import BridgeProcess
from tests.integration.engine_wire import SGLANG, VLLM_011, VLLM_026, EngineWire
from tests.integration.test_nats_bus import stream_last_seq, wait_applied
from tests.integration.test_zmq_events import FakeEngine

BS = 16
MODEL = "m"

Blocks = dict[str, list[tuple[int, int | None, int]]]


async def until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"{what} not reached in time"
        await asyncio.sleep(0.01)


class Fleet:
    """Engines, one bridge, two replicas and a reference router reading the engines directly."""

    def __init__(self, server: NatsServer, ctx: zmq.asyncio.Context) -> None:
        self.server, self.ctx = server, ctx
        self.engines: dict[str, tuple[FakeEngine, EngineWire]] = {}
        self.replicas: list[Daemon] = []
        self.bridge: BridgeProcess | None = None
        self.reference = Router(RouterSettings(block_size=BS), ManualClock())
        self.direct = ZmqEventSource(
            ZmqEventsConfig(replay_timeout_s=0.5),  # wired as server/app.py wires it without a bus
            lambda batch: self.reference.apply(batch, per_event=True),
            lambda wid, lost: self.reference.reset_events(wid, lost=lost), ctx=ctx,
            rejected=lambda wid, counts, lost: self.reference.note_rejected_events(wid, counts, lost_removal=lost),
        )

    def add_engine(self, worker_id: str, wire: EngineWire, *, replay: bool = True) -> FakeEngine:
        engine = FakeEngine(self.ctx, new_replay_layout=wire.new_replay_layout, replay=replay)
        self.engines[worker_id] = (engine, wire)
        return engine

    def config(self) -> dict[str, Any]:
        workers = []
        for wid, (engine, _) in self.engines.items():
            spec = f"{engine.endpoint}?model={MODEL}" + (f"&replay={engine.replay_endpoint}" if engine.replay_endpoint else "")
            workers.append({"id": wid, "address": f"{wid}.local:8000", "capacity_blocks": 100_000, "mode": "events",
                            "kv_events_endpoint": spec})
        return {"listen": "127.0.0.1:0", "block_size": BS, "workers": workers,
                "events": {"replay_timeout_s": 0.5, "allowed_endpoints": ["127.0.0.0/8"],  # engines on loopback
                           "bus": {"kind": "nats", "url": self.server.url, "connect_timeout_s": 2, "snapshot_interval_s": 0}}}

    async def start(self) -> None:
        for seed in (1, 2):
            replica = Daemon(parse_config(self.config()), seed=seed)
            await replica.start()
            self.replicas.append(replica)
        await self.start_bridge()
        for wid, (engine, _) in self.engines.items():
            self.reference.add_worker(WorkerSpec(id=wid, address=f"{wid}.local:8000", mode=CacheMode.EVENTS))
            self.direct.add(ZmqEndpoint(wid, engine.endpoint, engine.replay_endpoint, model=MODEL))
            await engine.wait_subscribed()  # the reference's subscription

    async def start_bridge(self) -> None:
        self.bridge = BridgeProcess(parse_config(self.config()))
        await self.bridge.start()
        for engine, _ in self.engines.values():
            await engine.wait_subscribed()

    async def settle(self) -> None:
        """Until the bridge and the reference saw every batch and the replicas applied the stream."""
        assert self.bridge is not None
        subs = self.bridge.bridge.source.subscribers
        for wid, (engine, _) in self.engines.items():
            await until(lambda: subs[wid].stats.last_sequence == engine.seq - 1
                        and self.direct.subscribers[wid].stats.last_sequence == engine.seq - 1, what=f"{wid} received")
        assert await self.bridge.bridge.drained(10)
        await wait_applied(self.replicas, self.server.url)

    def blocks(self, router: Router) -> Blocks:
        return {w: sorted(router.export_blocks(w)) for w in self.engines}

    async def close(self) -> None:
        if self.bridge is not None:
            await self.bridge.stop()
        await self.direct.close()
        for replica in self.replicas:
            await replica.stop(grace=0)
        for engine, _ in self.engines.values():
            await engine.close()


@pytest.fixture
async def fleet(nats_server: NatsServer) -> AsyncIterator[Fleet]:
    ctx = zmq.asyncio.Context()
    f = Fleet(nats_server, ctx)
    try:
        yield f
    finally:
        await f.close()
        ctx.term()


class Cache:
    """An engine's cache: chains of pages with its own hashes, published in its wire layout."""

    def __init__(self, engine: FakeEngine, wire: EngineWire, rng: random.Random, base: int) -> None:
        self.engine, self.wire, self.rng, self.next_hash = engine, wire, rng, base
        self.leaves: list[int] = []

    async def store(self, blocks: int, *, drop: bool = False) -> None:
        page = self.wire.default_page
        tokens = [self.rng.randrange(50_000) for _ in range(blocks * BS)]
        hashes = list(range(self.next_hash, self.next_hash + len(tokens) // page))
        self.next_hash += len(hashes)
        self.leaves.extend(hashes[-2:])
        await self.engine.publish(raw=self.wire.batch(self.wire.stored(hashes, tokens)), drop=drop)

    async def evict(self) -> None:
        if self.leaves:
            await self.engine.publish(raw=self.wire.batch(self.wire.removed([self.leaves.pop()])))


def assert_no_gaps_on_replicas(fleet: Fleet) -> None:
    for d in fleet.replicas:
        assert d.events is None  # a replica on the bus never reads ZMQ itself
        assert d.bus is not None and d.bus.stats.rejected == 0 and d.bus.stats.stream_skips == 0
        assert d.router.counters["batches_duplicate"] == 0


async def test_two_replicas_converge_through_one_bridge_on_what_a_direct_subscriber_sees(fleet: Fleet) -> None:
    e0 = fleet.add_engine("gpu-0", VLLM_026)
    e1 = fleet.add_engine("gpu.1", SGLANG)
    await fleet.start()
    rng = random.Random(3)
    caches = [Cache(e0, VLLM_026, rng, 1_000), Cache(e1, SGLANG, rng, 1 << 40)]
    for step in range(40):
        cache = caches[step % 2]
        # one vLLM batch never reaches the subscribers: the bridge replays it from the engine
        await cache.store(rng.randint(1, 4), drop=step == 10)
        if step % 3 == 2:
            await cache.evict()
    await fleet.settle()
    e1.restart()  # SGLang restarts with an empty cache: numbering from 0 again
    for _ in range(5):
        await caches[1].store(2)
    await fleet.settle()

    expected = fleet.blocks(fleet.reference)
    assert all(expected[w] for w in expected)
    for d in fleet.replicas:
        assert fleet.blocks(d.router) == expected
        for w in fleet.engines:
            assert d.router.workers.get(w).state is WorkerState.READY
    assert_no_gaps_on_replicas(fleet)
    assert fleet.bridge is not None
    stats = fleet.bridge.bridge.source.stats()
    assert stats["gpu-0"].gaps == 1 and stats["gpu-0"].replays_ok >= 1  # the dropped batch, replayed once
    assert stats["gpu.1"].restarts == 1
    assert fleet.bridge.bridge.stats.lost_resets == 0 and fleet.bridge.bridge.stats.overflow_dropped == 0


async def test_events_lost_beyond_replay_degrade_every_replica_until_the_engine_clears(fleet: Fleet) -> None:
    engine = fleet.add_engine("gpu-0", VLLM_011, replay=False)  # no replay endpoint: a gap is final
    await fleet.start()
    cache = Cache(engine, VLLM_011, random.Random(5), 1)
    for _ in range(3):
        await cache.store(2)
    await cache.store(1, drop=True)
    await cache.store(2)
    await fleet.settle()
    for d in fleet.replicas:
        w = d.router.workers.get("gpu-0")
        assert w.state is WorkerState.DEGRADED and w.gaps == 1  # counted on the replica, not silently lost
    assert fleet.blocks(fleet.replicas[0].router) == fleet.blocks(fleet.replicas[1].router) == fleet.blocks(fleet.reference)
    assert fleet.bridge is not None and fleet.bridge.bridge.stats.lost_resets == 1

    await engine.publish(raw=VLLM_011.batch(VLLM_011.cleared()))  # the engine resyncs
    await cache.store(3)
    await fleet.settle()
    for d in fleet.replicas:
        assert d.router.workers.get("gpu-0").state is WorkerState.READY
        assert fleet.blocks(d.router) == fleet.blocks(fleet.reference)
        assert len(d.router.export_blocks("gpu-0")) == 3


async def test_a_restarted_bridge_rebuilds_the_view_from_the_engines_replay(fleet: Fleet) -> None:
    engine = fleet.add_engine("gpu-0", VLLM_026)
    await fleet.start()
    cache = Cache(engine, VLLM_026, random.Random(9), 1)
    for _ in range(5):
        await cache.store(2)
    await fleet.settle()
    assert fleet.bridge is not None
    await fleet.bridge.stop()  # the bridge pod is replaced; the engine keeps publishing
    for _ in range(4):
        await cache.store(1)
        await cache.evict()
    await fleet.start_bridge()  # joins the running engine: reset, replay from 0, Cleared first
    await cache.store(2)
    await fleet.settle()
    for d in fleet.replicas:
        assert fleet.blocks(d.router) == fleet.blocks(fleet.reference)
        assert d.router.workers.get("gpu-0").state is WorkerState.READY
    assert fleet.bridge.bridge.source.stats()["gpu-0"].replays_ok == 1


async def test_a_bridge_makes_the_stream_again_when_nats_restarted_without_its_store(
        fleet: Fleet, nats_server: NatsServer, tmp_path: Path) -> None:
    """With no replica up to make the stream again, the bridge does, and what the engine
    publishes after the restart is stored there."""
    engine = fleet.add_engine("gpu-0", VLLM_026)
    await fleet.start()
    cache = Cache(engine, VLLM_026, random.Random(10), 1)
    for _ in range(3):
        await cache.store(2)
    await fleet.settle()
    for replica in fleet.replicas:
        await replica.stop(grace=0)
    fleet.replicas.clear()
    nats_server.stop()
    nats_server.store_dir = tmp_path / "fresh-store"  # the stream is gone with the store
    nats_server.start()
    await cache.store(3)
    await fleet.settle()  # the bridge's publishes acknowledged: the stream exists again
    assert fleet.bridge is not None and fleet.bridge.bridge.stats.publish_retries >= 1
    assert await stream_last_seq(nats_server.url) >= 1


async def test_a_full_bridge_queue_degrades_the_worker_then_resyncs_it(fleet: Fleet, nats_server: NatsServer) -> None:
    engine = fleet.add_engine("gpu-0", VLLM_026)
    await fleet.start()
    assert fleet.bridge is not None
    fleet.bridge.bridge.max_pending = 3
    fleet.bridge.bridge.publish_timeout_s = 0.3
    cache = Cache(engine, VLLM_026, random.Random(13), 1)
    await cache.store(1)
    await fleet.settle()
    nats_server.stop()  # NATS away: calls queue at the bridge, past max_pending
    for _ in range(6):
        await cache.store(1)
    await until(lambda: fleet.bridge is not None and fleet.bridge.bridge.stats.overflow_dropped > 0, what="overflow")
    # room for the rejoin's replay of the engine's batches (deployed: 100,000 calls against
    # an engine replay buffer of ~10,000 steps)
    fleet.bridge.bridge.max_pending = 64
    nats_server.start()
    await until(lambda: fleet.bridge is not None and fleet.bridge.bridge.stats.resubscribes == 1, what="resubscribe")
    # The new subscriber rejoins the engine (replay from 0) on the first batch it receives. A
    # batch published before its SUB socket has joined is lost to it (ZMQ's slow joiner, which a
    # loaded machine makes likely), so the engine keeps publishing, as a serving engine does.
    rejoined = fleet.bridge.bridge.source.subscribers["gpu-0"]
    for _ in range(20):
        await cache.store(1)
        with contextlib.suppress(AssertionError):
            await until(lambda: rejoined.stats.batches_received > 0, timeout=1.0, what="rejoin")
            break
    await fleet.settle()
    stats = fleet.bridge.bridge.stats
    assert stats.lost_resets == 1 and stats.resubscribes == 1 and not stats.overflowed
    for d in fleet.replicas:
        w = d.router.workers.get("gpu-0")
        assert w.gaps >= 1  # told it lost events ...
        assert w.state is WorkerState.READY  # ... and rebuilt by the resubscribe's replay
        assert fleet.blocks(d.router) == fleet.blocks(fleet.reference)


async def test_a_huge_engine_batch_crosses_the_bus_in_parts_each_within_the_message_limits(
        fleet: Fleet, nats_server: NatsServer) -> None:
    """A 20,000-block BlockStored (one vLLM step that prefilled a 320k-token prompt) is 1.4 MB as
    one bridged call, over NATS's max_payload: it goes out as the source's parts, one message
    each, and every replica applies them to the view a direct subscriber has."""
    import nats

    engine = fleet.add_engine("gpu-0", VLLM_026)
    await fleet.start()
    prefix = parse_config(fleet.config()).events.bus.subject_prefix
    nc = await nats.connect(nats_server.url)
    seen: list[bytes] = []

    async def on_message(msg: Any) -> None:
        seen.append(msg.data)

    await nc.subscribe(f"{prefix}.>", cb=on_message)
    try:
        cache = Cache(engine, VLLM_026, random.Random(17), 1)
        await cache.store(20_000)
        await cache.store(3)
        await fleet.settle()
        await nc.flush()
        await until(lambda: sum(isinstance(c, EventBatch) for m in seen for c in decode_bridged(m, 1 << 20)) == 6,
                    what="the parts seen on the bus")
        max_payload = nc.max_payload
    finally:
        await nc.close()
    batches = [[c for c in decode_bridged(m, 1 << 20) if isinstance(c, EventBatch)] for m in seen]
    # the first batch (a Cleared before 20,000 blocks) in 5 parts, then the 3-block batch
    assert [b.sequence for m in batches for b in m] == list(range(6))
    for data, message_batches in zip(seen, batches):
        assert len(data) <= max_payload
        assert sum(batch_blocks(b.events, BS) for b in message_batches) <= MAX_PART_BLOCKS
    expected = fleet.blocks(fleet.reference)
    assert len(expected["gpu-0"]) == 20_003
    for d in fleet.replicas:
        assert fleet.blocks(d.router) == expected
        assert d.router.workers.get("gpu-0").state is WorkerState.READY
    assert_no_gaps_on_replicas(fleet)
    assert fleet.bridge is not None and fleet.bridge.bridge.stats.lost_resets == 0
    assert fleet.bridge.bridge.source.stats()["gpu-0"].parts == 5


async def test_the_bridge_needs_a_reachable_bus() -> None:
    cfg = {"events": {"bus": {"kind": "nats", "url": f"nats://127.0.0.1:{free_port()}", "connect_timeout_s": 0.5}}}
    process = BridgeProcess(parse_config(cfg))
    with pytest.raises(BusUnavailable, match="cannot reach NATS"):
        await process.start()
    await process.stop()
    with pytest.raises(ConfigError, match="events.bus.kind must be 'nats'"):
        BridgeProcess(parse_config({}))


def test_kvrouterd_bridge_exits_2_with_the_url_when_the_bus_is_unreachable(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    config = tmp_path / "kvrouterd.yaml"
    config.write_text(f"events:\n  bus: {{kind: nats, url: '{url}', connect_timeout_s: 0.5}}\n")
    done = subprocess.run([sys.executable, "-m", "kvrouterd", "bridge", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot reach NATS at {url}" in done.stdout

