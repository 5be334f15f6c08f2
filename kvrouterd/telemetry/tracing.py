"""Spans for decisions and event batches, built from the core's data from the outside.

Policies never import a tracer: the server turns a ``Decision`` into span attributes here
(as llm-d wraps its scorers with a traced one). Per-candidate values are parallel arrays
(``kvrouter.candidates.id``, ``.overlap_blocks``, ``.load_tokens``, ``.score``, and one
``kvrouter.candidates.term.<name>`` array per policy term), so a trace backend shows every
candidate of a decision without one attribute per worker. Past 16 candidates
(``policies.base.EXPLAINED_CANDIDATES``) the arrays list the chosen worker, those holding the
longest prefixes and the least loaded; ``kvrouter.candidates.count`` counts them all and
``kvrouter.candidates.listed`` the ones listed.

Exporters are configured the standard OpenTelemetry way: ``OTEL_TRACES_EXPORTER``
(``otlp``, ``console`` or ``none``) wins over the config's ``telemetry.traces``, and
``OTEL_SERVICE_NAME`` over ``telemetry.service_name``. The OTLP exporter speaks the protocol
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` or else ``OTEL_EXPORTER_OTLP_PROTOCOL`` names (``grpc``,
the default of OpenTelemetry's Python SDK, or ``http/protobuf``) and reads the other
``OTEL_EXPORTER_OTLP_*`` variables itself. Off by default.

With tracing on, :class:`ServerSpans` (a grpc.aio server interceptor) opens one SERVER span
per RPC with the ``rpc.*`` semantic-convention attributes, continuing the caller's trace from
the W3C ``traceparent``/``tracestate`` (and ``baggage``) in its gRPC metadata through the
OpenTelemetry propagation API (``OTEL_PROPAGATORS`` picks the formats). ``kvrouter.route``
and the other spans are its children, so a gateway's trace runs on into the router. Health
checks and reflection get no span (``OTEL_PYTHON_GRPC_EXCLUDED_SERVICES``, the variable
OpenTelemetry's gRPC instrumentation reads, replaces that list; empty = trace every service).
With tracing off the interceptor is not installed: Route pays nothing.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter

from ..decimals import parse_decimal
from ..errors import ConfigError
from ..protocols import BatchOutcome, CacheMode, Decision, EventBatch
from ..router import RouteResult

__all__ = [
    "ServerSpans", "annotate_batch", "annotate_decision", "build_exporter", "build_tracer_provider",
    "decision_span", "exporter_name", "otlp_protocol", "service_name", "untraced_services",
]

#: the exporters OTEL_TRACES_EXPORTER / telemetry.traces may name
EXPORTERS = ("otlp", "console", "none")
#: the OTLP protocols the spec's OTEL_EXPORTER_OTLP_*PROTOCOL may name that Python has exporters for
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
#: services whose calls get no SERVER span unless OTEL_PYTHON_GRPC_EXCLUDED_SERVICES says otherwise:
#: kubelet probes and grpcurl's reflection would otherwise flood the trace backend
UNTRACED_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
)


def service_name(configured: str, environ: Mapping[str, str] | None = None) -> str:
    """``OTEL_SERVICE_NAME`` wins over the config's ``telemetry.service_name``, as the SDK's own
    resource detector would have it (a Resource built with an explicit name would ignore it)."""
    env = os.environ if environ is None else environ
    return env.get("OTEL_SERVICE_NAME", "").strip() or configured


def exporter_name(configured: str, environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower() or configured
    return name.split(",")[0].strip()


def otlp_protocol(environ: Mapping[str, str] | None = None) -> str:
    """The OTLP protocol for traces: the per-signal variable wins over the general one (the spec's order)."""
    env = os.environ if environ is None else environ
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = env.get(variable, "").strip()
        if not value:
            continue
        if value not in OTLP_PROTOCOLS:
            raise ConfigError(f"{variable}: unsupported OTLP protocol {value!r} (one of {', '.join(OTLP_PROTOCOLS)})")
        return value
    return "grpc"


def build_exporter(configured_exporter: str) -> SpanExporter | None:
    """The exporter ``OTEL_TRACES_EXPORTER`` / ``telemetry.traces`` names, or None when tracing is off.

    Everything that can fail about it fails here, as a ConfigError, so ``config check`` (which
    builds it and shuts it down) refuses what ``serve`` would crash on: an unknown name or
    protocol, an exporter package that does not import, a malformed ``OTEL_EXPORTER_OTLP_*`` value.
    """
    name = exporter_name(configured_exporter)
    if name not in EXPORTERS and name:
        source = "OTEL_TRACES_EXPORTER" if os.environ.get("OTEL_TRACES_EXPORTER", "").strip() else "telemetry.traces"
        raise ConfigError(f"{source}: unknown traces exporter {name!r} (one of {', '.join(EXPORTERS)})")
    if name in ("", "none"):
        return None
    if name == "console":
        return ConsoleSpanExporter()
    protocol = otlp_protocol()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        return OTLPSpanExporter()
    except Exception as exc:  # ImportError from a broken install, ValueError from a malformed variable
        raise ConfigError(f"traces exporter otlp ({protocol}) cannot be built: {type(exc).__name__}: {exc}") from exc


def build_tracer_provider(
    service_name: str,
    configured_exporter: str,
    exporter: SpanExporter | None = None,
) -> TracerProvider | None:
    """A provider owned by the daemon (never the global one), or None when tracing is off.

    ``exporter`` (tests) is attached with a synchronous processor so spans are visible at once.
    """
    if exporter is None:
        built = build_exporter(configured_exporter)
        if built is None:
            return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(built))
    return provider


def untraced_services(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The services whose calls get no SERVER span (see the module docstring)."""
    env = os.environ if environ is None else environ
    if "OTEL_PYTHON_GRPC_EXCLUDED_SERVICES" not in env:
        return frozenset(UNTRACED_SERVICES)
    return frozenset(s.strip() for s in env["OTEL_PYTHON_GRPC_EXCLUDED_SERVICES"].split(",") if s.strip())


@contextmanager
def decision_span(tracer: trace.Tracer, name: str = "kvrouter.route") -> Iterator[trace.Span]:
    """The span of one decision. A rejection sets its status from the error the client gets;
    the abort that carries that error out must not overwrite it with ``AbortError: Locally aborted.``"""
    with tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
        yield span


def annotate_decision(span: trace.Span, result: RouteResult, block_size: int) -> None:
    d: Decision = result.decision
    req = result.request
    worker = result.worker
    attrs: dict[str, object] = {
        "kvrouter.request_id": req.request_id,
        "kvrouter.policy": d.policy,
        "kvrouter.reason": d.reason,
        "kvrouter.prompt_tokens": req.prompt_tokens,
        "gen_ai.usage.input_tokens": req.prompt_tokens,
        "kvrouter.prompt_blocks": len(req.keys),
        "kvrouter.block_size": block_size,
        "kvrouter.chosen.worker_id": worker.id,
        "kvrouter.chosen.address": worker.address,
        "kvrouter.chosen.matched_blocks": d.overlap_blocks,
        "kvrouter.chosen.state_mode": "events" if worker.mode is CacheMode.EVENTS else "approximate",
        "kvrouter.chosen.state": worker.state.name.lower(),
        "kvrouter.candidates.count": d.candidate_count or len(d.candidates),
        "kvrouter.candidates.id": [c.worker_id for c in d.candidates],
        "kvrouter.candidates.overlap_blocks": [c.overlap_blocks for c in d.candidates],
        "kvrouter.candidates.load_tokens": [c.pending_prefill_tokens for c in d.candidates],
        "kvrouter.candidates.inflight": [c.inflight_requests for c in d.candidates],
        "kvrouter.candidates.score": [float(c.score) for c in d.candidates],
    }
    if d.candidate_count > len(d.candidates):  # a big fleet's: the chosen and the likeliest (Decision.candidates)
        attrs["kvrouter.candidates.listed"] = len(d.candidates)
    term_names = sorted({k for c in d.candidates for k in c.terms})
    for name in term_names:
        attrs[f"kvrouter.candidates.term.{name}"] = [float(c.terms.get(name, float("nan"))) for c in d.candidates]
    if d.alternative_worker_id:
        attrs["kvrouter.alternative.worker_id"] = d.alternative_worker_id
    if d.estimated_ttft_ms:
        attrs["kvrouter.estimated_ttft_ms"] = d.estimated_ttft_ms
    if req.session_id:
        attrs["kvrouter.session_id"] = req.session_id
    if req.model:
        attrs["gen_ai.request.model"] = req.model
    if d.pool:
        attrs["kvrouter.pool"] = d.pool
    if d.lora_placement:
        attrs["kvrouter.lora"] = req.lora or req.model  # OpenAI bodies name the adapter in ``model``
        attrs["kvrouter.lora.placement"] = d.lora_placement
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


def _metadata_getter(metadata: Any) -> dict[str, str]:
    """gRPC metadata as a carrier: keys are lower-case already; binary (-bin) values are not text."""
    return {k: v for k, v in (metadata or ()) if isinstance(v, str)}


class ServerSpans(grpc.aio.ServerInterceptor):
    """One SERVER span per RPC, a child of the caller's trace context from its metadata.

    Attributes follow the OpenTelemetry RPC conventions: ``rpc.system`` = grpc,
    ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code``, and ``network.peer.address``.
    The span's name is ``package.Service/Method``.

    Why not ``opentelemetry-instrumentation-grpc``'s aio server interceptor (0.66b2): it names
    the span ``/package.Service/Method`` (the conventions drop the slash), writes the deprecated
    ``net.peer.ip``/``net.peer.port`` (the port as a string) and ``net.peer.name`` instead of
    ``network.peer.*``, leaves ``rpc.grpc.status_code`` at 0 when a handler raises (the client
    gets UNKNOWN), and prefixes the status description with the code's repr, so a span no longer
    carries the message the client got. tests/integration/test_tracing.py pins each of these.
    """

    def __init__(self, tracer: trace.Tracer, untraced: frozenset[str] | None = None) -> None:
        self.tracer = tracer
        self.untraced = untraced_services() if untraced is None else untraced

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        full_method = handler_call_details.method  # "/kvrouter.v1.KVRouter/Route"
        service, _, method = full_method.lstrip("/").rpartition("/")
        if service in self.untraced:
            return handler
        carrier = _metadata_getter(handler_call_details.invocation_metadata)
        span_args = {
            "name": f"{service}/{method}",
            "kind": trace.SpanKind.SERVER,
            "attributes": {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
            "record_exception": False,
            "set_status_on_exception": False,
        }
        tracer = self.tracer

        def traced(behavior: Callable[..., Any], streams_out: bool) -> Callable[..., Any]:
            if streams_out and inspect.isasyncgenfunction(behavior):
                async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                    with tracer.start_as_current_span(context=propagate.extract(carrier), **span_args) as span:
                        _peer(span, context)
                        try:
                            async for response in behavior(request, context):
                                yield response
                        finally:
                            _finish(span, context)
                return stream

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with tracer.start_as_current_span(context=propagate.extract(carrier), **span_args) as span:
                    _peer(span, context)
                    try:
                        return await behavior(request, context)
                    finally:
                        _finish(span, context)
            return unary

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                traced(handler.unary_unary, False), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                traced(handler.unary_stream, True), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                traced(handler.stream_unary, False), handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            traced(handler.stream_stream, True), handler.request_deserializer, handler.response_serializer)


def _peer(span: trace.Span, context: grpc.aio.ServicerContext) -> None:
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5678", "ipv6:[::1]:5678", "unix:..."
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, digits = address.rpartition(":")
        span.set_attribute("network.peer.address", host.strip("[]"))
        if (port := parse_decimal(digits)) is not None:
            span.set_attribute("network.peer.port", port)


def _finish(span: trace.Span, context: grpc.aio.ServicerContext) -> None:
    code = context.code()
    if code is None:  # the handler returned normally: OK, or it raised (grpc maps that to UNKNOWN)
        code = grpc.StatusCode.UNKNOWN if sys.exc_info()[0] not in (None, GeneratorExit) else grpc.StatusCode.OK
    if isinstance(code, int):
        number = code
    else:
        number = code.value[0]
    span.set_attribute("rpc.grpc.status_code", number)
    if number != 0:
        details = context.details()
        if isinstance(details, bytes):
            details = details.decode(errors="replace")
        span.set_status(trace.Status(trace.StatusCode.ERROR, details or None))
