"""The loop monitor's watchdog samples what held the loop, never the heartbeat's own work."""

from __future__ import annotations

import asyncio
import time

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
