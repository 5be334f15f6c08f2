"""The Route hot-path instruments: plain-int decisions and queued latencies, seen through a reader."""

from __future__ import annotations

import threading

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvrouterd.telemetry.metrics import ROUTE_LATENCY_BUCKETS, Metrics, RouteLatency


def _metrics(reader: InMemoryMetricReader | None = None) -> Metrics:
    provider = MeterProvider(metric_readers=[reader] if reader is not None else [])
    return Metrics(provider, lambda: 0, lambda: ())


def _points(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, str], ...], object]:
    data = reader.get_metrics_data()
    out = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    for p in m.data.data_points:
                        out[tuple(sorted(p.attributes.items()))] = p
    return out


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


def test_decisions_are_cumulative_per_policy_and_reason(reader):
    m = _metrics(reader)
    m.route_decided("cache_aware", "prefix_match", 0.001)
    m.route_decided("cache_aware", "prefix_match", 0.001)
    m.decisions.add(1, {"policy": "round_robin", "reason": "rotation"})  # the SDK Counter's signature
    points = _points(reader, "kvrouter.decisions")
    assert points[(("policy", "cache_aware"), ("reason", "prefix_match"))].value == 2
    assert points[(("policy", "round_robin"), ("reason", "rotation"))].value == 1
    m.route_decided("cache_aware", "prefix_match", 0.001)
    points = _points(reader, "kvrouter.decisions")
    assert points[(("policy", "cache_aware"), ("reason", "prefix_match"))].value == 3


def test_a_collection_sees_every_queued_latency_without_a_tick(reader):
    m = _metrics(reader)
    values = [0.00003, 0.0002, 0.0002, 0.004, 2.0]
    for v in values:
        m.route_decided("cache_aware", "prefix_match", v)
    m.route_latency.record(0.0007, {"policy": "round_robin"})  # the SDK Histogram's signature
    points = _points(reader, "kvrouter.route.duration")
    p = points[(("policy", "cache_aware"),)]
    assert p.count == len(values)
    assert p.sum == pytest.approx(sum(values))
    assert (p.min, p.max) == (min(values), max(values))
    assert list(p.explicit_bounds) == list(ROUTE_LATENCY_BUCKETS)
    assert p.bucket_counts[0] == 1 and p.bucket_counts[2] == 2 and p.bucket_counts[-1] == 1
    assert points[(("policy", "round_robin"),)].count == 1


def test_the_tick_flush_records_and_empties_the_queue(reader):
    m = _metrics(reader)
    m.route_decided("p", "r", 0.001)
    assert len(m.route_latency._pending) == 1
    m.flush()
    assert not m.route_latency._pending
    assert _points(reader, "kvrouter.route.duration")[(("policy", "p"),)].count == 1


def test_a_stalled_tick_bounds_the_queue(reader):
    m = _metrics(reader)
    for _ in range(RouteLatency.MAX_PENDING + 10):
        m.route_decided("p", "r", 0.001)
    assert len(m.route_latency._pending) < RouteLatency.MAX_PENDING
    assert _points(reader, "kvrouter.route.duration")[(("policy", "p"),)].count == RouteLatency.MAX_PENDING + 10


def test_without_a_reader_latencies_are_not_even_queued():
    m = _metrics()
    m.route_decided("p", "r", 0.001)
    assert not m.route_latency.enabled and not m.route_latency._pending


def test_an_exporter_thread_collecting_meanwhile_loses_and_repeats_nothing(reader):
    m = _metrics(reader)
    n = 20_000
    stop = threading.Event()

    def export() -> None:
        while not stop.is_set():
            reader.get_metrics_data()

    t = threading.Thread(target=export)
    t.start()
    try:
        for _ in range(n):
            m.route_decided("p", "r", 0.001)
    finally:
        stop.set()
        t.join()
    assert _points(reader, "kvrouter.route.duration")[(("policy", "p"),)].count == n
    assert _points(reader, "kvrouter.decisions")[(("policy", "p"), ("reason", "r"))].value == n


def test_decisions_in_a_model_pool_carry_its_label_and_others_none(reader):
    m = _metrics(reader)
    m.route_decided("cache_aware", "prefix_match", 0.001, "llama")
    m.route_decided("cache_aware", "prefix_match", 0.001)
    m.decisions.add(1, {"policy": "cache_aware", "reason": "prefix_match", "pool": "llama"})
    points = _points(reader, "kvrouter.decisions")
    assert points[(("policy", "cache_aware"), ("pool", "llama"), ("reason", "prefix_match"))].value == 2
    assert points[(("policy", "cache_aware"), ("reason", "prefix_match"))].value == 1
