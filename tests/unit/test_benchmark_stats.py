"""Every benchmark's p99 is the same interpolated percentile, so their figures can be set side by side."""

from __future__ import annotations

import pytest

from kvrouterd.benchmarks.stats import latency_summary, p99


def test_p99_interpolates_between_the_nearest_samples():
    assert p99(list(range(101))) == pytest.approx(99.0)
    # 0..9: rank 0.99 * 9 = 8.91 lies between the samples 8 and 9
    assert p99([9, 3, 0, 7, 1, 8, 2, 6, 4, 5]) == pytest.approx(8.91)


def test_p99_of_one_sample_is_that_sample_and_of_none_is_zero():
    assert p99([0.25]) == 0.25
    assert p99([]) == 0.0


def test_latency_summary_is_in_milliseconds_and_zero_for_no_probes():
    assert latency_summary([0.003, 0.001, 0.002]) == {"probes": 3, "p50_ms": 2.0, "p99_ms": 2.98, "max_ms": 3.0}
    assert latency_summary([], "n") == {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
