"""The Route hot-path instruments: plain-int decisions and queued latencies, seen through a reader."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvrouterd.index.workers import InFlight
from kvrouterd.protocols import Completion
from kvrouterd.telemetry.metrics import FLUSH_AT, ROUTE_LATENCY_BUCKETS, Metrics


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
    for _ in range(FLUSH_AT + 10):
        m.route_decided("p", "r", 0.001)
    assert len(m.route_latency._pending) < FLUSH_AT
    assert _points(reader, "kvrouter.route.duration")[(("policy", "p"),)].count == FLUSH_AT + 10


def test_without_a_reader_latencies_are_not_even_queued():
    m = _metrics()
    m.route_decided("p", "r", 0.001)
    assert not m.route_latency.enabled and not m.route_latency._pending


@contextmanager
def _an_exporter_collecting(reader: InMemoryMetricReader) -> Iterator[None]:
    """An exporter thread collecting from ``reader`` over and over while the block runs."""
    stop = threading.Event()

    def export() -> None:
        while not stop.is_set():
            reader.get_metrics_data()

    t = threading.Thread(target=export)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def test_an_exporter_thread_collecting_meanwhile_loses_and_repeats_nothing(reader):
    m = _metrics(reader)
    n = 20_000
    with _an_exporter_collecting(reader):
        for _ in range(n):
            m.route_decided("p", "r", 0.001)
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


def _completed(m: Metrics, worker: str, prompt: int, cached: int, overlap_blocks: int, model: str = "",
               ttft_ms: float = 0.0) -> None:
    entry = InFlight(f"r-{worker}", worker, prompt, prompt, overlap_blocks, 0.0, "cache_aware")
    m.completed(entry, Completion(entry.request_id, ttft_ms=ttft_ms, cached_tokens=cached), model, 16)


def _token_totals(reader: InMemoryMetricReader) -> dict[tuple[str, tuple[tuple[str, str], ...]], int]:
    return {(name, labels): p.value
            for name in ("kvrouter.completed.prompt_tokens", "kvrouter.completed.cached_tokens")
            for labels, p in _points(reader, name).items()}


def test_completed_tokens_are_exact_per_worker_model_and_source_across_flushes(reader):
    """Queued and summed per series, with a flush forced part way (a stalled tick) and a
    collection at the end: each series holds every Complete's tokens, none twice."""
    m = _metrics(reader)
    n = FLUSH_AT + 500
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
    for i in range(n):
        worker, model = f"w{i % 3}", ("m" if i % 2 else "")
        prompt, cached, overlap = 64 + i % 7, i % 50, i % 4
        _completed(m, worker, prompt, cached, overlap, model)
        labels = (("model", model),) if model else ()
        base = tuple(sorted((("worker", worker), *labels)))
        engine, router = tuple(sorted((*base, ("source", "engine")))), tuple(sorted((*base, ("source", "router"))))
        for name, key, value in (("kvrouter.completed.prompt_tokens", base, prompt),
                                 ("kvrouter.completed.cached_tokens", engine, cached),
                                 ("kvrouter.completed.cached_tokens", router, min(overlap * 16, prompt))):
            expected[(name, key)] = expected.get((name, key), 0) + value
    assert len(m.completions._pending) < FLUSH_AT
    assert _token_totals(reader) == expected
    assert _token_totals(reader) == expected  # a second collection adds nothing


def test_a_worker_forgotten_before_the_flush_leaves_no_series_behind(reader):
    """A Complete's tokens still queued when its worker leaves must not bring back the
    series ``forget_worker`` dropped; the other worker's counts stay whole."""
    m = _metrics(reader)
    _completed(m, "gone", 100, 40, 2, ttft_ms=50.0)
    _completed(m, "kept", 100, 10, 1, ttft_ms=50.0)
    assert m.completions._pending  # nothing flushed yet
    m.forget_worker("gone")
    totals = _token_totals(reader)
    assert not [key for key in totals if ("worker", "gone") in key[1]]
    assert totals[("kvrouter.completed.prompt_tokens", (("worker", "kept"),))] == 100
    assert not [labels for labels in _points(reader, "kvrouter.request.ttft") if ("worker", "gone") in labels]
    # the same id registered again starts afresh
    _completed(m, "gone", 30, 5, 0, ttft_ms=20.0)
    assert _token_totals(reader)[("kvrouter.completed.prompt_tokens", (("worker", "gone"),))] == 30
    assert _points(reader, "kvrouter.request.ttft")[(("policy", "cache_aware"), ("worker", "gone"))].count == 1


def test_completion_latencies_are_exact_per_series_across_flushes_and_an_exporter_thread(reader):
    """Queued with the tokens, every reported TTFT, end-to-end and prefill-hop time lands once in
    its series' histogram, through a forced flush (a stalled tick) and an exporter collecting
    meanwhile; a Complete that reported nothing queues nothing."""
    m = _metrics(reader)
    n = FLUSH_AT + 500
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    with _an_exporter_collecting(reader):
        for i in range(n):
            worker, model = f"w{i % 3}", ("m" if i % 2 else "")
            entry = InFlight(f"r{i}", worker, 64, 64, 1, 0.0, "cache_aware")
            done = Completion(entry.request_id, ttft_ms=10.0 + i % 7, e2e_ms=100.0 * (i % 5),
                              prefill_ms=5.0 if i % 4 == 0 else 0.0)
            m.completed(entry, done, model, 16)
            named = (("model", model),) if model else ()
            labels = tuple(sorted((("worker", worker), ("policy", "cache_aware"), *named)))
            expected.setdefault(("kvrouter.request.ttft", labels), []).append(done.ttft_ms / 1000.0)
            if done.e2e_ms > 0:
                expected.setdefault(("kvrouter.request.e2e", labels), []).append(done.e2e_ms / 1000.0)
            if done.prefill_ms > 0:
                hop = tuple(sorted((*labels, ("phase", "prefill"))))
                expected.setdefault(("kvrouter.request.prefill_hop", hop), []).append(done.prefill_ms / 1000.0)
    assert len(m.completions._pending) < FLUSH_AT
    for _ in range(2):  # a second collection adds nothing
        got = {(name, labels): (p.count, round(p.sum, 6))
               for name in ("kvrouter.request.ttft", "kvrouter.request.e2e", "kvrouter.request.prefill_hop")
               for labels, p in _points(reader, name).items()}
        assert got == {key: (len(v), round(sum(v), 6)) for key, v in expected.items()}
    m.completed(InFlight("quiet", "w0", 64, 64, 1, 0.0, "cache_aware"), Completion("quiet"), "", 16)
    assert not m.completions._pending


def test_route_stream_batch_counters_are_exported_from_zero(reader):
    m = _metrics(reader)
    assert _points(reader, "kvrouter.route_stream.batches")[()].value == 0
    m.stream_batches.add(1)
    m.stream_batch_items.add(8)
    assert _points(reader, "kvrouter.route_stream.batches")[()].value == 1
    assert _points(reader, "kvrouter.route_stream.batch_items")[()].value == 8


def test_completed_tokens_flushed_by_an_exporter_thread_meanwhile_are_counted_once(reader):
    m = _metrics(reader)
    n = 20_000
    with _an_exporter_collecting(reader):
        for i in range(n):
            _completed(m, f"w{i % 2}", 10, 3, 0)
    totals = _token_totals(reader)
    assert totals[("kvrouter.completed.prompt_tokens", (("worker", "w0"),))] == 10 * n // 2
    assert totals[("kvrouter.completed.cached_tokens", (("source", "engine"), ("worker", "w1")))] == 3 * n // 2
