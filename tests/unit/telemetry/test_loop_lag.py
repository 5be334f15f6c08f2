"""The loop monitor's watchdog samples what held the loop, never the heartbeat's own work."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from kvrouterd.telemetry.loop_lag import LoopMonitor


class SlowRecord:
    """A histogram whose first record takes 200 ms: bookkeeping right after a late wake-up."""

    def __init__(self) -> None:
        self.slow = True

    def record(self, value: float, attributes: object = None) -> None:
        if self.slow:
            self.slow = False
            time.sleep(0.2)


def hold_the_loop() -> None:
    time.sleep(0.3)


async def test_samples_name_what_held_the_loop_not_the_heartbeat_that_woke_late() -> None:
    monitor = LoopMonitor(MeterProvider(), warn_after_s=0.01)
    taken: list[str] = []
    stalled = monitor._stalled

    def keep_samples(*args: object) -> None:
        taken.extend(monitor._samples)
        stalled(*args)  # type: ignore[arg-type]

    monitor._stalled = keep_samples  # type: ignore[method-assign]
    monitor.start()
    try:
        await asyncio.sleep(0.15)  # the heartbeat is sleeping
        monitor.lag = SlowRecord()  # type: ignore[assignment]
        hold_the_loop()
        await asyncio.sleep(0.4)  # it wakes late, records (200 ms) and warns
    finally:
        await monitor.stop()
    assert any(s.startswith("hold_the_loop (") for s in taken), taken
    # (on a busy machine other samples may name the selector: the process waited for a CPU)
    assert not [s for s in taken if "SlowRecord.record" in s or s.startswith("LoopMonitor._heartbeat")], taken


def hold_just_past_the_threshold(seconds: float) -> None:
    time.sleep(seconds)


async def test_a_stall_just_past_the_threshold_is_sampled_and_named() -> None:
    """The watchdog used to sample only once the loop was held ``warn_after_s``, every
    ``warn_after_s / 2``: a stall ending less than that past the threshold was reported as not
    sampled. It now samples from ``warn_after_s - period`` on, so every stall it warns about
    spans a whole period of sampling."""
    from kvrouterd.telemetry import loop_lag

    monitor = LoopMonitor(MeterProvider(), warn_after_s=0.1)
    named: list[str] = []
    stalled = monitor._stalled

    def keep_names(lag: float, cpu_s: float, gc_s: float, collections: object, due: float) -> None:
        with monitor._lock:
            named.extend(monitor._samples if monitor._sampled_due == due else ["(none)"])
        stalled(lag, cpu_s, gc_s, collections, due)  # type: ignore[arg-type]

    monitor._stalled = keep_names  # type: ignore[method-assign]
    monitor.start()
    try:
        for _ in range(3):  # three stalls of 125-140 ms, each starting just before the heartbeat is due
            await asyncio.sleep(0.05)
            while monitor._due - time.perf_counter() > 0.002:
                await asyncio.sleep(0.001)
            hold_just_past_the_threshold(0.14)
            await asyncio.sleep(0)
        await asyncio.sleep(0.15)
    finally:
        await monitor.stop()
    assert monitor.stalls == 3
    assert named and all(s.startswith("hold_just_past_the_threshold (") for s in named), named
    assert loop_lag.HEARTBEAT_S >= monitor._period == 0.05 and monitor._sample_after_s == 0.05


def _starved_monitor(waits: list[float | None]):
    """A monitor whose run-queue wait readings are ``waits``, one per stall, and its metric reader."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    monitor = LoopMonitor(MeterProvider(metric_readers=[reader]), warn_after_s=0.05)
    readings = iter(waits)
    monitor._cpu_wait_s = lambda: next(readings)  # type: ignore[method-assign]
    return monitor, reader


def _sums(reader) -> dict[str, float]:
    data = reader.get_metrics_data()
    if data is None:  # nothing recorded
        return {}
    return {m.name: sum(p.value for p in m.data.data_points)
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
            if m.name.startswith("kvrouter.event_loop.") and hasattr(m.data, "is_monotonic")}


def test_a_stall_spent_waiting_for_a_cpu_is_counted_and_said_once_at_info(caplog) -> None:
    from collections import Counter

    monitor, reader = _starved_monitor([0.2, 0.25, 0.3])
    with caplog.at_level("INFO", logger="kvrouterd.telemetry"):
        for _ in range(3):  # 200-300 ms of a 300 ms stall runnable with no CPU: the node, not the code
            monitor._stalled(0.3, 0.01, 0.0, Counter(), 0.0)
    assert monitor.starved == 3 == monitor.stalls
    assert [r.levelname for r in caplog.records] == ["INFO"]  # rate-limited: one line per minute
    assert "waiting for a CPU" in caplog.records[0].getMessage()
    assert _sums(reader) == pytest.approx({"kvrouter.event_loop.starved_stalls": 3, "kvrouter.event_loop.cpu_wait": 0.75})


@pytest.mark.parametrize("waited", [0.01, None])  # on a CPU, or the kernel does not say
def test_a_stall_not_spent_waiting_for_a_cpu_stays_a_warning(caplog, waited) -> None:
    from collections import Counter

    monitor, reader = _starved_monitor([waited])
    with caplog.at_level("INFO", logger="kvrouterd.telemetry"):
        monitor._stalled(0.3, 0.29, 0.0, Counter(), 0.0)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and monitor.starved == 0
    assert _sums(reader).get("kvrouter.event_loop.starved_stalls", 0) == 0


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel reports no run-queue waits")
async def test_a_blocking_sleep_on_the_loop_is_not_mistaken_for_cpu_starvation(caplog) -> None:
    monitor = LoopMonitor(MeterProvider(), warn_after_s=0.05)
    monitor.start()
    try:
        assert monitor._cpu_wait_s() is not None
        await asyncio.sleep(0.15)
        with caplog.at_level("INFO", logger="kvrouterd.telemetry"):
            hold_the_loop()  # asleep, not runnable: no run-queue wait
            await asyncio.sleep(0.2)
    finally:
        await monitor.stop()
    assert monitor.stalls >= 1 and monitor.starved == 0
    assert any(r.levelname == "WARNING" and "event loop blocked" in r.getMessage() for r in caplog.records)
