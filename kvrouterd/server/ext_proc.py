"""Envoy External Processing: kvrouterd as a Gateway API Inference Extension endpoint picker.

Implements ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` (protos from the
``xds-protos`` package) as the endpoint-picker protocol specifies it
(kubernetes-sigs/gateway-api-inference-extension, ``docs/proposals/004-endpoint-picker-
protocol/README.md``, v1.0.0), following the reference picker's handlers
(``pkg/epp/handlers/server.go``, ``request.go``) where the proposal is silent:

- Envoy runs the filter with ``request_header_mode: SEND`` and ``request_body_mode:
  FULL_DUPLEX_STREAMED`` (``request_trailer_mode: SEND``, which Envoy requires with it).
  The request-headers answer is withheld until the body has arrived (end of stream on a body
  chunk, or trailers), because the prompt is in the body. A request whose headers end the
  stream (a GET) goes to the least-loaded eligible worker of its model's pool, nothing
  committed (``_any_worker``, below).
- The body is parsed as OpenAI JSON (``openai_prompt.py``), keyed, and routed through the
  same ``Router.route`` as the ``Route`` RPC. A body of ``limits.off_loop_prompt_bytes`` or
  more is read, tokenized and hashed on a worker thread (``openai_prompt.body_keys``: the
  native reader, the tokenizer's encoding and the hashing release the GIL), so other requests
  are routed meanwhile; the decision itself then runs on the loop in one step, on the index
  and fleet as they stand when the keys are ready, exactly as for a small body (docs/envoy.md,
  "Huge bodies"). Such a body that only ``json.loads`` could read (which holds the GIL) is
  routed unread, as a request without a prompt (reason ``body_not_read``).
- A request without a prompt (a GET, a path other than ``/completions`` and
  ``/chat/completions``, a body routed unread) goes to the least-loaded worker of its model's
  pool (``router.pools``, the filter ``Route`` applies; the decode workers of a P/D pool, with no
  prefill hop), nothing committed. Its model is the body's top-level ``model`` when the body
  is JSON under ``limits.off_loop_prompt_bytes`` (a larger one is not parsed on the loop), else
  the ``x-gateway-model-name`` header (the inference extension's body-based router sets it from
  the body); a model no worker serves is a 404, as for a request with a prompt. The answer to the request headers sets the header
  ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` (the chosen worker, then
  the policy's alternative, up to ``ext_proc.max_endpoints``), overwriting any sent by the
  client, plus ``content-length`` and ``clear_route_cache`` as the reference does, **and**
  the same value in ``dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]``.
  The body then goes back unchanged as ``streamed_response`` chunks of at most 62,000 bytes
  (the reference's ``bodyByteLimit``: some Envoy builds cap a streamed chunk at 64 KiB).
- Prefill/decode pools (``router.disagg``): the destination is the decode worker; a
  disaggregated decision also sets ``x-prefiller-host-port: ip:port`` (the prefill worker),
  the header llm-d's ``disagg-profile-handler`` sets and its routing sidecar on the decode pod
  reads to run the prefill there first (``pkg/common/routing/common.go``,
  ``PrefillEndpointHeader``). Otherwise that header is removed: a client must not choose
  where prefill runs. The prefill hop's load is released when the response headers arrive
  (the sidecar answers only after the prefill), the decode hop's when the stream closes.
- Subset hint: ``metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`` (a list of ip:port, a comma-separated string,
  or a list whose elements are comma-separated; a bare IP allows every port on that host)
  restricts the pick to workers with those addresses; none eligible -> 503. Unlike a
  ``Route`` whose ``candidate_workers`` are all unknown (NOT_FOUND, the caller's mistake), a
  hint that names no registered worker is 503 too: the proxy builds it from the endpoints it
  has (the pool's ready pods), so an address the router does not know is a pod that has not
  registered yet, or one that just left, not a typo; the protocol's answer when no endpoint
  of the subset can be picked is 503, as the reference picker's.
- Request bodies must come ``FULL_DUPLEX_STREAMED``: when Envoy announces ``BUFFERED`` or
  ``STREAMED`` in ``protocol_config`` the exchange ends at once with a 500 naming the
  setting, instead of both sides waiting for each other.
- ``x-slo-ttft-ms`` (llm-d's SLO header) is the request's ``ttft_slo_ms``: deadline admission
  refuses it (429) when no eligible worker is predicted to meet it; not a number -> 400.
- Errors end the exchange with an ``ImmediateResponse``: malformed JSON or prompt -> 400,
  no eligible worker -> 503, shed (prompt over ``limits.max_prompt_tokens``, body over
  ``ext_proc.max_body_bytes``) -> 429 (``status.http_status`` maps the error tree).
- Response path: the served endpoint is read from ``metadata_context.filter_metadata
  ["envoy.lb"]["x-gateway-destination-endpoint-served"]`` (the protocol's place), else a
  response header of that name, else plain Envoy's ``upstream.address`` attribute (sent
  when the filter lists it in ``response_attributes``); ``:status`` gives success. TTFT is approximated by
  the time from the routing decision to the first response-body chunk, or to the response
  headers when the body is not sent to us; end-to-end runs to the response's end of stream,
  or to the close of the ext_proc stream. The request is completed when the stream closes,
  however it closes, so its load is always released. If a fallback served the request, the
  timings are withheld (sent as 0, "no observation") so they do not calibrate the primary
  worker's latency model with another worker's latency.
- Response bodies (``response_body_mode: FULL_DUPLEX_STREAMED``) are echoed unchanged; with
  another mode announced in ``protocol_config`` they are passed with an empty answer.
- With admission queue mode on (``admission``), a routed request waits in its worker's
  queue exactly as a ``Route`` call does; giving up there is a shed (429).
- gRPC health reports ``envoy.service.ext_proc.v3.ExternalProcessor``, and the service names
  the endpoint-picker protocol probes, ``liveness`` (the process serves) and ``readiness``
  (ready to route, like ``""``) (registered in app.py).

One span (``kvrouter.ext_proc.route``) per routing decision, annotated like ``Route``'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain

import grpc
from google.protobuf import struct_pb2
from opentelemetry import trace

from .._generated.envoy.config.core.v3 import base_pb2
from .._generated.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from .._generated.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .._generated.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from .._generated.envoy.type.v3 import http_status_pb2
from ..config import ExtProcConfig
from ..decimals import parse_decimal
from ..errors import ConfigError, InvalidRequest, KVRouterError, NoEligibleWorker, NotFound, Overloaded
from ..index.workers import Worker
from ..protocols import Completion, RouteRequest
from ..router import Router
from ..telemetry.metrics import Metrics
from ..telemetry.tracing import annotate_decision
from .admission import AdmissionGate
from .call_errors import CallErrors
from .openai_prompt import BodyKeys, BodyNotRead, PromptKeyer, body_keys, body_model, load_tokenizer
from .status import http_status, retry_after_ms, status_code, status_message

__all__ = [
    "BODY_CHUNK_BYTES",
    "DESTINATION_ENDPOINT_HEADER",
    "DESTINATION_ENDPOINT_NAMESPACE",
    "DESTINATION_ENDPOINT_SERVED_KEY",
    "EXT_PROC_SERVICE",
    "MODEL_NAME_HEADER",
    "SUBSET_HINT_KEY",
    "SUBSET_HINT_NAMESPACE",
    "ExtProcService",
]

log = logging.getLogger("kvrouterd.ext_proc")

EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
DESTINATION_ENDPOINT_NAMESPACE = "envoy.lb"
DESTINATION_ENDPOINT_SERVED_KEY = "x-gateway-destination-endpoint-served"
#: llm-d's prefill-hop header (llm-d-inference-scheduler ``routing.PrefillEndpointHeader``)
PREFILL_ENDPOINT_HEADER = "x-prefiller-host-port"
#: the request's TTFT objective in ms, the header llm-d's SLO-aware scorers read
#: (llm-d-inference-scheduler, README-PD-SLO.md); routed as ``RouteRequest.ttft_slo_ms``
TTFT_SLO_HEADER = "x-slo-ttft-ms"
#: the model a request names, as the inference extension's body-based router sets it (``pkg/bbr``)
MODEL_NAME_HEADER = "x-gateway-model-name"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
#: where Envoy puts the attributes the filter is configured to send
EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
#: the reference picker's bodyByteLimit: below the 64 KiB some Envoy builds allow per chunk
BODY_CHUNK_BYTES = 62_000

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


@dataclass(slots=True)
class _Exchange:
    """What one HTTP request's ext_proc stream has shown so far."""

    headers: dict[str, str] = field(default_factory=dict)
    subset: tuple[str, ...] | None = None
    response_body_full_duplex: bool = True
    #: the request body's chunks as received, and their total size (joined once, when complete)
    body: list[bytes] = field(default_factory=list)
    body_size: int = 0
    decided: bool = False
    #: set when the router committed load for this request (to be released by Complete)
    request_id: str = ""
    primary: str = ""
    #: when the request's headers came: its TTFT and end-to-end time count from here, as the
    #: caller's and the simulator's do, an admission queue's wait included (deadline admission
    #: judges a request by its SLO from arrival)
    arrived_at: float = 0.0
    routed_at: float = 0.0
    response_headers_at: float = 0.0
    first_chunk_at: float = 0.0
    response_done_at: float = 0.0
    status: int = 0
    served: str = ""
    #: the prefill hop's worker address of a disaggregated decision ("" = none)
    prefill: str = ""


def _header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    # Envoy sends raw_value (bytes) in recent versions and value in older ones
    return {h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value) for h in headers.headers}


def _metadata_value(md: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    ns = md.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key]


def _addresses(value: struct_pb2.Value) -> tuple[str, ...]:
    """The subset hint's endpoints in every form the reference picker accepts: a list of
    strings, one comma-separated string, or a list whose elements are comma-separated."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = [value.string_value]
    else:
        items = []
    return tuple(a.strip() for item in items for a in item.split(",") if a.strip())


def _host_port(endpoint: str) -> tuple[str, str]:
    """("10.0.0.5", "8000") from "10.0.0.5:8000"; a bare IP (v4 or v6) has port "" and
    matches every port on that host, as in the reference picker's subset filter."""
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        return host, rest.removeprefix(":")
    if endpoint.count(":") == 1:
        host, _, port = endpoint.partition(":")
        return host, port
    return endpoint, ""  # a bare IPv4 / hostname, or a bare IPv6 address


def _in_subset(address: str, subset: set[tuple[str, str]]) -> bool:
    host, port = _host_port(address)
    return (host, port) in subset or (host, "") in subset


def _upstream_address(msg: ep.ProcessingRequest) -> str:
    """Plain Envoy's ``upstream.address`` attribute (``response_attributes`` in the filter)."""
    attrs = msg.attributes.get(EXT_PROC_ATTRIBUTES)
    if attrs is None or "upstream.address" not in attrs.fields:
        return ""
    value = attrs.fields["upstream.address"]
    return value.string_value if value.WhichOneof("kind") == "string_value" else ""


def _immediate(exc: KVRouterError) -> ep.ProcessingResponse:
    code = http_status(exc)
    headers = [("content-type", b"text/plain; charset=utf-8")]
    retry_ms = retry_after_ms(exc)
    if retry_ms is not None:  # HTTP's Retry-After is in whole seconds (RFC 9110, 10.2.3)
        headers.append(("retry-after", str(max(1, math.ceil(retry_ms / 1000.0))).encode()))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=code),  # type: ignore[arg-type]
            headers=ep.HeaderMutation(
                set_headers=[base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE,
                ) for key, value in headers]
            ),
            body=f"kvrouterd: {exc}\n".encode(),
            details=f"kvrouterd_{type(exc).__name__}",
        )
    )


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _ttft_slo_ms(value: str) -> float:
    """The ``x-slo-ttft-ms`` header as a number (0 = absent); its range is checked with the
    rest of the request (``router.selector``)."""
    if not value:
        return 0.0
    try:
        slo = float(value.strip())
    except ValueError:
        raise InvalidRequest(f"{TTFT_SLO_HEADER} must be a number of milliseconds, got {value[:40]!r}") from None
    return slo


def _destination_response(destination: str, body_len: int, prefill: str = "") -> ep.ProcessingResponse:
    headers = [_header(DESTINATION_ENDPOINT_HEADER, destination)]
    if body_len:
        headers.append(_header("content-length", str(body_len)))
    if prefill:
        headers.append(_header(PREFILL_ENDPOINT_HEADER, prefill))
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_ENDPOINT_NAMESPACE: {DESTINATION_ENDPOINT_HEADER: destination}})
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(set_headers=headers, remove_headers=() if prefill else (PREFILL_ENDPOINT_HEADER,)),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=metadata,
    )


def _body_chunks(body: bytes, end_of_stream: bool) -> Iterable[ep.ProcessingResponse]:
    n = len(body)
    starts = range(0, n, BODY_CHUNK_BYTES) if n else range(1)
    for start in starts:
        last = start + BODY_CHUNK_BYTES >= n
        yield ep.ProcessingResponse(
            request_body=ep.BodyResponse(
                response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(
                        streamed_response=ep.StreamedBodyResponse(
                            body=body[start : start + BODY_CHUNK_BYTES], end_of_stream=end_of_stream and last
                        )
                    )
                )
            )
        )


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        router: Router,
        keyer: PromptKeyer,
        settings: ExtProcConfig,
        tracer: trace.Tracer | None = None,
        metrics: Metrics | None = None,
        admission: AdmissionGate | None = None,
    ) -> None:
        self.router = router
        self.keyer = keyer
        self.settings = settings
        self.tracing = tracer is not None
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self.metrics = metrics
        #: where a refused request is counted and logged, sampled (the daemon sets its ledger;
        #: None = not counted, logged at debug)
        self.call_errors: CallErrors | None = None
        #: the daemon's admission queues (None = off): a routed request waits there like Route's
        self.admission = admission
        #: a body of this many bytes or more is read and keyed on a worker thread (the daemon
        #: sets limits.off_loop_prompt_bytes; 0 = always on the loop)
        self.off_loop_body_bytes = 0
        #: a response_body_mode of NONE was announced and warned about (once per process)
        self._warned_response_mode = False
        #: the last subset hint read (its bytes, its endpoints) and the worker ids it allowed at a
        #: membership generation: a gateway sending one sends the same list (the pool's endpoints)
        #: with every request, and reading it anew took ~2 ms a request at 1,024 endpoints
        self._hint: tuple[bytes, tuple[str, ...]] = (b"", ())
        self._hint_ids: tuple[tuple[str, ...] | None, int, tuple[str, ...]] = (None, -1, ())
        #: what reads a body into its model and keys (a test wraps it to see the loop serve
        #: other requests meanwhile)
        self.key_body: Callable[[str, bytes], BodyKeys | None] = self._key_body

    def _key_body(self, path: str, body: bytes) -> BodyKeys | None:
        # a body read off the loop that only json.loads could read raises BodyNotRead: that
        # parser holds the GIL, so reading it on the worker thread would stall routing anyway
        return body_keys(path, body, self.keyer, unread_from=self.off_loop_body_bytes)

    @classmethod
    def from_config(
        cls,
        router: Router,
        settings: ExtProcConfig,
        tracer: trace.Tracer | None = None,
        metrics: Metrics | None = None,
        admission: AdmissionGate | None = None,
    ) -> ExtProcService:
        """Loads the configured tokenizer (ConfigError if it cannot be) and builds the servicer."""
        tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
        keyer = PromptKeyer(router.block_size, tokenizer, settings.salt_keys_with_model)
        return cls(router, keyer, settings, tracer, metrics, admission)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        ep_grpc.add_ExternalProcessorServicer_to_server(self, server)

    # ---- the stream ---------------------------------------------------------------------
    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        ex = _Exchange()
        try:
            async for msg in request_iterator:
                replies, finished = await self._on_message(ex, msg, context)
                for reply in replies:
                    yield reply
                if finished:
                    return
        finally:
            # runs on normal close, on an ImmediateResponse and when Envoy cancels the stream
            self._complete(ex)

    async def _on_message(
        self, ex: _Exchange, msg: ep.ProcessingRequest, context: grpc.aio.ServicerContext
    ) -> tuple[Iterable[ep.ProcessingResponse], bool]:
        """Replies to one message, and whether the exchange ended (ImmediateResponse). The replies
        may be a generator: built one by one as they are sent, so that echoing a multi-MiB body
        is not one long step of the loop."""
        if msg.HasField("protocol_config"):
            request_mode = msg.protocol_config.request_body_mode
            if request_mode not in (_FULL_DUPLEX, processing_mode_pb2.ProcessingMode.NONE):
                # with BUFFERED / STREAMED Envoy waits for our header answer before it sends the
                # body, and we wait for the body: say so instead of hanging the request
                name = processing_mode_pb2.ProcessingMode.BodySendMode.Name(request_mode)
                return self._reject(ex, ConfigError(
                    f"Envoy sends request bodies in {name} mode; kvrouterd's endpoint picker needs "
                    "request_body_mode: FULL_DUPLEX_STREAMED (docs/envoy.md)"
                )), True
            mode = msg.protocol_config.response_body_mode
            ex.response_body_full_duplex = mode in (_FULL_DUPLEX, processing_mode_pb2.ProcessingMode.NONE)
            if mode == processing_mode_pb2.ProcessingMode.NONE and not self._warned_response_mode:
                self._warned_response_mode = True
                log.warning(
                    "Envoy sends no response bodies (response_body_mode: NONE): a request is timed to its "
                    "response headers, and Envoy may end the ext_proc stream there, releasing the request's "
                    "load while it still decodes; streamed (SSE) responses need FULL_DUPLEX_STREAMED for "
                    "load-aware routing and deadline admission to see them (docs/envoy.md)"
                )
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            ex.arrived_at = self.router.clock.now()
            ex.headers = _header_map(msg.request_headers.headers)
            value = _metadata_value(msg.metadata_context, SUBSET_HINT_NAMESPACE, SUBSET_HINT_KEY)
            if value is not None:
                ex.subset = self._subset(value)
            if msg.request_headers.end_of_stream:
                return await self._decide(ex, None, context, end_of_stream=True)
            return [], False
        if kind == "request_body":
            if ex.decided:  # a late chunk after an answer: pass it on unchanged
                return list(_body_chunks(msg.request_body.body, msg.request_body.end_of_stream)), False
            ex.body.append(msg.request_body.body)
            ex.body_size += len(msg.request_body.body)
            if ex.body_size > self.settings.max_body_bytes:
                return self._reject(ex, Overloaded(
                    f"request body over ext_proc.max_body_bytes={self.settings.max_body_bytes}"
                )), True
            if msg.request_body.end_of_stream:
                return await self._decide(ex, b"".join(ex.body), context, end_of_stream=True)
            return [], False
        if kind == "request_trailers":
            trailers = [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
            if ex.decided:
                return trailers, False
            replies, finished = await self._decide(ex, b"".join(ex.body), context, end_of_stream=False)
            return (replies, True) if finished else (chain(replies, trailers), False)
        if kind == "response_headers":
            return [self._on_response_headers(ex, msg)], False
        if kind == "response_body":
            return [self._on_response_body(ex, msg.response_body)], False
        if kind == "response_trailers":
            ex.response_done_at = ex.response_done_at or self.router.clock.now()
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())], False
        return [], False  # nothing set: a newer Envoy's message we need not answer

    def _reject(self, ex: _Exchange, exc: KVRouterError, span: trace.Span | None = None) -> list[ep.ProcessingResponse]:
        ex.decided = True
        code = status_code(exc)
        if self.metrics is not None:
            self.metrics.route_errors.add(1, {"code": code.name})
        if span is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            span.set_attribute("http.response.status_code", http_status(exc))
        if self.call_errors is not None:  # sampled: one client can send thousands a second
            self.call_errors.rejected("Process", code.name, f"HTTP {http_status(exc)}: {status_message(exc)}")
        else:
            log.debug("ext_proc request rejected: %s", exc, extra={"status": http_status(exc)})
        return [_immediate(exc)]

    # ---- request path -------------------------------------------------------------------
    def _subset(self, value: struct_pb2.Value) -> tuple[str, ...]:
        """The subset hint's endpoints (``_addresses``), read once for a hint sent again."""
        raw = value.SerializeToString(deterministic=True)
        if raw != self._hint[0]:
            self._hint = (raw, _addresses(value))
        return self._hint[1]

    def _candidates(self, ex: _Exchange) -> tuple[str, ...]:
        """Worker ids the subset hint allows; () = no hint, or one naming every eligible worker
        (the router then takes its path for the whole fleet, where 1,024 named candidates cost a
        decision 0.37 ms against 0.01)."""
        subset = ex.subset
        if subset is None:
            return ()
        generation = self.router.workers.generation
        seen, at, ids = self._hint_ids
        if seen is not subset or at != generation:
            wanted = {_host_port(a) for a in subset}
            eligible = [w for w in self.router.workers if w.eligible]
            ids = tuple(w.id for w in eligible if _in_subset(w.address, wanted))
            if not ids:
                raise NoEligibleWorker(f"no eligible worker has an address in the subset hint {list(subset)}")
            if len(ids) == len(eligible):
                ids = ()
            self._hint_ids = (subset, generation, ids)
        return ids

    def _any_worker(self, ex: _Exchange, body: bytes | None, candidates: tuple[str, ...]) -> tuple[Worker, str]:
        """``(worker, pool)`` for a request without a prompt: the least loaded of the workers
        its model's pool allows (module docstring); raises ``UnknownModel`` as Route does."""
        model = ""
        if body is not None and (not self.off_loop_body_bytes or len(body) < self.off_loop_body_bytes):
            model = body_model(body)
        model = model or ex.headers.get(MODEL_NAME_HEADER, "")
        workers, pool = self.router.destinations(RouteRequest("", (), 0, model=model, candidate_workers=candidates))
        return min(workers, key=lambda w: (w.inflight_requests, w.pending_prefill_tokens, w.slot)), pool

    async def _decide(
        self, ex: _Exchange, body: bytes | None, context: grpc.aio.ServicerContext, *, end_of_stream: bool
    ) -> tuple[Iterable[ep.ProcessingResponse], bool]:
        ex.decided = True
        started = time.perf_counter()
        path = ex.headers.get(":path", "")
        with self.tracer.start_as_current_span("kvrouter.ext_proc.route", record_exception=False) as span:
            recording = self.tracing and span.is_recording()
            try:
                candidates = self._candidates(ex)
                keyed, unread = None, False
                self.keyer.adapter_bases = self.router.adapter_bases()  # read here, on the loop
                if body is not None and self.off_loop_body_bytes and len(body) >= self.off_loop_body_bytes:
                    try:
                        keyed = await asyncio.to_thread(self.key_body, path, body)
                    except BodyNotRead as exc:
                        # routed unread, as a request without a prompt: the engine still
                        # validates it; counted under reason body_not_read
                        log.debug("ext_proc body not read: %s", exc, extra={"path": path})
                        unread = True
                    # the fleet may have changed meanwhile: decide on it as it stands now, in
                    # one step with the routing below, as for a body keyed on the loop
                    candidates = self._candidates(ex)
                elif body is not None:
                    keyed = self.key_body(path, body)
                if keyed is None:
                    worker, pool = self._any_worker(ex, body, candidates)
                    destination = worker.address
                    policy = "ext_proc"
                    source, reason = ("unread", "body_not_read") if unread else ("none", "no_prompt")
                    pd_reason = ""
                else:
                    pk = keyed.prompt
                    rid = ex.headers.get("x-request-id", "")
                    if rid and (len(rid) > self.router.settings.max_id_length or self.router.request(rid) is not None
                                or (self.admission is not None and self.admission.waiting(rid))):
                        # a trace label, not ours to refuse on: one in flight or waiting already (a
                        # mesh passes one id to parallel calls) or over the id limit is renamed
                        rid = ""
                    req = RouteRequest(
                        request_id=rid, keys=pk.keys, prompt_tokens=pk.prompt_tokens,
                        model=keyed.model, candidate_workers=candidates,
                        ttft_slo_ms=_ttft_slo_ms(ex.headers.get(TTFT_SLO_HEADER, "")),
                    )
                    if self.admission is None:
                        result = self.router.route(req, explain=recording)
                    elif not self.admission.waits:
                        result = self.admission.route_now(req, recording)  # deadline admission alone
                    else:
                        # may wait for room on the chosen worker; the shed answer is a 429
                        result = await self.admission.route(req, context.time_remaining(), recording)
                    ex.request_id = req.request_id
                    ex.routed_at = self.router.clock.now()
                    endpoints = [result.worker.address]
                    alt = result.alternative
                    if alt is not None and alt.eligible and alt.address not in endpoints and (
                        not candidates or alt.id in candidates
                    ):
                        endpoints.append(alt.address)
                    destination = ",".join(endpoints[: self.settings.max_endpoints])
                    source, policy, reason = pk.source, result.decision.policy, result.decision.reason
                    pool, pd_reason = result.decision.pool, result.decision.pd_reason
                    if result.prefill_worker is not None:
                        ex.prefill = result.prefill_worker.address
                    if recording:
                        annotate_decision(span, result, self.router.block_size)
            except KVRouterError as exc:
                return self._reject(ex, exc, span), True
            ex.primary = destination.split(",", 1)[0]
            if recording:
                span.set_attributes({
                    "kvrouter.ext_proc.path": path,
                    "kvrouter.ext_proc.destination": destination,
                    "kvrouter.ext_proc.prefill": ex.prefill,
                    "kvrouter.ext_proc.key_source": source,
                    "kvrouter.ext_proc.body_bytes": len(body or b""),
                    "kvrouter.ext_proc.subset_size": -1 if ex.subset is None else len(ex.subset),
                })
        if self.metrics is not None:
            self.metrics.decisions.add(1, {"policy": policy, "reason": reason, "pool": pool})
            if pd_reason:
                self.metrics.pd_decisions.count(pd_reason)
            self.metrics.route_latency.record(time.perf_counter() - started, {"policy": policy})
        answer = [_destination_response(destination, len(body or b""), ex.prefill)]
        if body is None:
            return answer, False
        return chain(answer, _body_chunks(body, end_of_stream)), False

    # ---- response path ------------------------------------------------------------------
    def _on_response_headers(self, ex: _Exchange, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        now = self.router.clock.now()
        ex.response_headers_at = now
        headers = _header_map(msg.response_headers.headers)
        ex.status = parse_decimal(headers.get(":status", "")) or 0  # HTTP status: three ASCII digits
        value = _metadata_value(msg.metadata_context, DESTINATION_ENDPOINT_NAMESPACE, DESTINATION_ENDPOINT_SERVED_KEY)
        served = value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else ""
        ex.served = served or headers.get(DESTINATION_ENDPOINT_SERVED_KEY, "") or _upstream_address(msg)
        if ex.prefill:
            self._release_prefill(ex)
        if msg.response_headers.end_of_stream:
            ex.response_done_at = now
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse())

    def _on_response_body(self, ex: _Exchange, chunk: ep.HttpBody) -> ep.ProcessingResponse:
        now = self.router.clock.now()
        if chunk.body and not ex.first_chunk_at:
            ex.first_chunk_at = now
            if self.admission is not None and ex.request_id and ex.routed_at and (
                not ex.served or ex.served == ex.primary
            ):  # the first token: deadline admission learns its TTFT a decode before the end
                self.admission.on_first_token(Completion(ex.request_id, ttft_ms=(now - ex.arrived_at) * 1000.0))
        if chunk.end_of_stream:
            ex.response_done_at = now
        if not ex.response_body_full_duplex:
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        return ep.ProcessingResponse(
            response_body=ep.BodyResponse(
                response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(
                        streamed_response=ep.StreamedBodyResponse(body=chunk.body, end_of_stream=chunk.end_of_stream)
                    )
                )
            )
        )

    def _release_prefill(self, ex: _Exchange) -> None:
        """The decode pod answers after its sidecar ran the prefill: the prefill hop is done
        (its own time is not seen here: the headers come with the first decoded token)."""
        try:
            self.router.release_prefill(Completion(ex.request_id, prefill_done=True))
        except NotFound:
            log.debug("ext_proc prefill release for an unknown request", extra={"request_id": ex.request_id})
        ex.prefill = ""

    def _complete(self, ex: _Exchange) -> None:
        if not ex.request_id:
            return
        now = self.router.clock.now()
        observed = bool(ex.response_headers_at) and (not ex.served or ex.served == ex.primary)
        ttft_ms = e2e_ms = 0.0
        if observed:
            ttft_ms = ((ex.first_chunk_at or ex.response_headers_at) - ex.arrived_at) * 1000.0
            e2e_ms = ((ex.response_done_at or now) - ex.arrived_at) * 1000.0
        completion = Completion(
            request_id=ex.request_id,
            ttft_ms=max(0.0, ttft_ms),
            e2e_ms=max(0.0, e2e_ms),
            success=200 <= ex.status < 300,
        )
        routed = self.router.request(ex.request_id)
        try:
            entry = self.router.complete(completion)
            if self.admission is not None:
                self.admission.on_complete(entry.worker_id, completion)
            if self.metrics is not None:
                self.metrics.completed(entry, completion, routed.model if routed is not None else "", self.router.block_size)
        except NotFound:
            # already expired by the in-flight timeout, or its worker was removed
            log.debug("ext_proc completion for an unknown request", extra={"request_id": ex.request_id})
        except InvalidRequest as exc:  # pragma: no cover - the completion is built valid
            log.warning("ext_proc completion rejected: %s", exc)
        if ex.served and ex.served != ex.primary:
            log.info(
                "served by a fallback endpoint", extra={"request_id": ex.request_id, "primary": ex.primary, "served": ex.served}
            )
