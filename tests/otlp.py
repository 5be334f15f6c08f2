"""A real OTLP trace receiver on loopback, and the check that a daemon process exports its decision spans to it.

No OpenTelemetry Collector binary ships in a package this machine can install, so the receiver
is built on the official ``opentelemetry-proto`` definitions: the gRPC ``TraceService`` (the
Collector's port 4317) and ``POST /v1/traces`` with a protobuf body (its port 4318), each
decoding ``ExportTraceServiceRequest`` exactly as the Collector does.

:func:`check_daemon_exports_decision_spans` starts ``kvrouterd serve`` from the given executable
with only the standard ``OTEL_*`` variables pointing at the receiver, as the chart's
``otel.endpoint``/``otel.protocol`` do, sends Routes with a ``traceparent`` and one that is
rejected, and asserts what arrives. The integration test runs it on the checkout, the image
test on the Dockerfile's install.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@dataclass
class Span:
    """One received span, its attributes decoded to Python values."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    service_name: str


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Receiver:
    """Collects every span exported to it, over gRPC and over HTTP/protobuf."""

    spans: list[Span] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=lambda: {"grpc": 0, "http/protobuf": 0})
    grpc_port: int = 0
    http_port: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: otlp.ExportTraceServiceRequest, protocol: str) -> None:
        found = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                        s.status.code, s.status.message, {a.key: _value(a.value) for a in s.attributes},
                        resource.get("service.name", ""),
                    ))
        with self._lock:
            self.spans += found
            self.requests[protocol] += 1

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no matching span arrived within {timeout}s; got {[s.name for s in self.spans]}")


class _TraceService(otlp_grpc.TraceServiceServicer):
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    def Export(self, request: otlp.ExportTraceServiceRequest, context: grpc.ServicerContext) -> Any:
        self.receiver.add(request, "grpc")
        return otlp.ExportTraceServiceResponse()


def _http_handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404 if self.path != "/v1/traces" else 415)
                return
            receiver.add(otlp.ExportTraceServiceRequest.FromString(body), "http/protobuf")
            reply = otlp.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    return Handler


class running_receiver:
    """``with running_receiver() as r:`` serves both OTLP transports on loopback ports."""

    def __enter__(self) -> Receiver:
        self.receiver = Receiver()
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        otlp_grpc.add_TraceServiceServicer_to_server(_TraceService(self.receiver), self.grpc_server)
        self.receiver.grpc_port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        self.grpc_server.start()
        self.http_server = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(self.receiver))
        self.receiver.http_port = self.http_server.server_address[1]
        self.http_thread = threading.Thread(target=self.http_server.serve_forever, name="otlp-http", daemon=True)
        self.http_thread.start()
        return self.receiver

    def __exit__(self, *exc: object) -> None:
        self.http_server.shutdown()
        self.http_server.server_close()
        self.grpc_server.stop(0)


def otel_env(receiver: Receiver, protocol: str, per_signal: bool = False) -> dict[str, str]:
    """What the chart's ``otel.endpoint`` and ``otel.protocol`` set (``per_signal``: the traces-only names)."""
    endpoint = (f"http://127.0.0.1:{receiver.grpc_port}" if protocol == "grpc"
                else f"http://127.0.0.1:{receiver.http_port}")
    prefix = "OTEL_EXPORTER_OTLP_TRACES_" if per_signal else "OTEL_EXPORTER_OTLP_"
    # the per-signal endpoint is used as is, the general one gets /v1/traces appended (the spec's rule)
    if per_signal and protocol == "http/protobuf":
        endpoint += "/v1/traces"
    return {
        "OTEL_TRACES_EXPORTER": "otlp", f"{prefix}ENDPOINT": endpoint, f"{prefix}PROTOCOL": protocol,
        "OTEL_SERVICE_NAME": "kvrouterd-otlp-test", "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_daemon_exports_decision_spans(
    kvrouterd: list[str], env: dict[str, str], receiver: Receiver, protocol: str, cwd: Path | None = None,
) -> None:
    """Start ``kvrouterd serve`` as a process exporting to ``receiver``; Routes' spans must arrive there."""
    port = _free_port()
    env = {**env, "KVROUTERD_LOG_FORMAT": "json"}
    daemon = subprocess.Popen([*kvrouterd, "serve", "--listen", f"127.0.0.1:{port}"], env=env, cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert daemon.stderr is not None
        for line in daemon.stderr:  # the daemon says "serving" once it listens (or dies trying)
            if line.startswith("{") and json.loads(line).get("msg") == "serving":
                break
        else:
            raise AssertionError(f"kvrouterd serve exited {daemon.wait()} before serving")
        threading.Thread(target=daemon.stderr.read, daemon=True).start()  # never block on a full pipe
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.KVRouterStub(channel)
            stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="w1", address="10.0.0.1:8000")))
            meta = (("traceparent", TRACEPARENT),)
            chosen = stub.Route(pb.RouteRequest(token_ids=list(range(64)), model="llama-3-8b", request_id="r-1"),
                                metadata=meta)
            assert chosen.worker_id == "w1"
            try:
                stub.Route(pb.RouteRequest(token_ids=list(range(64)), candidate_workers=["gone"]), metadata=meta)
                raise AssertionError("a Route with only an unknown candidate was accepted")
            except grpc.RpcError as rejected:
                code, details = rejected.code(), rejected.details()  # type: ignore[attr-defined]

        decided = receiver.wait_for(lambda s: s.name == "kvrouter.route" and s.attributes.get("kvrouter.request_id")
                                    == "r-1")[0]
        server = receiver.wait_for(lambda s: s.span_id == decided.parent_span_id)[0]
        assert decided.trace_id == TRACE_ID == server.trace_id
        assert server.name == "kvrouter.v1.KVRouter/Route" and server.parent_span_id == PARENT_SPAN_ID
        assert server.attributes["rpc.grpc.status_code"] == 0
        assert decided.attributes["kvrouter.chosen.worker_id"] == "w1"
        assert decided.attributes["kvrouter.candidates.id"] == ["w1"]
        assert decided.attributes["gen_ai.request.model"] == "llama-3-8b"
        assert decided.attributes["kvrouter.prompt_tokens"] == 64
        assert decided.service_name == "kvrouterd-otlp-test"
        # the rejected decision says what the client was told, not how the abort left the handler
        failed = receiver.wait_for(lambda s: s.name == "kvrouter.route" and s.status_code
                                   == trace_pb2.Status.STATUS_CODE_ERROR)[0]
        assert failed.status_message == details
        assert failed.attributes["rpc.grpc.status_code"] == code.value[0]
        assert receiver.requests[protocol] > 0 and sum(receiver.requests.values()) == receiver.requests[protocol]
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def clean_env() -> dict[str, str]:
    """The environment without any OTEL_* or KVROUTERD_* setting of the caller's."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVROUTERD_"))}
