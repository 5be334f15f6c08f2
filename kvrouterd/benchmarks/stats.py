"""One definition of a latency percentile for every benchmark, so their p99s can be compared."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["p99"]


def p99(values: Sequence[float]) -> float:
    """The 99th percentile, interpolated between the two nearest samples (``statistics.quantiles``'
    inclusive method, numpy's default 'linear'); the sample itself when there is one, 0.0 for none."""
    if len(values) < 2:
        return float(values[0]) if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98]
