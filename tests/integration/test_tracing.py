"""Standard tracing: a SERVER span per RPC with rpc.* attributes, continuing the caller's W3C
trace context from gRPC metadata; kvrouter.route is its child; environment names win."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError
from kvrouterd.server.app import Daemon
from kvrouterd.telemetry.tracing import UNTRACED_SERVICES, build_tracer_provider, service_name, untraced_services

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


async def server_spans(running, count: int = 1):
    """The server's spans: an aborted call's status reaches the client before its span ends."""
    for _ in range(200):
        found = [s for s in running.spans.get_finished_spans() if s.kind is SpanKind.SERVER]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.005)
    raise AssertionError(f"{count} server spans never finished: {running.spans.get_finished_spans()}")


async def test_traceparent_in_metadata_is_the_parent_of_the_rpc_and_route_spans(running):
    await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="10.0.0.1:8000")))
    running.spans.clear()
    await running.stub.Route(
        pb.RouteRequest(token_ids=list(range(64)), model="llama-3-8b"),
        metadata=(("traceparent", TRACEPARENT), ("tracestate", "gw=1")),
    )
    spans = {s.name: s for s in running.spans.get_finished_spans()}
    rpc = spans["kvrouter.v1.KVRouter/Route"]
    route = spans["kvrouter.route"]
    assert rpc.kind is SpanKind.SERVER
    assert format(rpc.context.trace_id, "032x") == TRACE_ID
    assert format(rpc.parent.span_id, "016x") == PARENT_SPAN_ID and rpc.parent.is_remote
    assert rpc.context.trace_state.get("gw") == "1"
    assert route.parent.span_id == rpc.context.span_id and route.context.trace_id == rpc.context.trace_id
    assert dict(rpc.attributes) == {
        "rpc.system": "grpc", "rpc.service": "kvrouter.v1.KVRouter", "rpc.method": "Route",
        "rpc.grpc.status_code": 0, "network.peer.address": "127.0.0.1",
        "network.peer.port": rpc.attributes["network.peer.port"],
    }
    assert route.attributes["gen_ai.request.model"] == "llama-3-8b"
    assert route.attributes["kvrouter.prompt_tokens"] == 64 == route.attributes["gen_ai.usage.input_tokens"]


async def test_without_traceparent_the_rpc_span_is_a_root_and_errors_carry_the_grpc_code(running):
    running.spans.clear()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(pb.RouteRequest(token_ids=list(range(64))))  # no workers
    code = err.value.code()
    (rpc,) = await server_spans(running)
    assert rpc.parent is None
    assert rpc.attributes["rpc.grpc.status_code"] == code.value[0] != 0
    assert rpc.status.status_code is StatusCode.ERROR and rpc.status.description == err.value.details()


async def test_every_rpc_gets_a_server_span_streams_too(running):
    running.spans.clear()
    await running.stub.ListWorkers(pb.ListWorkersRequest(), metadata=(("traceparent", TRACEPARENT),))

    async def messages():
        yield pb.RouteStreamRequest(route=pb.RouteRequest(token_ids=list(range(32))))

    async for _ in running.stub.RouteStream(messages(), metadata=(("traceparent", TRACEPARENT),)):
        pass
    names = {s.name: s for s in running.spans.get_finished_spans()}
    assert {"kvrouter.v1.KVRouter/ListWorkers", "kvrouter.v1.KVRouter/RouteStream"} <= set(names)
    assert all(format(names[n].context.trace_id, "032x") == TRACE_ID
               for n in ("kvrouter.v1.KVRouter/ListWorkers", "kvrouter.v1.KVRouter/RouteStream"))


async def test_no_interceptor_when_tracing_is_off(monkeypatch):
    from kvrouterd.server import app

    def refuse(tracer):  # pragma: no cover - failing is the point
        raise AssertionError("ServerSpans installed with tracing off")

    monkeypatch.setattr(app, "ServerSpans", refuse)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0"}))
    port = await daemon.start()
    try:
        assert daemon.tracer is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

            stub = router_pb2_grpc.KVRouterStub(channel)
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="10.0.0.1:8000")))
            assert (await stub.Route(pb.RouteRequest(token_ids=list(range(32))))).worker_id == "a"
    finally:
        await daemon.stop(0)


def test_otel_service_name_wins_over_the_config(monkeypatch):
    assert service_name("kvrouterd", {"OTEL_SERVICE_NAME": "router-eu"}) == "router-eu"
    assert service_name("kvrouterd", {}) == "kvrouterd"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-eu")
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0"}), span_exporter=InMemorySpanExporter())
    assert daemon.tracer_provider.resource.attributes["service.name"] == "router-eu"


def test_unknown_traces_exporter_is_a_config_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin_typo")
    with pytest.raises(ConfigError, match="^OTEL_TRACES_EXPORTER: unknown traces exporter 'zipkin_typo'"):
        build_tracer_provider("kvrouterd", "none")


async def test_a_rejected_route_span_carries_the_status_the_client_got(running):
    running.spans.clear()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(pb.RouteRequest(token_ids=list(range(64))))  # no workers
    await server_spans(running)
    (route,) = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
    assert route.status.status_code is StatusCode.ERROR and route.status.description == err.value.details()
    assert route.attributes["rpc.grpc.status_code"] == err.value.code().value[0]


async def test_health_checks_and_reflection_get_no_span(running):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    running.spans.clear()
    await health_pb2_grpc.HealthStub(running.channel).Check(health_pb2.HealthCheckRequest())
    reflection = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    async for _ in reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
        pass
    await running.stub.ListWorkers(pb.ListWorkersRequest())
    await server_spans(running)
    assert [s.name for s in running.spans.get_finished_spans()] == ["kvrouter.v1.KVRouter/ListWorkers"]


def test_excluded_services_follow_the_instrumentation_variable():
    assert untraced_services({}) == set(UNTRACED_SERVICES)
    assert untraced_services({"OTEL_PYTHON_GRPC_EXCLUDED_SERVICES": ""}) == set()
    assert untraced_services({"OTEL_PYTHON_GRPC_EXCLUDED_SERVICES": " a.B , c.D"}) == {"a.B", "c.D"}


async def test_a_traced_route_over_a_big_fleet_lists_the_chosen_and_the_deepest_holders(running):
    """Every candidate of 1,024 in the span made a traced Route + Complete cost 2.8 ms."""
    from .test_daemon import BS, publish, register, stored

    for i in range(40):
        await register(running.stub, f"w{i}")
    tokens = list(range(8 * BS))
    for i in (5, 17, 30):  # three workers hold the prompt's first blocks
        blocks = i % 4 + 1
        await publish(running.stub, pb.EventBatch(worker_id=f"w{i}", sequence=0,
                                                  events=[stored(tokens[: blocks * BS], list(range(1, blocks + 1)))]))
    running.spans.clear()
    answer = await running.stub.Route(pb.RouteRequest(token_ids=tokens))
    route = {s.name: s for s in running.spans.get_finished_spans()}["kvrouter.route"]
    listed = list(route.attributes["kvrouter.candidates.id"])
    assert route.attributes["kvrouter.candidates.count"] == 40
    assert route.attributes["kvrouter.candidates.listed"] == len(listed) == 16
    assert answer.worker_id in listed and {"w5", "w17", "w30"} <= set(listed)
    assert len(route.attributes["kvrouter.candidates.overlap_blocks"]) == 16
