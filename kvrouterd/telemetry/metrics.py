"""OpenTelemetry instruments for the daemon: decisions, route latency, events, gaps, workers.

The daemon owns its MeterProvider. Readers follow ``OTEL_METRICS_EXPORTER`` (``otlp``,
``console`` or ``none``, default none); a test can pass its own reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

__all__ = ["Metrics", "build_meter_provider"]


def build_meter_provider(service_name: str, readers: Sequence[MetricReader] = ()) -> MeterProvider:
    readers = list(readers)
    name = os.environ.get("OTEL_METRICS_EXPORTER", "none").split(",")[0].strip().lower()
    if name == "console":
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    elif name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    elif name not in ("", "none"):
        raise ValueError(f"unknown metrics exporter {name!r} (otlp, console or none)")
    return MeterProvider(resource=Resource.create({"service.name": service_name}), metric_readers=readers)


class Metrics:
    """The daemon's instruments. ``gauges`` callbacks read router state at collection time."""

    def __init__(
        self,
        provider: MeterProvider,
        index_blocks: Callable[[], int],
        worker_modes: Callable[[], Iterable[tuple[str, str, str, int]]],
    ) -> None:
        meter = provider.get_meter("kvrouterd")
        self.decisions = meter.create_counter("kvrouter.decisions", description="routing decisions by policy and reason")
        self.route_errors = meter.create_counter("kvrouter.route.errors", description="Route calls rejected, by gRPC code")
        self.route_latency = meter.create_histogram(
            "kvrouter.route.duration", unit="s", description="time to decide a Route (hash + match + policy)",
            # decisions take tens of microseconds to a few ms: the SDK's default buckets (0, 5, 10, ...) are for ms
            explicit_bucket_boundaries_advisory=(
                0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ),
        )
        self.event_batches = meter.create_counter("kvrouter.events.batches", description="event batches by outcome")
        self.blocks = meter.create_counter("kvrouter.events.blocks", description="blocks stored/removed by events")
        self.gaps = meter.create_counter("kvrouter.events.gaps", description="sequence gaps detected, per worker")

        def _index(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(index_blocks())

        def _workers(_: CallbackOptions) -> Iterable[Observation]:
            for worker_id, mode, state, cached in worker_modes():
                yield Observation(cached, {"worker": worker_id, "mode": mode, "state": state})

        meter.create_observable_gauge("kvrouter.index.blocks", [_index], description="blocks in the global index")
        meter.create_observable_gauge(
            "kvrouter.worker.cached_blocks", [_workers], description="blocks the index holds per worker, with mode and state"
        )
