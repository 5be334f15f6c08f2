"""EndpointSubscriber's sequencing without sockets: frames go straight into handle_frames.

Replay needs a socket and is covered in tests/integration/test_zmq_events.py; here the
endpoint has no replay address, so every gap is unrecoverable.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq.asyncio

from kvrouterd.clock import ManualClock
from kvrouterd.errors import ConfigError
from kvrouterd.events import EndpointSubscriber, ZmqEndpoint, ZmqEventsConfig, rank_endpoint
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, WorkerState
from kvrouterd.router import Router, RouterSettings

BS = 4


def frame(seq: int, *events, rank: int = 0) -> list[bytes]:
    return [b"topic", seq.to_bytes(8, "big"), msgpack.packb([0.0, list(events), rank])]


def stored(h: int, start: int, parent: int | None = None) -> list:
    return ["BlockStored", [h], parent, list(range(start, start + BS)), BS, None, None]


@pytest.fixture
def setup():
    router = Router(RouterSettings(block_size=BS), ManualClock())
    worker = router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    ctx = zmq.asyncio.Context()
    sub = EndpointSubscriber(
        ZmqEndpoint("w", "tcp://127.0.0.1:1", dp_rank=0), ZmqEventsConfig(replay_on_join=False),
        router.apply, lambda wid, lost: router.reset_events(wid, lost=lost), ctx, ManualClock(),
    )
    yield router, worker, sub
    ctx.term()


async def test_in_order_batches_are_renumbered_for_the_router(setup):
    router, worker, sub = setup
    await sub.handle_frames(frame(7, stored(1, 0)))  # joining mid-stream without replay
    await sub.handle_frames(frame(8, stored(2, 4, parent=1)))
    assert worker.last_sequence == 1 and router.index.count(worker.slot) == 2
    assert router.counters["gaps"] == 0 and worker.state is WorkerState.READY


async def test_unrecoverable_gap_degrades_and_cleared_resyncs(setup):
    router, worker, sub = setup
    await sub.handle_frames(frame(0, stored(1, 0)))
    await sub.handle_frames(frame(5, stored(2, 40)))
    assert sub.stats.gaps == 1 and sub.stats.desyncs == 1 and sub.stats.replays_failed == 1
    assert worker.state is WorkerState.DEGRADED and router.counters["gaps"] == 1
    assert router.index.count(worker.slot) == 1  # only the batch that revealed the gap
    await sub.handle_frames(frame(6, ["AllBlocksCleared"]))
    assert worker.state is WorkerState.READY and router.index.count(worker.slot) == 0


async def test_restart_prepends_a_clear_even_to_an_empty_batch(setup):
    router, worker, sub = setup
    await sub.handle_frames(frame(0, stored(1, 0)))
    await sub.handle_frames(frame(1, stored(2, 40)))
    await sub.handle_frames(frame(0))  # restarted engine, nothing stored yet
    assert sub.stats.restarts == 1 and router.index.count(worker.slot) == 0
    assert router.counters["restarts"] == 0  # the router saw an in-order batch with Cleared


async def test_malformed_payload_consumes_its_sequence_without_a_gap(setup):
    router, worker, sub = setup
    await sub.handle_frames(frame(0, stored(1, 0)))
    await sub.handle_frames([b"t", (1).to_bytes(8, "big"), b"\xc1"])
    await sub.handle_frames(frame(2, stored(2, 40)))
    assert sub.stats.malformed == 1 and sub.stats.gaps == 0 and router.index.count(worker.slot) == 2


async def test_dp_rank_mismatch_is_counted(setup):
    _, _, sub = setup
    await sub.handle_frames(frame(0, stored(1, 0), rank=3))
    assert sub.stats.dp_rank_mismatch == 1 and sub.stats.batches_applied == 1


async def test_router_rejections_do_not_consume_router_sequence_numbers(setup):
    router, worker, sub = setup
    await sub.handle_frames(frame(0, ["BlockStored", [1], None, list(range(3)), BS, None, None]))  # 3 tokens
    await sub.handle_frames(frame(1, stored(2, 40)))
    assert sub.stats.rejected == 1 and worker.last_sequence == 0 and router.counters["gaps"] == 0


def test_router_reset_events_clears_and_forgets_the_sequence():
    router = Router(RouterSettings(block_size=BS), ManualClock())
    w = router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    from kvrouterd.protocols import EventBatch, Stored

    router.apply(EventBatch("w", 0, (Stored(tuple(range(BS)), (9,)),)))
    router.reset_events("w", lost=False)
    assert router.index.count(w.slot) == 0 and w.last_sequence == -1 and w.state is WorkerState.READY
    router.reset_events("w", lost=True)
    assert w.state is WorkerState.DEGRADED and router.counters["gaps"] == 1 and w.gaps == 1


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://10.0.0.5:5557", 0, "tcp://10.0.0.5:5557"),
        ("tcp://10.0.0.5:5557", 3, "tcp://10.0.0.5:5560"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("ipc:///tmp/kv", 2, "ipc:///tmp/kv_dp2"),
    ],
)
def test_rank_endpoint_follows_vllm(endpoint, rank, expected):
    assert rank_endpoint(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (ZmqEventsConfig(silence_s=0), "silence_s"),
        (ZmqEventsConfig(replay_timeout_s=-1), "replay_timeout_s"),
        (ZmqEventsConfig(replay_max_batches=0), "replay_max_batches"),
        (ZmqEventsConfig(other_media="keep"), "other_media"),  # type: ignore[arg-type]
        (ZmqEventsConfig(reconnect_ivl_ms=500, reconnect_ivl_max_ms=100), "reconnect_ivl_ms"),
    ],
)
def test_config_errors_name_the_field(cfg, field):
    with pytest.raises(ConfigError, match=field):
        cfg.validate()


def test_endpoint_validation():
    with pytest.raises(ConfigError, match="endpoint"):
        ZmqEndpoint("w", "10.0.0.5:5557").validate()
    with pytest.raises(ConfigError, match="dp_rank"):
        ZmqEndpoint("w", "tcp://h:1", dp_rank=-1).validate()
    with pytest.raises(ConfigError, match="numeric port"):
        ZmqEndpoint("w", "tcp://h", dp_rank=1).pub_address


def test_endpoint_parse_reads_replay_rank_and_model_from_one_string():
    ep = ZmqEndpoint.parse("w", "tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:5600&dp_rank=2&model=llama%2F8b")
    assert ep == ZmqEndpoint("w", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", 2, "llama/8b")
    assert ep.pub_address == "tcp://10.0.0.5:5559" and ep.replay_address == "tcp://10.0.0.5:5602"
    assert ZmqEndpoint.parse("w", "tcp://h:1", model="m") == ZmqEndpoint("w", "tcp://h:1", model="m")
    with pytest.raises(ConfigError, match="unknown parameter"):
        ZmqEndpoint.parse("w", "tcp://h:1?topic=x")
    with pytest.raises(ConfigError, match="dp_rank"):
        ZmqEndpoint.parse("w", "tcp://h:1?dp_rank=one")


async def test_sync_follows_the_registry():
    from kvrouterd.events import ZmqEventSource

    router = Router(RouterSettings(block_size=BS), ManualClock())
    for wid, mode, ep in [("a", CacheMode.EVENTS, "tcp://127.0.0.1:1"), ("b", CacheMode.APPROXIMATE, "tcp://127.0.0.1:2"),
                          ("c", CacheMode.EVENTS, ""), ("d", CacheMode.EVENTS, "bogus")]:
        router.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", mode=mode, kv_events_endpoint=ep))
    source = ZmqEventSource(ZmqEventsConfig(), router.apply, lambda wid, lost: router.reset_events(wid, lost=lost))
    try:
        source.sync(w.spec for w in router.workers)
        assert set(source.subscribers) == {"a"}
        first = source.subscribers["a"]
        source.sync(w.spec for w in router.workers)
        assert source.subscribers["a"] is first  # unchanged endpoint: left running
        router.add_worker(WorkerSpec(id="a", address="a:1", mode=CacheMode.EVENTS, kv_events_endpoint="tcp://127.0.0.1:3"))
        source.sync(w.spec for w in router.workers)
        assert source.subscribers["a"] is not first and source.subscribers["a"].endpoint.endpoint == "tcp://127.0.0.1:3"
        router.remove_worker("a")
        source.sync(w.spec for w in router.workers)
        assert not source.subscribers
    finally:
        await source.close()
