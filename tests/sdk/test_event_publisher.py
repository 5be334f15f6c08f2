"""EventPublisher: sequencing, batching, buffering through outages, overflow + resync."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrouter_client import EventPublisher, Stored, keys
from kvrouter_client._generated.kvrouter.v1 import router_pb2 as pb

from .conftest import FakeServer, until

BS = 4


def toks(start: int, blocks: int = 1) -> list[int]:
    return list(range(start, start + blocks * BS))


def kinds(events: list[pb.CacheEvent]) -> list[str]:
    return [ev.WhichOneof("event") for ev in events]


def publisher(server: FakeServer, **kw) -> EventPublisher:
    kw.setdefault("block_size", BS)
    kw.setdefault("timeout", 2.0)
    kw.setdefault("ack_interval_s", 0.05)
    kw.setdefault("reconnect_initial_s", 0.02)
    kw.setdefault("reconnect_max_s", 0.1)
    return EventPublisher(server.target, "gpu-0", **kw)


async def test_events_are_batched_numbered_and_acknowledged(fake_server):
    async with publisher(fake_server, max_batch_events=2, linger_s=0.0) as pub:
        pub.stored(toks(0, 2), engine_hashes=[11, 12])
        pub.stored(toks(100), engine_hashes=[13], parent_engine_hash=12, model="m", lora="l")
        pub.removed([11])
        pub.cleared()
        pub.stored(toks(200))  # kvrouterd keys as hashes: no engine_hashes sent
        assert await pub.flush(timeout=5)
        assert pub.unacknowledged_batches == 0
    fake = fake_server.fake
    assert [b.sequence for b in fake.applied] == list(range(len(fake.applied)))
    events = fake.applied_events("gpu-0")
    assert kinds(events) == ["stored", "stored", "removed", "cleared", "stored"]
    first, second = events[0].stored, events[1].stored
    assert first.token_ids_le32 == b"".join(t.to_bytes(4, "little") for t in toks(0, 2)) and not first.token_ids
    assert list(first.engine_hashes) == [11, 12]
    assert not first.HasField("parent_engine_hash") and first.block_size == BS
    assert second.parent_engine_hash == 12 and (second.model, second.lora) == ("m", "l")
    assert list(events[2].removed.engine_hashes) == [11]
    assert len(events[4].stored.engine_hashes) == 0
    assert pub.stats.batches_acked == pub.stats.batches_sealed == len(fake.applied)
    assert max(len(b.events) for b in fake.applied) <= 2


async def test_bad_events_fail_at_the_call_site(fake_server):
    pub = publisher(fake_server)
    with pytest.raises(ValueError, match="multiple of block_size"):
        pub.stored(list(range(BS + 1)))
    with pytest.raises(ValueError, match="engine hashes"):
        pub.stored(toks(0, 2), engine_hashes=[1])
    with pytest.raises(ValueError):
        pub.stored([-1] * BS)
    with pytest.raises(ValueError):
        pub.removed([-5])
    assert pub.stats.events_recorded == 0
    with pytest.raises(ValueError, match="worker_id"):
        EventPublisher(fake_server.target, "")
    await pub.close()


async def test_outage_buffers_and_everything_arrives_in_order_after_reconnect(fake_server):
    await fake_server.stop()
    pub = publisher(fake_server, max_batch_events=1, linger_s=0.0)
    await pub.start()
    try:
        for i in range(20):
            pub.stored(toks(10 * i), engine_hashes=[i])
        await until(lambda: pub.stats.reconnects >= 2)
        assert pub.unacknowledged_batches == 20 and not fake_server.fake.applied
        await fake_server.start()  # the router comes back on the same port
        assert await pub.flush(timeout=10)
    finally:
        await pub.close()
    fake = fake_server.fake
    assert [b.sequence for b in fake.applied] == list(range(20))
    assert [ev.stored.engine_hashes[0] for ev in fake.applied_events("gpu-0")] == list(range(20))
    assert pub.stats.overflows == 0 and pub.stats.events_dropped == 0


async def test_a_stream_broken_mid_way_is_resent_without_loss_or_double_apply(fake_server):
    fake = fake_server.fake
    fake.break_stream_after = 3
    async with publisher(fake_server, max_batch_events=1, linger_s=0.0, ack_interval_s=5.0) as pub:
        for i in range(8):
            pub.stored(toks(10 * i), engine_hashes=[i])
        assert await pub.flush(timeout=10)
    assert [b.sequence for b in fake.applied] == list(range(8))
    assert fake.duplicates == 3  # the first three were applied, then resent after the drop
    assert pub.stats.reconnects >= 1


async def test_overflow_is_reported_then_cleared_and_resynced_from_the_snapshot(fake_server):
    await fake_server.stop()
    overflowed: list[int] = []
    snapshot = [Stored(toks(0, 2), engine_hashes=[1, 2]), Stored(toks(500), engine_hashes=[3], parent_engine_hash=2)]
    pub = publisher(fake_server, max_batch_events=1, linger_s=0.0, max_buffered_batches=3,
                    snapshot=lambda: snapshot, on_overflow=overflowed.append)
    await pub.start()
    try:
        for i in range(3):
            pub.stored(toks(10 * i), engine_hashes=[100 + i])
        pub.stored(toks(40), engine_hashes=[104])  # the fourth batch does not fit
        assert overflowed == [4] and pub.stats.overflows == 1
        pub.removed([1])  # recorded while a resync is pending: the snapshot will describe it
        assert pub.stats.events_dropped == 5
        await fake_server.start()
        assert await pub.flush(timeout=10)
        pub.stored(toks(900), engine_hashes=[9])
        assert await pub.flush(timeout=10)
    finally:
        await pub.close()
    fake = fake_server.fake
    events = fake.applied_events("gpu-0")
    assert kinds(events) == ["cleared", "stored", "stored", "stored"]
    assert [list(ev.stored.engine_hashes) for ev in events[1:]] == [[1, 2], [3], [9]]
    # numbers of the dropped batches were used, so the router sees (and counts) the gap
    assert fake.applied[0].sequence == 3 and pub.stats.resyncs == 1


async def test_overflow_without_a_snapshot_sends_cleared_only(fake_server):
    await fake_server.stop()
    pub = publisher(fake_server, max_batch_events=1, linger_s=0.0, max_buffered_batches=1)
    await pub.start()
    try:
        pub.stored(toks(0), engine_hashes=[1])
        pub.stored(toks(10), engine_hashes=[2])
        await fake_server.start()
        assert await pub.flush(timeout=10)
    finally:
        await pub.close()
    assert kinds(fake_server.fake.applied_events("gpu-0")) == ["cleared"]


async def test_a_rejected_batch_resyncs_instead_of_resending_forever(fake_server):
    fake = fake_server.fake
    fake.reject_sequence = 1
    async with publisher(fake_server, max_batch_events=1, linger_s=0.0,
                         snapshot=lambda: [Stored(toks(0), engine_hashes=[42])]) as pub:
        pub.stored(toks(0), engine_hashes=[41])
        pub.stored(toks(0), engine_hashes=[42])
        await until(lambda: pub.stats.rejected >= 1)
        assert await pub.flush(timeout=10)
    events = fake.applied_events("gpu-0")
    assert kinds(events) == ["stored", "cleared", "stored"] and list(events[2].stored.engine_hashes) == [42]
    assert pub.stats.resyncs == 1


async def test_one_internal_is_a_broken_connection_not_a_rejection(fake_server):
    """Issue #28 item 14: gRPC's client side ends a stream INTERNAL when a write was in flight
    as the connection died (a killed router). That is no refusal: the batches stay buffered
    and are resent, nothing is dropped or counted as rejected."""
    fake = fake_server.fake
    fake.fail_streams = [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN]
    async with publisher(fake_server, max_batch_events=1, linger_s=0.0, snapshot=lambda: []) as pub:
        for i in range(4):
            pub.stored(toks(10 * i), engine_hashes=[i])
        assert await pub.flush(timeout=10)
    assert [b.sequence for b in fake.applied] == [0, 1, 2, 3]
    assert pub.stats.rejected == 0 and pub.stats.events_dropped == 0 and pub.stats.resyncs == 0
    assert pub.stats.reconnects == 2


async def test_an_internal_answered_twice_over_a_working_connection_is_the_routers_refusal(fake_server):
    """The router's own INTERNAL (a bug it hits on this batch) repeats on the next stream:
    resending would fail forever, so it is a rejection, resynced like any other."""
    fake = fake_server.fake
    fake.fail_streams = [grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL]
    async with publisher(fake_server, max_batch_events=1, linger_s=0.0,
                         snapshot=lambda: [Stored(toks(0), engine_hashes=[7])]) as pub:
        pub.stored(toks(0), engine_hashes=[7])
        await until(lambda: pub.stats.rejected == 1)
        assert await pub.flush(timeout=10)
    assert kinds(fake.applied_events("gpu-0")) == ["cleared", "stored"] and pub.stats.resyncs == 1


async def test_a_router_back_after_a_long_outage_is_used_at_once_not_after_the_grown_backoff(fake_server):
    """Issue #28 item 14: the publisher's backoff grew while the router was away (here it may
    reach 30 s); once the router listens again the channel connects within
    CONNECT_BACKOFF_MAX_S (0.5 s) and the publisher goes on as soon as it has."""
    await fake_server.stop()
    pub = publisher(fake_server, max_batch_events=1, linger_s=0.0, reconnect_initial_s=0.1, reconnect_max_s=30.0)
    await pub.start()
    try:
        pub.stored(toks(0), engine_hashes=[1])
        await asyncio.sleep(3.0)  # a backoff doubling from 0.1 s is at 3.2 s by now
        await fake_server.start()
        loop = asyncio.get_running_loop()
        back = loop.time()
        assert await pub.flush(timeout=10)
        resumed_s = loop.time() - back
    finally:
        await pub.close()
    assert resumed_s < 2.0, resumed_s  # was ~3 s: the grown backoff
    assert [b.sequence for b in fake_server.fake.applied] == [0]


async def test_an_unregistered_worker_keeps_its_events_until_registered(fake_server):
    fake = fake_server.fake
    fake.require_registration = True
    async with publisher(fake_server, max_batch_events=1, linger_s=0.0) as pub:
        for i in range(3):
            pub.stored(toks(10 * i), engine_hashes=[i])
        await until(lambda: pub.stats.reconnects >= 2)
        assert not fake.applied and pub.unacknowledged_batches == 3
        await pub.register("10.0.0.5:8000", capacity_blocks=100)
        assert await pub.flush(timeout=10)
    assert [b.sequence for b in fake.applied] == [0, 1, 2]
    assert pub.stats.rejected == 0 and pub.stats.resyncs == 0


async def test_worker_calls(fake_server):
    fake = fake_server.fake
    async with publisher(fake_server) as pub:
        info = await pub.register("10.0.0.5:8000", capacity_blocks=100, labels={"zone": "a"},
                                  kv_events_endpoint="tcp://10.0.0.5:5557")
        assert info.id == "gpu-0" and info.address == "10.0.0.5:8000" and info.block_size == BS
        assert dict(info.labels) == {"zone": "a"} and info.kv_events_endpoint == "tcp://10.0.0.5:5557"
        await pub.report_load(3, 5, 0.75)
        assert (fake.loads[0].worker_id, fake.loads[0].queued_requests, fake.loads[0].running_requests,
                fake.loads[0].kv_utilization) == ("gpu-0", 3, 5, 0.75)
        advice = await pub.evict_hint(blocks=2, pinned_engine_hashes=[5], pinned_keys=[6], policy="lru")
        assert advice.keys == [7, 8] and advice.engine_hashes == [70, 80] and not advice.exhausted
        req = fake.evicts[0]
        assert (req.blocks, list(req.pinned_engine_hashes), list(req.pinned_keys)) == (2, [5], [6])
        with pytest.raises(ValueError, match="exactly one"):
            await pub.evict_hint(blocks=1, tokens=16)
        await pub.deregister()
        assert "gpu-0" not in fake.registered


def test_sdk_keys_chain_like_the_documentation_says():
    a = keys.block_keys(list(range(32)), 16)
    b = keys.block_keys(list(range(16)), 16)
    assert len(a) == 2 and a[0] == b[0]
    assert keys.block_keys(list(range(16)), 16, model="x") != b
    assert keys.block_keys(list(range(15)), 16) == []


async def test_close_ends_a_task_that_lost_a_cancellation():
    # Python 3.11's wait_for can swallow a cancellation that races its inner await (CPython
    # gh-86296); close() must still end the publisher's loops instead of awaiting them forever
    pub = EventPublisher("127.0.0.1:1", "w")
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # the first cancel is lost, as inside wait_for

    pub._task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    closing = asyncio.create_task(pub.close(timeout=0.1))
    done, _ = await asyncio.wait({closing}, timeout=5)  # waits without cancelling close() itself
    if not done:
        closing.cancel()  # a second cancel, through close(), ends the stubborn task
    assert done and swallowed and pub._task is None
