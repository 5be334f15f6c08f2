"""The event-loop lag monitor over a real daemon: a handler that holds the loop is named in a
WARNING and counted in ``kvrouter_event_loop_lag_seconds``; collections land in
``kvrouter_gc_pause_seconds`` (issue #16 item 1)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError
from kvrouterd.server.app import Daemon
from kvrouterd.telemetry.loop_lag import HEARTBEAT_S

from .test_metrics_endpoint import _get, sample

BLOCK_S = 0.3


async def hog_the_loop_in_list_workers(request: pb.ListWorkersRequest, context: object) -> pb.ListWorkersResponse:
    """A handler that holds the loop 300 ms without yielding, off the CPU (a blocking call)."""
    time.sleep(BLOCK_S)
    return pb.ListWorkersResponse()


async def spin_the_cpu_in_get_stats(request: pb.GetStatsRequest, context: object) -> pb.GetStatsResponse:
    """A full collection, then 300 ms of CPU without yielding (what a slow path would do)."""
    gc.collect()
    until = time.thread_time() + BLOCK_S
    while time.thread_time() < until:
        pass
    return pb.GetStatsResponse()


async def scrape(daemon: Daemon) -> str:
    assert daemon.metrics_endpoint is not None
    return (await asyncio.to_thread(_get, daemon.metrics_endpoint.port))[2]


def lag_above(text: str, seconds: float) -> float:
    """Heartbeats that ran more than ``seconds`` late (count minus the bucket at ``seconds``)."""
    return sample(text, "kvrouter_event_loop_lag_seconds_count") - sample(
        text, "kvrouter_event_loop_lag_seconds_bucket", le=str(seconds))


class Captured(logging.Handler):
    """The records of one logger (the daemon's loggers may not propagate to the root's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_handler_blocking_the_loop_is_logged_by_name_and_measured() -> None:
    cfg = parse_config({"listen": "127.0.0.1:0", "metrics": {"listen": "127.0.0.1:0"},
                        "telemetry": {"loop_stall_warn_ms": 100}})
    daemon = Daemon(cfg, seed=1)
    # the servicer's own handlers are bound when the server starts: these replace two of them
    daemon.service.ListWorkers = hog_the_loop_in_list_workers  # type: ignore[method-assign]
    daemon.service.GetStats = spin_the_cpu_in_get_stats  # type: ignore[method-assign]
    logger = logging.getLogger("kvrouterd.telemetry")
    captured, level = Captured(), logger.level
    logger.addHandler(captured)
    logger.setLevel(logging.WARNING)
    port = await daemon.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.KVRouterStub(channel)
            await asyncio.sleep(0.25)  # a heartbeat or two, so the histogram has a series
            before = await scrape(daemon)
            await stub.ListWorkers(pb.ListWorkersRequest(), timeout=10)
            await asyncio.sleep(1.1)  # warnings are at most one a second
            await stub.GetStats(pb.GetStatsRequest(), timeout=10)
            after = await scrape(daemon)  # the heartbeat has run again by the time the scrape is answered
    finally:
        await daemon.stop(grace=0.5)
        logger.removeHandler(captured)
        logger.setLevel(level)
    messages = [r.getMessage() for r in captured.records]
    slept = [r for r in captured.records if "running hog_the_loop_in_list_workers (" in r.getMessage()]
    spun = [r for r in captured.records if "running spin_the_cpu_in_get_stats (" in r.getMessage()]
    assert len(slept) == 1 and len(spun) == 1, messages
    for record in (*slept, *spun):
        message = record.getMessage()
        assert message.startswith("event loop blocked for "), message
        assert "test_loop_monitor.py:" in message  # where: the handler's file and line
        # for about as long as the handler held it (the heartbeat was due up to 100 ms into the block)
        assert BLOCK_S - HEARTBEAT_S - 0.01 <= record.blocked_ms / 1000 < BLOCK_S + 1.0, message  # type: ignore[attr-defined]
    # the sleeping handler held the loop off the CPU; the spinning one on it
    assert slept[0].cpu_ms < 100 and spun[0].cpu_ms >= 250, messages  # type: ignore[attr-defined]
    assert "the loop thread was on a CPU" in spun[0].getMessage()
    assert lag_above(after, 0.1) - lag_above(before, 0.1) >= 2
    # GetStats' full collection, and the collections any allocation triggers
    assert sample(after, "kvrouter_gc_pause_seconds_count", generation="2") >= 1
    assert sample(after, "kvrouter_gc_pause_seconds_count", generation="0") >= 1
    # stopped: no callback left behind in the process, no watchdog thread
    assert daemon.loop_monitor._on_gc not in gc.callbacks
    assert daemon.loop_monitor._watchdog is None


@pytest.mark.parametrize("value", [-1, 5, 60_001])
def test_the_warning_threshold_is_validated(value: float) -> None:
    with pytest.raises(ConfigError, match=r"telemetry\.loop_stall_warn_ms: must be 0 \(off\) or in \[10, 60000\]"):
        parse_config({"telemetry": {"loop_stall_warn_ms": value}})


async def test_the_start_up_heap_is_left_out_of_full_collections() -> None:
    """Full collections scanned the daemon's whole start-up heap on the routing loop; frozen,
    they scan only what was made since (gc.freeze), and a stopped daemon unfreezes it."""
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0"}), seed=1)
    await daemon.start()
    try:
        frozen = gc.get_freeze_count()
        assert frozen >= 10_000
        assert len(gc.get_objects()) < frozen  # what a full collection walks
    finally:
        await daemon.stop(grace=0.5)
    assert gc.get_freeze_count() == 0


async def test_a_stopping_daemon_leaves_another_daemons_heap_frozen() -> None:
    """Freezing is process-wide: the first of two daemons to stop must not thaw the other's
    start-up heap (its full collections would walk it all again); the last one thaws it."""
    frozen_before = gc.get_freeze_count()
    first = Daemon(parse_config({"listen": "127.0.0.1:0"}), seed=1)
    second = Daemon(parse_config({"listen": "127.0.0.1:0"}), seed=2)
    await first.start()
    try:
        await second.start()
        try:
            await first.stop(grace=0.5)
            assert gc.get_freeze_count() >= 10_000  # the second daemon's heap stays out of collections
            assert len(gc.get_objects()) < gc.get_freeze_count()
        finally:
            await second.stop(grace=0.5)
    finally:
        await first.stop(grace=0.5)  # a second stop is a no-op
    assert gc.get_freeze_count() == frozen_before == 0
