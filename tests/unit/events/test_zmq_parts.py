"""A huge engine batch over real ZMQ sockets is applied in parts with the loop free between them,
and the parts keep the subscriber's sequencing (gap replay, restarts, removal, reset) correct.

The engine is tests/integration's FakeEngine (XPUB + a ROUTER replay socket on 127.0.0.1)
publishing vLLM 0.26's wire layout (engine_wire)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from kvrouterd.clock import ManualClock
from kvrouterd.events import EndpointSubscriber, ZmqEndpoint, ZmqEventsConfig, ZmqEventSource
from kvrouterd.events.engine_format import decode_payload
from kvrouterd.events.parts import batch_blocks
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import BatchOutcome, CacheMode, EventBatch, WorkerState
from kvrouterd.router import Router, RouterSettings
from tests.integration.engine_wire import EngineWire
from tests.integration.test_zmq_events import FakeEngine, until

BS = 4
PART = 4096
WIRE = EngineWire("vllm-0.26", BS, new_replay_layout=True)
MODEL = "m"


def chain(rng: random.Random, blocks: int, first_hash: int, parent: int | None = None) -> bytes:
    """One vLLM batch: a BlockStored of ``blocks`` blocks, as one step without chunked prefill."""
    tokens = [rng.randrange(150_000) for _ in range(blocks * BS)]
    return WIRE.batch(WIRE.stored(list(range(first_hash, first_hash + blocks)), tokens, parent))


def reference(*payloads: bytes) -> Router:
    """A router that applied each payload whole, in one call."""
    router = Router(RouterSettings(block_size=BS), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    for seq, payload in enumerate(payloads):
        router.apply(EventBatch("w", seq, decode_payload(payload, MODEL).events), per_event=True)
    return router


def view(router: Router) -> tuple[list[Any], list[Any]]:
    w = router.workers.get("w")
    return sorted(router.export_blocks("w")), sorted(w.engine_keys.items())


class Host:
    """The daemon's wiring (Router.apply per event) with every apply call recorded, and a probe
    task that counts its turns on the loop: how many ran between two calls shows the loop was
    free between them."""

    def __init__(self) -> None:
        self.router = Router(RouterSettings(block_size=BS), ManualClock())
        self.router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
        self.calls: list[tuple[int, int, int]] = []  # (router sequence, blocks, probe turns before it)
        self.turns = 0
        self.between: Any = None  # called after each apply, to act between two parts

    def apply(self, batch: EventBatch) -> BatchOutcome:
        outcome = self.router.apply(batch, per_event=True)
        self.calls.append((batch.sequence, batch_blocks(batch.events, BS), self.turns))
        if self.between is not None:
            self.between(len(self.calls))
        return outcome

    async def probe(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.turns += 1


@pytest.fixture
async def wired() -> AsyncIterator[tuple[Host, ZmqEventSource, Any]]:
    ctx = zmq.asyncio.Context()
    host = Host()
    source = ZmqEventSource(
        ZmqEventsConfig(silence_s=5.0, replay_timeout_s=1.0), host.apply,
        lambda wid, lost: host.router.reset_events(wid, lost=lost), ctx=ctx, max_part_blocks=PART, block_size=BS,
    )
    engines: list[FakeEngine] = []

    async def start() -> FakeEngine:
        engine = FakeEngine(ctx)
        engines.append(engine)
        source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model=MODEL))
        await engine.wait_subscribed()
        return engine

    prober = asyncio.create_task(host.probe())
    yield host, source, start
    prober.cancel()
    await source.close()
    for e in engines:
        await e.close()
    ctx.term()


async def test_a_100k_block_store_is_applied_in_parts_with_the_loop_free_between_them(wired):
    host, source, start = wired
    engine = await start()
    payload = chain(random.Random(1), 100_000, 1)
    await engine.publish(raw=payload)
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.batches_applied == 1 and not sub.stats.parts_abandoned and len(host.calls) == 25,
                timeout=60)
    await asyncio.sleep(0.01)
    # the first part carries the Cleared a new session starts with (1 block) and 4,095 stored blocks
    assert len(host.calls) == math.ceil((100_000 + 1) / PART) == 25
    assert [seq for seq, _, _ in host.calls] == list(range(25))  # consecutive router sequence numbers
    assert all(blocks <= PART for _, blocks, _ in host.calls)
    turns = [t for _, _, t in host.calls]
    assert all(b > a for a, b in zip(turns, turns[1:]))  # the probe ran between every two parts
    assert sub.stats.parts == 25 and sub.stats.batches_applied == 1 and sub.stats.last_sequence == 0
    assert view(host.router) == view(reference(payload))
    assert host.router.index.count(host.router.workers.get("w").slot) == 100_000


async def test_batches_in_parts_replayed_after_a_gap_and_after_a_restart_build_the_same_view(wired):
    host, source, start = wired
    engine = await start()
    rng = random.Random(2)
    first, lost, third = chain(rng, 9_000, 1), chain(rng, 5_000, 20_000, parent=9_000), chain(rng, 30, 40_000, parent=24_999)
    await engine.publish(raw=first)
    await engine.publish(raw=lost, drop=True)  # never reaches the subscriber: replayed, in parts
    await engine.publish(raw=third)
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.last_sequence == 2 and sub.stats.replays_ok == 1, timeout=30)
    assert engine.replay_requests == [1] and sub.stats.gaps == 1 and sub.stats.desyncs == 0
    # 9,001 blocks (with the Cleared) in 3 parts, 5,000 in 2, the rest in one: numbered on
    assert [seq for seq, _, _ in host.calls] == list(range(6)) and sub.stats.parts == 5
    assert view(host.router) == view(reference(first, lost, third))
    assert host.router.workers.get("w").state is WorkerState.READY

    engine.restart()  # an empty cache, numbering from 0: the first part starts with a Cleared
    again = chain(rng, 6_000, 50_000)
    await engine.publish(raw=again)
    await until(lambda: sub.stats.restarts == 1 and len(host.calls) == 8, timeout=30)
    assert [seq for seq, _, _ in host.calls] == list(range(8))
    assert view(host.router) == view(reference(again))


def subscriber(host: Host) -> tuple[EndpointSubscriber, zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    sub = EndpointSubscriber(
        ZmqEndpoint("w", "tcp://127.0.0.1:1"), ZmqEventsConfig(replay_on_join=False), host.apply,
        lambda wid, lost: host.router.reset_events(wid, lost=lost), ctx, ManualClock(), max_part_blocks=PART, block_size=BS,
    )
    return sub, ctx


def frame(seq: int, payload: bytes) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload]


@pytest.mark.parametrize("between", ["deregistered", "reset"])
async def test_a_worker_removed_or_reset_between_parts_gets_none_of_the_rest(between, caplog):
    host = Host()
    sub, ctx = subscriber(host)

    def act(calls: int) -> None:
        if calls == 2:
            if between == "deregistered":
                host.router.remove_worker("w")
            else:
                host.router.reset_events("w", lost=False)

    host.between = act
    caplog.set_level(logging.INFO, logger="kvrouterd.events.zmq")
    try:
        await sub.handle_frames(frame(0, chain(random.Random(3), 20_000, 1)))  # 5 parts
    finally:
        ctx.term()
    dropped = [r for r in caplog.records if "the rest of a KV-event batch" in r.getMessage()]
    assert len(dropped) == 1 and sub.stats.parts_abandoned == 1
    if between == "deregistered":
        assert len(host.calls) == 2 and sub.stats.parts == 2  # the third part was refused: worker unknown
    else:
        # the third part found the router's sequence gone (a gap of unknown history): the last one
        assert len(host.calls) == 3 and host.router.workers.get("w").state is WorkerState.DEGRADED


async def test_a_subscriber_stopped_between_parts_ends_cleanly_and_counts_it(wired, caplog):
    host, source, start = wired
    engine = await start()
    sub = source.subscribers["w"]
    host.between = lambda calls: source.remove("w") if calls == 2 else None
    caplog.set_level(logging.INFO, logger="kvrouterd.events.zmq")
    await engine.publish(raw=chain(random.Random(4), 20_000, 1))
    await until(lambda: sub.stats.parts_abandoned == 1, timeout=30)
    await asyncio.sleep(0.05)
    assert len(host.calls) == 2 and sub.stats.parts == 2
    assert sum("subscriber stopped between the parts" in r.getMessage() for r in caplog.records) == 1
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)  # cancelled, not failed


async def test_the_daemon_cuts_engine_batches_at_its_limits_max_batch_blocks():
    from kvrouterd.config import parse_config
    from kvrouterd.server.app import Daemon

    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "block_size": 32, "limits": {"max_batch_blocks": 512}}))
    await daemon.start()
    try:
        assert daemon.events is not None
        assert (daemon.events.max_part_blocks, daemon.events.block_size) == (512, 32)
    finally:
        await daemon.stop(grace=0)
