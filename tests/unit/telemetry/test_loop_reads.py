"""Observable callbacks run on the daemon's event loop for collections on other threads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvrouterd.telemetry import loop_reads
from kvrouterd.telemetry.loop_reads import LoopReads


class _LoopThread:
    """An event loop running on its own thread, as the daemon's runs beside the scrape's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(_call(fn), self.loop).result(5)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


async def _call(fn):  # type: ignore[no-untyped-def]
    return fn()


@pytest.fixture
def loop_thread() -> Iterator[_LoopThread]:
    running = _LoopThread()
    try:
        yield running
    finally:
        running.close()


def _provider(reads: LoopReads, seen: list[int]) -> tuple[MeterProvider, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = reads.meter(provider.get_meter("test"))

    def observe(_):  # type: ignore[no-untyped-def]
        seen.append(threading.get_ident())
        yield Observation(7, {"worker": "w0"})

    meter.create_observable_gauge("probe.gauge", [observe])
    meter.create_observable_counter("probe.counter", [observe])
    meter.create_observable_up_down_counter("probe.updown", [observe])
    meter.create_counter("probe.plain").add(3)  # a synchronous instrument passes through untouched
    return provider, reader


def _values(reader: InMemoryMetricReader) -> dict[str, float]:
    data = reader.get_metrics_data()
    return {m.name: m.data.data_points[0].value
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def test_a_collection_on_another_thread_reads_on_the_attached_loop(loop_thread):
    reads, seen = LoopReads(), []
    provider, reader = _provider(reads, seen)
    loop_thread.call(lambda: reads.attach(loop_thread.loop))
    assert _values(reader) == {"probe.gauge": 7, "probe.counter": 7, "probe.updown": 7, "probe.plain": 3}
    assert seen == [loop_thread.thread.ident] * 3
    provider.shutdown()


def test_without_a_loop_and_on_the_loops_own_thread_callbacks_run_where_called(loop_thread):
    reads, seen = LoopReads(), []
    provider, reader = _provider(reads, seen)
    _values(reader)  # nothing attached yet
    assert seen == [threading.get_ident()] * 3
    seen.clear()
    loop_thread.call(lambda: reads.attach(loop_thread.loop))
    loop_thread.call(lambda: _values(reader))  # collected on the loop: no hop onto itself
    assert seen == [loop_thread.thread.ident] * 3
    seen.clear()
    reads.detach()
    _values(reader)
    assert seen == [threading.get_ident()] * 3
    provider.shutdown()


def test_a_callback_that_raises_fails_its_instrument_alone(loop_thread):
    reads = LoopReads()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = reads.meter(provider.get_meter("test"))

    def broken(_):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in one callback")

    meter.create_observable_gauge("probe.broken", [broken])
    meter.create_observable_gauge("probe.fine", [lambda _: [Observation(1)]])
    loop_thread.call(lambda: reads.attach(loop_thread.loop))
    assert _values(reader) == {"probe.fine": 1}
    provider.shutdown()


def test_a_loop_that_does_not_answer_costs_one_timeout_then_nothing(loop_thread, monkeypatch, caplog):
    monkeypatch.setattr(loop_reads, "COLLECT_TIMEOUT_S", 0.2)
    reads, seen = LoopReads(), []
    provider, reader = _provider(reads, seen)
    loop_thread.call(lambda: reads.attach(loop_thread.loop))
    release = threading.Event()
    loop_thread.loop.call_soon_threadsafe(release.wait, 5)  # the loop is held, as by a long event batch
    started = time.monotonic()
    values = _values(reader)
    took = time.monotonic() - started
    assert values == {"probe.plain": 3}  # what the SDK holds itself is still collected
    assert 0.2 <= took < 0.6, took  # one timeout, not one per instrument
    assert "did not run a metrics callback" in caplog.text
    started = time.monotonic()
    assert _values(reader) == {"probe.plain": 3}
    assert time.monotonic() - started < 0.1  # still unanswered: not waited for again
    release.set()
    time.sleep(0.25)  # the window ends COLLECT_TIMEOUT_S after the timeout
    assert _values(reader)["probe.gauge"] == 7
    provider.shutdown()
