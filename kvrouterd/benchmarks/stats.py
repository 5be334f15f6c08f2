"""The benchmarks' latency figures: one definition of a percentile and one summary of a run of
probes, so their figures can be set side by side (the probing itself is ``harness``')."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["latency_summary", "p99"]


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
