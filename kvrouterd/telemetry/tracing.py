"""Spans for decisions and event batches, built from the core's data from the outside.

Policies never import a tracer: the server turns a ``Decision`` into span attributes here
(as llm-d wraps its scorers with a traced one). Per-candidate values are parallel arrays
(``kvrouter.candidates.id``, ``.overlap_blocks``, ``.load_tokens``, ``.score``, and one
``kvrouter.candidates.term.<name>`` array per policy term), so a trace backend shows every
candidate of a decision without one attribute per worker.

Exporters are configured the standard OpenTelemetry way: ``OTEL_TRACES_EXPORTER``
(``otlp``, ``console`` or ``none``) wins over the config's ``telemetry.traces``; the OTLP
exporter reads ``OTEL_EXPORTER_OTLP_*``. Off by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter

from ..protocols import BatchOutcome, CacheMode, Decision, EventBatch
from ..router import RouteResult

__all__ = ["annotate_batch", "annotate_decision", "build_tracer_provider", "exporter_name"]


def exporter_name(configured: str, environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or configured
    return name.split(",")[0].strip()


def build_tracer_provider(
    service_name: str,
    configured_exporter: str,
    exporter: SpanExporter | None = None,
) -> TracerProvider | None:
    """A provider owned by the daemon (never the global one), or None when tracing is off.

    ``exporter`` (tests) is attached with a synchronous processor so spans are visible at once.
    """
    name = exporter_name(configured_exporter)
    if exporter is None and name in ("", "none"):
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif name == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        raise ValueError(f"unknown traces exporter {name!r} (otlp, console or none)")
    return provider


def annotate_decision(span: trace.Span, result: RouteResult, block_size: int) -> None:
    d: Decision = result.decision
    req = result.request
    worker = result.worker
    attrs: dict[str, object] = {
        "kvrouter.request_id": req.request_id,
        "kvrouter.policy": d.policy,
        "kvrouter.reason": d.reason,
        "kvrouter.prompt_tokens": req.prompt_tokens,
        "kvrouter.prompt_blocks": len(req.keys),
        "kvrouter.block_size": block_size,
        "kvrouter.chosen.worker_id": worker.id,
        "kvrouter.chosen.address": worker.address,
        "kvrouter.chosen.matched_blocks": d.overlap_blocks,
        "kvrouter.chosen.state_mode": "events" if worker.mode is CacheMode.EVENTS else "approximate",
        "kvrouter.chosen.state": worker.state.name.lower(),
        "kvrouter.candidates.count": len(d.candidates),
        "kvrouter.candidates.id": [c.worker_id for c in d.candidates],
        "kvrouter.candidates.overlap_blocks": [c.overlap_blocks for c in d.candidates],
        "kvrouter.candidates.load_tokens": [c.pending_prefill_tokens for c in d.candidates],
        "kvrouter.candidates.inflight": [c.inflight_requests for c in d.candidates],
        "kvrouter.candidates.score": [float(c.score) for c in d.candidates],
    }
    term_names = sorted({k for c in d.candidates for k in c.terms})
    for name in term_names:
        attrs[f"kvrouter.candidates.term.{name}"] = [float(c.terms.get(name, float("nan"))) for c in d.candidates]
    if d.alternative_worker_id:
        attrs["kvrouter.alternative.worker_id"] = d.alternative_worker_id
    if d.estimated_ttft_ms:
        attrs["kvrouter.estimated_ttft_ms"] = d.estimated_ttft_ms
    if req.session_id:
        attrs["kvrouter.session_id"] = req.session_id
    for k, v in d.attributes.items():
        attrs[f"kvrouter.policy.{k}"] = v
    span.set_attributes(attrs)  # type: ignore[arg-type]


def annotate_batch(span: trace.Span, batch: EventBatch, outcome: BatchOutcome) -> None:
    span.set_attributes(
        {
            "kvrouter.worker_id": batch.worker_id,
            "kvrouter.sequence": batch.sequence,
            "kvrouter.events": len(batch.events),
            "kvrouter.applied": outcome.applied,
            "kvrouter.duplicate": outcome.duplicate,
            "kvrouter.gap": outcome.gap,
            "kvrouter.restarted": outcome.restarted,
            "kvrouter.blocks_stored": outcome.blocks_stored,
            "kvrouter.blocks_removed": outcome.blocks_removed,
            "kvrouter.orphan_blocks": outcome.orphan_blocks,
            "kvrouter.unknown_removals": outcome.unknown_removals,
        }
    )
