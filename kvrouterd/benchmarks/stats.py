"""What the stall benchmarks share: one definition of a latency percentile, one summary of a
run of probes, and one way to probe quiet and then under a hostile load, so their figures can
be set side by side."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

__all__ = ["latency_summary", "p99", "quiet_then_loaded"]


def p99(values: Sequence[float]) -> float:
    """The 99th percentile, interpolated between the two nearest samples (``statistics.quantiles``'
    inclusive method, numpy's default 'linear'); the sample itself when there is one, 0.0 for none."""
    if len(values) < 2:
        return float(values[0]) if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def latency_summary(latencies: Sequence[float], count_key: str = "probes") -> dict[str, Any]:
    """How many (under ``count_key``), and p50 / p99 / max in ms; zeros for none."""
    if not latencies:
        return {count_key: 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(latencies)
    return {
        count_key: len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p99_ms": round(p99(ordered) * 1e3, 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
    }


async def quiet_then_loaded(
    probes: Callable[[int], Awaitable[list[float]]], hog: Callable[[asyncio.Event], Awaitable[None]],
    hogs: int, n: int,
) -> tuple[list[float], list[float]]:
    """``n`` probes alone, then ``n`` more while ``hogs`` copies of ``hog`` run until told to stop
    (after 20 warm-up probes, and 0.2 s for the hogs to get going)."""
    await probes(20)  # warm up connections and caches
    quiet = await probes(n)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(hog(stop)) for _ in range(hogs)]
    await asyncio.sleep(0.2)
    loaded = await probes(n)
    stop.set()
    await asyncio.gather(*tasks)
    return quiet, loaded
