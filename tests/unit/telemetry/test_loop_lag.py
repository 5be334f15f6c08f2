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
