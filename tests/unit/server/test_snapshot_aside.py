"""The bus snapshot is encoded by a forked child, so routing goes on while it is written."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvrouterd.benchmarks.snapshot_stall import build, route_during
from kvrouterd.clock import ManualClock
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.snapshot import encode_snapshot, encode_snapshot_aside, restore_snapshot


async def test_the_child_writes_the_same_snapshot_as_encoding_in_place() -> None:
    router = build(20_000)
    data = await encode_snapshot_aside(router, 42)
    assert data == encode_snapshot(router, 42)
    restored = Router(RouterSettings(block_size=16), ManualClock())
    seq, result = await restore_snapshot(restored, data)
    assert seq == 42 and result.blocks == len(router.index)
    for w in router.workers:
        assert sorted(restored.export_blocks(w.id)) == sorted(router.export_blocks(w.id))


async def test_routing_goes_on_while_the_snapshot_is_encoded() -> None:
    router = build(120_000)
    started = time.perf_counter()
    encode_snapshot(router, 0)
    in_place = time.perf_counter() - started  # how long the loop would stop (this machine, now)

    async def aside() -> bytes:
        return await encode_snapshot_aside(router, 0)

    report = await route_during(router, aside, interval_s=0.002)
    # encoding in place, no Route would be answered until the end; aside, Routes keep coming
    # (one due every 2 ms) and none waits anywhere near the in-place encode
    assert report["routes"] >= 0.25 * report["snapshot_s"] / 0.002, (report, in_place)
    assert report["route_latency_ms_max"] < 0.5 * in_place * 1e3, (report, in_place)


async def test_a_failed_encoder_is_an_error_and_a_cancelled_one_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    router = build(2_000)
    monkeypatch.setattr("kvrouterd.server.snapshot.encode_snapshot", lambda *args: 1 / 0)
    with pytest.raises(OSError, match="exit code 1"):
        await encode_snapshot_aside(router, 0)
    monkeypatch.setattr("kvrouterd.server.snapshot.encode_snapshot", lambda *args: time.sleep(30) or b"")
    task = asyncio.create_task(encode_snapshot_aside(router, 0))
    await asyncio.sleep(0.3)
    started = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.perf_counter() - started < 5  # the child was killed, not waited for


async def test_a_snapshot_leaves_a_daemons_start_up_freeze_in_place() -> None:
    """The fork's gc freeze is counted with the daemons' (loop_lag.freeze_heap): its thaw once
    thawed a daemon's start-up heap after the first bus snapshot, so full collections walked it
    again; alone, the snapshot still thaws what it froze."""
    import gc

    from kvrouterd.telemetry.loop_lag import freeze_heap, unfreeze_heap

    router = build(2_000)
    assert gc.get_freeze_count() == 0
    await encode_snapshot_aside(router, 0)
    assert gc.get_freeze_count() == 0  # nobody else froze: thawed again
    start_up = [object()]  # a tracked object of the daemon's start-up heap
    freeze_heap()  # as a daemon does at start-up
    try:
        assert all(o is not start_up for o in gc.get_objects())  # collections no longer see it
        await encode_snapshot_aside(router, 0)
        assert gc.get_freeze_count() > 0
        assert all(o is not start_up for o in gc.get_objects())  # nor after the snapshot
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0  # the last holder thaws
    assert any(o is start_up for o in gc.get_objects())
