"""A fake vLLM/SGLang engine on real ZMQ sockets feeding a real Router through ZmqEventSource.

The engine publishes ``[topic, seq, payload]`` on an XPUB socket (a PUB that also tells us when
the subscription has arrived, so no message is lost to ZMQ's slow-joiner window unless a test
drops it on purpose) and answers replay requests on a ROUTER socket the way vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvrouterd.clock import ManualClock
from kvrouterd.events import ZmqEndpoint, ZmqEventsConfig, ZmqEventSource
from kvrouterd.events.sequencing import END_SEQ
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, WorkerState
from kvrouterd.router import Router, RouterSettings

BS = 4
TOPIC = b"kv@test"


class FakeEngine:
    """Publishes batches with engine sequence numbers and serves replays from its buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, *, encoding: str = "map", new_replay_layout: bool = True,
                 replay: bool = True, buffer: int = 1000) -> None:
        self.ctx = ctx
        self.encoding = encoding
        self.new_replay_layout = new_replay_layout
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscription, not only the first
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = 0
        self.router: zmq.asyncio.Socket | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_size = buffer
        self.replay_requests: list[int] = []
        self._replay_task = asyncio.create_task(self._serve_replay()) if replay else None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else ""

    async def wait_subscribed(self) -> None:
        while (await asyncio.wait_for(self.pub.recv(), 5))[:1] != b"\x01":
            pass  # an unsubscribe from a socket the subscriber closed

    # -- events in both encodings --
    def stored(self, hashes, tokens, parent=None, medium=None):
        if self.encoding == "map":
            ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                  "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}
            return ev
        return ["BlockStored", hashes, parent, tokens, BS, None, medium]

    def removed(self, hashes, medium=None):
        if self.encoding == "map":
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        return ["BlockRemoved", hashes, medium]

    def cleared(self):
        return {"type": "AllBlocksCleared"} if self.encoding == "map" else ["AllBlocksCleared"]

    async def publish(self, *events, drop: bool = False, raw: bytes | None = None) -> int:
        """Publish one batch (or buffer it without sending when ``drop``: a lost message)."""
        seq = self.seq
        self.seq += 1
        payload = raw if raw is not None else msgpack.packb([float(seq), list(events), 0])
        self.buffer.append((seq, payload))
        del self.buffer[: -self.buffer_size]
        if not drop:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            self.replay_requests.append(start)
            for seq, payload in self.buffer:
                if seq >= start:
                    head = [ident, b"", TOPIC] if self.new_replay_layout else [ident, b""]
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self.router.close(0)  # type: ignore[union-attr]
        self.pub.close(0)


def tokens(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


@pytest.fixture
async def env():
    ctx = zmq.asyncio.Context()
    router = Router(RouterSettings(block_size=BS), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    cfg = ZmqEventsConfig(topic="kv@", silence_s=5.0, replay_timeout_s=0.5, other_media="track")
    # wired as the daemon wires it (server/app.py): engine batches apply event by event
    source = ZmqEventSource(
        cfg, lambda batch: router.apply(batch, per_event=True), lambda wid, lost: router.reset_events(wid, lost=lost),
        ctx=ctx, rejected=lambda wid, counts, lost: router.note_rejected_events(wid, counts, lost_removal=lost),
    )
    engines: list[FakeEngine] = []

    async def start(**kw) -> FakeEngine:
        engine = FakeEngine(ctx, **kw)
        engines.append(engine)
        source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model="m"))
        await engine.wait_subscribed()
        return engine

    yield router, source, start
    await source.close()
    for e in engines:
        await e.close()
    ctx.term()


async def until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def _overlap(router: Router, keys: list[int], w) -> int:
    n = 0
    for k in keys:
        if router.index.holds(w.slot, k):
            n += 1
        else:
            break
    return n


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_stored_and_removed_by_engine_hash_build_the_router_view(env, encoding):
    router, source, start = env
    engine = await start(encoding=encoding)
    p = tokens(1000, 4)
    await engine.publish(engine.stored([101, 102], p[: 2 * BS]))
    await engine.publish(engine.stored([-3, 104], p[2 * BS :], parent=102))  # SGLang-style signed hash
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.batches_applied == 2)
    assert _overlap(router, block_keys(p, BS, model="m"), router.workers.get("w")) == 4
    await engine.publish(engine.removed([2**64 - 3, 104]))  # the unsigned spelling of -3
    await until(lambda: sub.stats.batches_applied == 3)
    assert _overlap(router, block_keys(p, BS, model="m"), router.workers.get("w")) == 2
    assert router.index.count(router.workers.get("w").slot) == 2
    assert sub.stats.gaps == 0 and sub.stats.malformed == 0
    assert router.workers.get("w").state is WorkerState.READY


@pytest.mark.parametrize("new_layout", [True, False])
async def test_gap_is_repaired_by_replay_in_both_reply_layouts(env, new_layout):
    router, source, start = env
    engine = await start(new_replay_layout=new_layout)
    p = tokens(2000, 3)
    await engine.publish(engine.stored([1], p[:BS]))
    await engine.publish(engine.stored([2], p[BS : 2 * BS], parent=1), drop=True)  # lost on the wire
    await engine.publish(engine.stored([3], p[2 * BS :], parent=2))
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.last_sequence == 2)
    await engine.publish(engine.removed([1]), drop=True)
    await engine.publish(engine.stored([1], p[:BS]))
    await until(lambda: sub.stats.last_sequence == 4)
    assert engine.replay_requests == [1, 3]
    assert sub.stats.gaps == 2 and sub.stats.replays_ok == 2 and sub.stats.desyncs == 0
    w = router.workers.get("w")
    assert w.state is WorkerState.READY and router.counters["gaps"] == 0
    assert _overlap(router, block_keys(p, BS, model="m"), w) == 3


async def test_live_batches_covered_by_a_replay_are_dropped_as_duplicates(env):
    router, source, start = env
    engine = await start()
    sub = source.subscribers["w"]
    await engine.publish(engine.stored([1], tokens(0, 1)))
    await until(lambda: sub.stats.batches_applied == 1)
    await engine.publish(engine.stored([2], tokens(10, 1)), drop=True)
    # seq 2 reveals the gap; 3 and 4 queue on the socket while the replay (1..4) runs
    for i in range(3):
        await engine.publish(engine.stored([3 + i], tokens(20 + 10 * i, 1)))
    await until(lambda: sub.stats.last_sequence == 4 and sub.stats.duplicates + sub.stats.batches_applied >= 5)
    await engine.publish(engine.stored([9], tokens(90, 1)))
    await until(lambda: sub.stats.last_sequence == 5)
    assert sub.stats.batches_applied == 6  # 0..5 once each
    assert sub.stats.duplicates == 2 and sub.stats.restarts == 0
    assert router.index.count(router.workers.get("w").slot) == 6


async def test_gap_without_replay_clears_and_degrades_until_the_engine_clears(env):
    router, source, start = env
    engine = await start(replay=False)
    sub = source.subscribers["w"]
    await engine.publish(engine.stored([1, 2], tokens(0, 2)))
    await until(lambda: sub.stats.batches_applied == 1)
    await engine.publish(engine.removed([2]), drop=True)
    await engine.publish(engine.stored([7], tokens(50, 1)))
    await until(lambda: sub.stats.last_sequence == 2)
    w = router.workers.get("w")
    assert sub.stats.desyncs == 1 and sub.stats.replays_failed == 1
    assert w.state is WorkerState.DEGRADED and router.counters["gaps"] == 1
    # the stale blocks are gone; the batch that revealed the gap was applied
    assert router.index.count(w.slot) == 1
    await engine.publish(engine.cleared(), engine.stored([8], tokens(60, 1)))
    await until(lambda: sub.stats.last_sequence == 3)
    assert w.state is WorkerState.READY and router.index.count(w.slot) == 1


async def test_gap_older_than_the_replay_buffer_degrades_the_worker(env):
    router, source, start = env
    engine = await start(buffer=2)
    sub = source.subscribers["w"]
    await engine.publish(engine.stored([1], tokens(0, 1)))
    await until(lambda: sub.stats.batches_applied == 1)
    for i in range(3):
        await engine.publish(engine.stored([2 + i], tokens(10 * (i + 1), 1)), drop=True)
    await engine.publish(engine.stored([9], tokens(90, 1)))
    await until(lambda: sub.stats.last_sequence == 4)
    assert engine.replay_requests == [1]
    assert sub.stats.desyncs == 1 and router.workers.get("w").state is WorkerState.DEGRADED


async def test_engine_restart_clears_state_and_resyncs(env):
    router, source, start = env
    engine = await start()
    sub = source.subscribers["w"]
    await engine.publish(engine.stored([1, 2, 3], tokens(0, 3)))
    await engine.publish(engine.stored([4], tokens(100, 1)))
    await until(lambda: sub.stats.batches_applied == 2)
    w = router.workers.get("w")
    assert router.index.count(w.slot) == 4
    engine.restart()
    await engine.publish(engine.stored([1], tokens(500, 1)))  # seq 0 again: a fresh engine
    await until(lambda: sub.stats.restarts == 1 and sub.stats.batches_applied == 3)
    assert router.index.count(w.slot) == 1 and w.state is WorkerState.READY
    assert router.counters["restarts"] == 0 and router.counters["gaps"] == 0  # not flagged twice


async def test_restart_whose_first_batches_were_missed_replays_from_zero(env):
    router, source, start = env
    engine = await start()
    sub = source.subscribers["w"]
    for i in range(5):
        await engine.publish(engine.stored([i + 1], tokens(100 * i, 1)))
    await until(lambda: sub.stats.batches_applied == 5)
    engine.restart()
    await engine.publish(engine.stored([50], tokens(5000, 1)), drop=True)
    await engine.publish(engine.stored([51], tokens(6000, 1)))
    await until(lambda: sub.stats.restarts == 1 and sub.stats.last_sequence == 1)
    assert engine.replay_requests == [0]
    w = router.workers.get("w")
    assert router.index.count(w.slot) == 2 and w.state is WorkerState.READY
    assert _overlap(router, block_keys(tokens(5000, 1), BS, model="m"), w) == 1


async def test_malformed_messages_are_counted_and_skipped_never_fatal(env):
    router, source, start = env
    engine = await start()
    sub = source.subscribers["w"]
    await engine.publish(raw=b"\xc1 not msgpack")
    await engine.publish(engine.stored("nope", tokens(0, 1)))  # hashes not a list
    await engine.pub.send_multipart([TOPIC, b"short", b"x"])  # bad sequence frame
    await engine.pub.send_multipart([TOPIC])  # too few frames
    await engine.publish(engine.stored([1], tokens(0, 3)))  # 3 blocks' tokens for 1 hash: router rejects it
    await engine.publish(engine.stored([5], tokens(40, 1)))
    await until(lambda: sub.stats.last_sequence == 3)
    # the bad frames and the undecodable batch are counted; the bad events inside good
    # batches are rejected one by one, and their batches still count as applied
    # the undecodable batch may have held removals: the view is rebuilt by replay from 0,
    # which reads that batch again (so it is counted twice) and cannot fix it: DEGRADED
    assert sub.stats.resyncs == 1
    assert sub.stats.malformed == 4 and sub.stats.rejected == 0 and sub.stats.gaps == 0
    assert sub.stats.rejected_events == 4 and sub.stats.batches_applied == 3
    worker = router.workers.get("w")
    assert worker.events_rejected == {"malformed_batch": 2, "malformed_stored": 1, "hash_count": 1}
    assert worker.state is WorkerState.DEGRADED and worker.state_reason == "removal lost"
    assert router.index.count(worker.slot) == 1


async def test_other_media_are_tracked_apart_from_the_gpu_view(env):
    router, source, start = env
    engine = await start()
    sub = source.subscribers["w"]
    await engine.publish(engine.stored([1], tokens(0, 1)), engine.stored([2, 3], tokens(10, 2), medium="CPU"))
    await engine.publish(engine.removed([1], medium="CPU"), engine.removed([2], medium="CPU"))
    await until(lambda: sub.stats.last_sequence == 1)
    assert router.index.count(router.workers.get("w").slot) == 1  # the CPU removal of hash 1 left GPU alone
    assert sub.stats.tier_blocks == {"CPU": {3}}


async def test_joining_a_running_engine_replays_from_zero(env):
    router, source, start = env
    ctx = zmq.asyncio.Context.instance()
    engine = FakeEngine(ctx)
    try:
        for i in range(3):
            await engine.publish(engine.stored([i + 1], tokens(100 * i, 1)))  # nobody listens yet
        source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model="m"))
        await engine.wait_subscribed()
        await engine.publish(engine.stored([9], tokens(900, 1)))
        sub = source.subscribers["w"]
        await until(lambda: sub.stats.last_sequence == 3)
        assert engine.replay_requests == [0] and sub.stats.batches_applied == 4
        assert router.workers.get("w").state is WorkerState.READY
    finally:
        await engine.close()


async def test_silent_engine_is_shown_and_recovers(env):
    router, source, start = env
    source.config = ZmqEventsConfig(topic="kv@", silence_s=0.2, replay_timeout_s=0.5)
    engine = FakeEngine(zmq.asyncio.Context.instance())
    try:
        sub = source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model="m"))
        await engine.wait_subscribed()
        await until(lambda: sub.stats.silent, timeout=3)
        # the socket is recreated; once the engine talks again the status clears
        await until(lambda: sub.stats.reconnects >= 1, timeout=3)
        await engine.wait_subscribed()
        for i in range(20):  # a publish may race a socket recreated meanwhile; later ones replay it
            await engine.publish(engine.stored([i + 1], tokens(10 * i, 1)))
            with contextlib.suppress(AssertionError):
                await until(lambda: not sub.stats.silent and sub.stats.batches_applied >= 1, timeout=0.5)
                break
        assert not sub.stats.silent and sub.stats.batches_applied >= 1
    finally:
        await engine.close()
