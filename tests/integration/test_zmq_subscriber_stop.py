"""ZMQ subscribers on real loopback sockets stop for good: no task or socket outlives its worker.

Workers register, change endpoint and deregister hundreds of times (``ZmqEventSource.sync``,
as the daemon calls it after each membership change) while the process's open file
descriptors are counted: a subscriber that survived its cancellation would keep its SUB socket,
its monitor and its TCP connection (a 10^6-call fuzz run met "Too many open files"). Python
3.11's ``wait_for`` can lose a cancellation (CPython gh-86296); a subscriber made to lose its
first one must still end.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import zmq
import zmq.asyncio

from kvrouterd.events import ZmqEventsConfig, ZmqEventSource
from kvrouterd.events.zmq_source import EndpointSubscriber
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode

CYCLES = 200


class Publisher:
    """An engine's XPUB socket: it hears each subscription, so a test knows a SUB connected."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    async def subscribed(self) -> None:
        while (await asyncio.wait_for(self.sock.recv(), 5))[:1] != b"\x01":
            pass  # an unsubscribe from a socket the subscriber closed


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def subscriber_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events-") and not t.done()]


async def settled_fds(limit: int, timeout: float = 10.0) -> int:
    """The open descriptors once at most ``limit`` (libzmq closes a connection on its I/O
    thread a moment after its socket), or the count at ``timeout``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while (n := open_fds()) > limit and loop.time() < end:
        await asyncio.sleep(0.05)
    return n


async def lossy_receive(self: EndpointSubscriber, sock: zmq.asyncio.Socket) -> bool:
    """``_receive`` as it behaves when ``wait_for`` loses a cancellation: the first is ignored."""
    lost = False
    while True:
        try:
            await sock.recv_multipart()
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True


@pytest.fixture
async def zmq_env():
    ctx = zmq.asyncio.Context()
    cfg = ZmqEventsConfig(topic="kv@", silence_s=30.0)
    source = ZmqEventSource(cfg, lambda batch: None, lambda wid, lost: None, ctx=ctx)
    engines = [Publisher(ctx), Publisher(ctx)]
    yield source, engines
    await source.close()
    for e in engines:
        e.sock.close(0)
    ctx.destroy(linger=0)  # term() would block for good on a socket a surviving subscriber holds


def spec(endpoint: str) -> WorkerSpec:
    return WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS, kv_events_endpoint=endpoint)


async def cycle(source: ZmqEventSource, a: Publisher, b: Publisher) -> None:
    """Register, move to another endpoint (a reload), deregister."""
    source.sync([spec(a.endpoint)])
    await a.subscribed()
    source.sync([spec(b.endpoint)])
    await b.subscribed()
    source.sync([])


async def fds_after_cycles(source: ZmqEventSource, a: Publisher, b: Publisher, cycles: int) -> tuple[int, int]:
    for _ in range(5):  # libzmq's and the loop's own descriptors are made by the first few
        await cycle(source, a, b)
    await source._stopping.wait()
    before = await settled_fds(0, timeout=0.5)
    for _ in range(cycles):
        await cycle(source, a, b)
    await asyncio.wait_for(source._stopping.wait(), 30)
    return before, await settled_fds(before)


async def test_register_and_deregister_many_times_leaves_no_socket_open(zmq_env):
    source, (a, b) = zmq_env
    before, after = await fds_after_cycles(source, a, b, CYCLES)
    assert after <= before, f"{after - before} descriptors more after {CYCLES} cycles"
    assert not subscriber_tasks() and not source.subscribers


async def test_subscribers_that_lose_a_cancellation_still_end_and_close_their_sockets(zmq_env, monkeypatch):
    monkeypatch.setattr(EndpointSubscriber, "_receive", lossy_receive)
    source, (a, b) = zmq_env
    before, after = await fds_after_cycles(source, a, b, CYCLES // 4)
    assert after <= before, f"{after - before} descriptors more after {CYCLES // 4} cycles"
    assert not subscriber_tasks() and not source.subscribers


async def test_close_ends_a_subscriber_that_lost_its_cancellation(zmq_env, monkeypatch):
    monkeypatch.setattr(EndpointSubscriber, "_receive", lossy_receive)
    source, (a, _) = zmq_env
    source.sync([spec(a.endpoint)])
    await a.subscribed()
    closing = asyncio.create_task(source.close())
    done, _ = await asyncio.wait({closing}, timeout=5)  # waits without cancelling close() itself
    if not done:
        closing.cancel()
    assert done and not subscriber_tasks()


async def test_sync_subscribes_anew_only_what_changed(zmq_env, caplog):
    # the daemon syncs the whole fleet on every membership change: a worker whose endpoint and
    # model are as last synced keeps its subscriber (its endpoint is not parsed again)
    source, (a, b) = zmq_env
    source.sync([spec(a.endpoint)])
    await a.subscribed()
    first = source.subscribers["w"]
    source.sync([spec(a.endpoint)])
    assert source.subscribers["w"] is first
    source.sync([spec(a.endpoint)], model="m")  # the model keys the worker's blocks: subscribed anew
    await a.subscribed()
    assert source.subscribers["w"] is not first and source.subscribers["w"].endpoint.model == "m"
    with caplog.at_level(logging.ERROR, logger="kvrouterd"):
        for _ in range(2):
            source.sync([spec("not-a-url")])
    assert "w" not in source.subscribers
    assert sum("cannot subscribe" in r.getMessage() for r in caplog.records) == 2  # said on every sync
    source.sync([spec(b.endpoint)])
    await b.subscribed()
    assert source.subscribers["w"].endpoint.endpoint == b.endpoint
