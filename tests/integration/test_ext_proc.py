"""The ext_proc endpoint picker over real grpc.aio, driven with the real Envoy protos as Envoy does.

Each test plays Envoy's side of one HTTP request: request headers (with the subset hint in
``metadata_context`` when set), body chunks in FULL_DUPLEX_STREAMED mode, then the response
headers (with ``envoy.lb`` / ``x-gateway-destination-endpoint-served``) and body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest
from kvrouterd._generated.envoy.config.core.v3 import base_pb2
from kvrouterd._generated.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from kvrouterd._generated.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvrouterd._generated.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError
from kvrouterd.index.keys import block_keys
from kvrouterd.server.app import Daemon
from kvrouterd.server.ext_proc import BODY_CHUNK_BYTES, EXT_PROC_SERVICE

BS = 16
WORKERS = [
    {"id": "a", "address": "10.0.0.1:8000", "mode": "approximate"},
    {"id": "b", "address": "10.0.0.2:8000", "mode": "approximate"},
    {"id": "c", "address": "10.0.0.3:8000", "mode": "events"},
]


class Envoy:
    """One daemon with a manual clock, and helpers to speak ext_proc to it like Envoy."""

    def __init__(self, daemon: Daemon, channel: grpc.aio.Channel, clock: ManualClock, spans: InMemorySpanExporter):
        self.daemon = daemon
        self.router = daemon.router
        self.channel = channel
        self.stub = ep_grpc.ExternalProcessorStub(channel)
        self.clock = clock
        self.spans = spans

    def open(self) -> Stream:
        return Stream(self.stub)


class Stream:
    """A Process stream where the test sends one message and reads the answers it expects."""

    def __init__(self, stub: ep_grpc.ExternalProcessorStub) -> None:
        self.queue: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            while (msg := await self.queue.get()) is not None:
                yield msg

        self.call = stub.Process(requests())

    async def send(self, msg: ep.ProcessingRequest, expect: int = 0) -> list[ep.ProcessingResponse]:
        await self.queue.put(msg)
        return [await asyncio.wait_for(self.call.read(), 5) for _ in range(expect)]

    async def close(self) -> None:
        await self.queue.put(None)
        assert await asyncio.wait_for(self.call.read(), 5) is grpc.aio.EOF


def headers_msg(path: str, *, eos: bool = False, subset: list[str] | str | None = None, extra=(), method="POST"):
    hs = [(":method", method), (":path", path), (":authority", "gw"), ("content-type", "application/json"), *extra]
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
            end_of_stream=eos,
        )
    )
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return msg


def body_msg(chunk: bytes, eos: bool):
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=eos))


def response_headers_msg(status: int = 200, served: str | None = None, served_header: str | None = None):
    hs = [(":status", str(status))]
    if served_header is not None:
        hs.append(("x-gateway-destination-endpoint-served", served_header))
    msg = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])
        )
    )
    if served is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-served": served})
        msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
    return msg


def chat_body(text: str, model: str = "m") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "stream": True}).encode()


def destination(resp: ep.ProcessingResponse) -> tuple[str, str]:
    """(header value, dynamic metadata value) of a request-headers answer."""
    assert resp.WhichOneof("response") == "request_headers"
    common = resp.request_headers.response
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    md = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
    return headers["x-gateway-destination-endpoint"], md


def streamed(resps: list[ep.ProcessingResponse]) -> tuple[bytes, list[int], bool]:
    """Body bytes echoed, chunk sizes, and whether the last chunk ends the stream."""
    chunks = [r.request_body.response.body_mutation.streamed_response for r in resps]
    return b"".join(c.body for c in chunks), [len(c.body) for c in chunks], chunks[-1].end_of_stream


def immediate_status(resps: list[ep.ProcessingResponse]) -> int:
    assert len(resps) == 1 and resps[0].WhichOneof("response") == "immediate_response"
    return resps[0].immediate_response.status.code


@pytest.fixture
def ext_config() -> dict:
    return {}


@pytest.fixture
def worker_list() -> list[dict]:
    return WORKERS


@pytest.fixture
def daemon_extra() -> dict:
    return {}


@pytest.fixture
async def envoy(ext_config: dict, worker_list: list[dict], daemon_extra: dict) -> AsyncIterator[Envoy]:
    clock = ManualClock(100.0)
    spans = InMemorySpanExporter()
    cfg = parse_config({"listen": "127.0.0.1:0", "workers": worker_list, "ext_proc": ext_config, **daemon_extra})
    daemon = Daemon(cfg, clock=clock, span_exporter=spans, seed=3)
    port = await daemon.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Envoy(daemon, channel, clock, spans)
    finally:
        await channel.close()
        await daemon.stop(grace=0.5)


async def route_chat(envoy: Envoy, text: str, **headers_kw) -> tuple[Stream, str, str]:
    s = envoy.open()
    assert await s.send(headers_msg("/v1/chat/completions", **headers_kw)) == []
    body = chat_body(text)
    replies = await s.send(body_msg(body, True), expect=2)
    header, md = destination(replies[0])
    assert streamed(replies[1:]) == (body, [len(body)], True)
    return s, header, md


# ---- the happy path ----------------------------------------------------------------------

async def test_health_reports_the_ext_proc_service(envoy):
    health = health_pb2_grpc.HealthStub(envoy.channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
    assert EXT_PROC_SERVICE == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("service", ["liveness", "readiness", ""])
async def test_health_answers_the_endpoint_picker_protocol_probes(envoy, service):
    """The GIE endpoint-picker protocol probes gRPC health for "liveness" and "readiness"."""
    health = health_pb2_grpc.HealthStub(envoy.channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_chunked_body_is_routed_then_streamed_back_unchanged_in_62kb_chunks(envoy):
    s = envoy.open()
    assert await s.send(headers_msg("/v1/chat/completions", extra=[("x-request-id", "req-1")])) == []
    body = chat_body("long document " * 12_000)  # ~170 KB: three upstream chunks, three echoed
    pieces = [body[:50_000], body[50_000:120_000], body[120_000:]]
    assert await s.send(body_msg(pieces[0], False)) == []
    assert await s.send(body_msg(pieces[1], False)) == []
    replies = await s.send(body_msg(pieces[2], True), expect=1 + -(-len(body) // BODY_CHUNK_BYTES))
    header, md = destination(replies[0])
    assert header == md and header.split(",")[0] in {w["address"] for w in WORKERS}
    common = replies[0].request_headers.response
    assert common.clear_route_cache
    sent = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert sent["content-length"] == str(len(body))
    echoed, sizes, eos = streamed(replies[1:])
    assert echoed == body and eos and max(sizes) <= BODY_CHUNK_BYTES and sizes[0] == BODY_CHUNK_BYTES
    # the router committed the request under Envoy's request id
    assert envoy.router.request("req-1") is not None
    await s.close()


async def test_same_prefix_lands_on_the_same_worker_and_fallback_is_listed(envoy):
    first_stream, first, _ = await route_chat(envoy, "shared system prompt " * 40 + "question one")
    second_stream, second, md = await route_chat(envoy, "shared system prompt " * 40 + "question two")
    assert second.split(",")[0] == first.split(",")[0]
    endpoints = second.split(",")
    assert len(endpoints) <= 2 and len(set(endpoints)) == len(endpoints) and md == second
    for s in (first_stream, second_stream):
        await s.close()


async def test_span_per_decision_carries_the_decision(envoy):
    s, header, _ = await route_chat(envoy, "hello " * 100)
    await s.close()
    spans = [sp for sp in envoy.spans.get_finished_spans() if sp.name == "kvrouter.ext_proc.route"]
    assert len(spans) == 1
    attrs = spans[0].attributes
    assert attrs["kvrouter.ext_proc.destination"] == header
    assert attrs["kvrouter.chosen.address"] == header.split(",")[0]
    assert attrs["kvrouter.ext_proc.key_source"] == "text"
    assert attrs["kvrouter.ext_proc.path"] == "/v1/chat/completions"
    assert attrs["kvrouter.prompt_blocks"] > 0


async def test_response_path_completes_with_timings_from_routing(envoy):
    s, header, _ = await route_chat(envoy, "hi " * 200, extra=[("x-request-id", "r-t")])
    chosen = header.split(",")[0]
    worker = next(w for w in envoy.router.workers if w.address == chosen)
    assert worker.inflight_requests == 1
    seen = []
    complete = envoy.router.complete
    envoy.router.complete = lambda c: (seen.append(c), complete(c))[1]  # type: ignore[method-assign]
    envoy.clock.advance(0.25)
    replies = await s.send(response_headers_msg(200, served=chosen), expect=1)
    assert replies[0].WhichOneof("response") == "response_headers"
    envoy.clock.advance(0.05)
    body_replies = await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: {}\n\n")), expect=1)
    assert body_replies[0].response_body.response.body_mutation.streamed_response.body == b"data: {}\n\n"
    envoy.clock.advance(1.0)
    await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)), expect=1)
    await s.close()
    await asyncio.sleep(0.05)
    (c,) = seen
    assert c.request_id == "r-t" and c.success
    assert c.ttft_ms == pytest.approx(300.0) and c.e2e_ms == pytest.approx(1300.0)
    assert worker.inflight_requests == 0


@pytest.mark.parametrize("daemon_extra", [
    {"admission": {"deadline": "shed", "latency": {"prefill_ms_per_1k_tokens": 1000.0, "calibrate": False}}}])
async def test_the_first_response_chunk_teaches_deadline_admission_its_ttft(envoy, monkeypatch):
    """The first streamed chunk is the first token: deadline admission learns the TTFT then,
    a whole decode before the stream ends."""
    s, header, _ = await route_chat(envoy, "hi " * 400, extra=[("x-request-id", "r-first")])
    learned = []
    # on the class: a guard keeps its attributes in __slots__, none of its own to replace
    monkeypatch.setattr(type(envoy.daemon.admission.guard), "on_first_token",
                        lambda self, rid, ttft, now: learned.append((rid, ttft)))
    envoy.clock.advance(0.4)
    await s.send(response_headers_msg(200, served=header.split(",")[0]), expect=1)
    await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: {}\n\n")), expect=1)
    assert learned == [("r-first", pytest.approx(400.0))]
    await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: {}\n\n")), expect=1)
    assert len(learned) == 1 and envoy.router.request("r-first") is not None
    await s.close()


@pytest.mark.parametrize("where", ["metadata", "header", "attribute"])
async def test_served_by_fallback_releases_load_without_timings(envoy, where):
    s, header, _ = await route_chat(envoy, "x " * 300)
    chosen = header.split(",")[0]
    other = next(w["address"] for w in WORKERS if w["address"] != chosen)
    seen = []
    complete = envoy.router.complete
    envoy.router.complete = lambda c: (seen.append(c), complete(c))[1]  # type: ignore[method-assign]
    envoy.clock.advance(0.5)
    if where == "metadata":
        msg = response_headers_msg(200, served=other)
    elif where == "header":
        msg = response_headers_msg(200, served_header=other)
    else:  # plain Envoy with response_attributes: [upstream.address]
        msg = response_headers_msg(200)
        msg.attributes["envoy.filters.http.ext_proc"].update({"upstream.address": other})
    await s.send(msg, expect=1)
    await s.close()
    await asyncio.sleep(0.05)
    (c,) = seen
    assert c.ttft_ms == 0.0 and c.e2e_ms == 0.0 and c.success
    assert all(w.inflight_requests == 0 for w in envoy.router.workers)


async def test_cancelled_stream_still_releases_load(envoy):
    s, _, _ = await route_chat(envoy, "y " * 300)
    assert sum(w.inflight_requests for w in envoy.router.workers) == 1
    s.call.cancel()
    for _ in range(100):
        if sum(w.inflight_requests for w in envoy.router.workers) == 0:
            break
        await asyncio.sleep(0.01)
    assert sum(w.inflight_requests for w in envoy.router.workers) == 0


async def test_upstream_error_status_completes_unsuccessfully(envoy):
    s, header, _ = await route_chat(envoy, "z " * 300)
    seen = []
    complete = envoy.router.complete
    envoy.router.complete = lambda c: (seen.append(c), complete(c))[1]  # type: ignore[method-assign]
    await s.send(response_headers_msg(500, served=header.split(",")[0]), expect=1)
    await s.close()
    await asyncio.sleep(0.05)
    assert len(seen) == 1 and not seen[0].success


async def test_request_trailers_end_the_body(envoy):
    s = envoy.open()
    await s.send(headers_msg("/v1/completions"))
    body = json.dumps({"model": "m", "prompt": "once upon a time " * 20}).encode()
    assert await s.send(body_msg(body, False)) == []
    replies = await s.send(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()), expect=3)
    assert destination(replies[0])[0]
    echoed, _, eos = streamed(replies[1:2])
    assert echoed == body and not eos  # the stream ends with the trailers, not the body
    assert replies[2].WhichOneof("response") == "request_trailers"
    await s.close()


async def test_completions_token_ids_key_like_the_route_rpc(envoy):
    tokens = list(range(5000, 5000 + 8 * BS))
    s = envoy.open()
    await s.send(headers_msg("/v1/completions", extra=[("x-request-id", "tok")]))
    await s.send(body_msg(json.dumps({"model": "m", "prompt": tokens}).encode(), True), expect=2)
    req = envoy.router.request("tok")
    assert list(req.keys) == block_keys(tokens, BS, model="m") and req.prompt_tokens == len(tokens) and req.model == "m"
    await s.close()


async def test_headers_only_request_goes_to_the_least_loaded_worker_without_commit(envoy):
    s1, busy, _ = await route_chat(envoy, "keep me busy " * 50)
    s = envoy.open()
    replies = await s.send(headers_msg("/v1/models", eos=True, method="GET"), expect=1)
    header, md = destination(replies[0])
    assert header == md and header != busy.split(",")[0] and "," not in header
    assert sum(w.inflight_requests for w in envoy.router.workers) == 1
    for stream in (s, s1):
        await stream.close()


async def test_other_paths_with_a_body_pass_through_to_any_worker(envoy):
    s = envoy.open()
    await s.send(headers_msg("/v1/embeddings"))
    body = b"not even json"
    replies = await s.send(body_msg(body, True), expect=2)
    assert destination(replies[0])[0] in {w["address"] for w in WORKERS}
    assert streamed(replies[1:])[0] == body
    await s.close()


# ---- the subset hint -----------------------------------------------------------------------

async def test_subset_hint_restricts_the_pick(envoy):
    for _ in range(4):
        s, header, md = await route_chat(envoy, "subset " * 100, subset=["10.0.0.2:8000"])
        assert header == md == "10.0.0.2:8000"  # the only one allowed, and no fallback outside it
        await s.close()


async def test_subset_hint_as_comma_separated_string(envoy):
    s, header, _ = await route_chat(envoy, "subset " * 100, subset="10.0.0.3:8000, 10.0.0.9:1")
    assert header == "10.0.0.3:8000"
    await s.close()


@pytest.mark.parametrize(
    ("subset", "allowed"),
    [
        (["10.0.0.2"], {"10.0.0.2:8000"}),  # a bare IP: any port on that host
        (["10.0.0.2:8000,10.0.0.3:8000"], {"10.0.0.2:8000", "10.0.0.3:8000"}),  # an element holding a list
        (["10.0.0.9:1, 10.0.0.3", "10.0.0.1:9"], {"10.0.0.3:8000"}),
    ],
)
async def test_subset_hint_in_the_reference_pickers_other_forms(envoy, subset, allowed):
    for _ in range(4):
        s, header, _ = await route_chat(envoy, "forms " * 100, subset=subset)
        assert header in allowed
        await s.close()


@pytest.mark.parametrize("mode", [processing_mode_pb2.ProcessingMode.BUFFERED, processing_mode_pb2.ProcessingMode.STREAMED])
async def test_buffered_or_streamed_request_bodies_are_refused_with_a_clear_error(envoy, mode):
    s = envoy.open()
    msg = headers_msg("/v1/chat/completions")
    msg.protocol_config.request_body_mode = mode
    replies = await s.send(msg, expect=1)
    assert immediate_status(replies) == 500
    body = replies[0].immediate_response.body.decode()
    assert processing_mode_pb2.ProcessingMode.BodySendMode.Name(mode) in body and "FULL_DUPLEX_STREAMED" in body
    assert await asyncio.wait_for(s.call.read(), 5) is grpc.aio.EOF


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:8000"]])
async def test_subset_hint_with_no_eligible_worker_is_503(envoy, subset):
    """An address no worker has is 503, not a Route's NOT_FOUND (issue #29 item 10): the proxy
    lists the pool's ready pods, and one the router does not know has not registered yet."""
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions", subset=subset))
    assert immediate_status(await s.send(body_msg(chat_body("hello"), True), expect=1)) == 503
    assert await asyncio.wait_for(s.call.read(), 5) is grpc.aio.EOF


async def test_a_subset_hint_sent_again_follows_the_fleet_as_it_changes(envoy):
    """The hint is read once for the requests that send it again (a gateway lists the pool's
    pods with every request); the workers it allows are read again when membership changes."""
    from kvrouterd.index.workers import WorkerSpec
    from kvrouterd.protocols import CacheMode

    hint = ["10.0.0.2:8000", "10.0.0.3:8000"]
    s, header, _ = await route_chat(envoy, "again " * 100, subset=hint)
    assert header in hint
    await s.close()
    envoy.router.set_draining("b", True)
    for _ in range(3):
        s, header, _ = await route_chat(envoy, "again " * 100, subset=hint)
        assert header == "10.0.0.3:8000"
        await s.close()
    envoy.router.set_draining("b", False)
    ext = envoy.daemon.ext_proc
    value = headers_msg("/", subset=hint).metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
        "x-gateway-destination-endpoint-subset"]
    assert ext._candidates(SimpleNamespace(subset=ext._subset(value))) == ("b", "c")
    envoy.router.add_worker(WorkerSpec("c", "10.0.0.7:8000", mode=CacheMode.EVENTS))  # c moved off the hint
    assert ext._candidates(SimpleNamespace(subset=ext._subset(value))) == ("b",)
    s, header, _ = await route_chat(envoy, "again " * 100, subset=hint)
    assert header == "10.0.0.2:8000"
    await s.close()
    envoy.router.set_draining("b", True)  # nothing the hint names is eligible now
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions", subset=hint))
    assert immediate_status(await s.send(body_msg(chat_body("again " * 100), True), expect=1)) == 503


async def test_a_subset_hint_naming_every_worker_routes_as_no_hint_does(envoy):
    every = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    first, header, _ = await route_chat(envoy, "whole fleet " * 80, subset=every)
    await first.close()
    for _ in range(3):  # the prompt's cache, modelled where it was sent, draws it back
        s, again, _ = await route_chat(envoy, "whole fleet " * 80, subset=every)
        assert again == header
        await s.close()
    assert envoy.daemon.ext_proc._candidates(SimpleNamespace(subset=tuple(every))) == ()


async def test_subset_hint_on_a_headers_only_request_is_honoured(envoy):
    s = envoy.open()
    replies = await s.send(headers_msg("/health", eos=True, method="GET", subset=["10.0.0.1:8000"]), expect=1)
    assert destination(replies[0])[0] == "10.0.0.1:8000"
    await s.close()


# ---- error paths ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", b""),
        ("/v1/chat/completions", json.dumps({"model": "m"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"content": "no role"}]}).encode()),
        ("/v1/completions", json.dumps({"model": "m"}).encode()),
        ("/v1/completions", json.dumps({"model": 7, "prompt": "x"}).encode()),
        ("/v1/completions", json.dumps({"model": "m", "prompt": [1, -2]}).encode()),
    ],
)
async def test_malformed_body_is_400_and_changes_nothing(envoy, path, body):
    s = envoy.open()
    await s.send(headers_msg(path))
    replies = await s.send(body_msg(body, True), expect=1)
    assert immediate_status(replies) == 400
    assert b"kvrouterd:" in replies[0].immediate_response.body
    assert envoy.router.counters["decisions"] == 0
    assert sum(w.inflight_requests for w in envoy.router.workers) == 0
    assert await asyncio.wait_for(s.call.read(), 5) is grpc.aio.EOF


@pytest.mark.parametrize("worker_list", [[]])
async def test_no_worker_is_503(envoy):
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions"))
    assert immediate_status(await s.send(body_msg(chat_body("hello"), True), expect=1)) == 503
    s2 = envoy.open()
    assert immediate_status(await s2.send(headers_msg("/v1/models", eos=True, method="GET"), expect=1)) == 503


async def test_all_workers_draining_is_503(envoy):
    for w in list(envoy.router.workers):
        envoy.router.set_draining(w.id, True)
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions"))
    assert immediate_status(await s.send(body_msg(chat_body("hello"), True), expect=1)) == 503


@pytest.mark.parametrize("ext_config", [{"max_body_bytes": 1000}])
async def test_body_over_the_limit_is_shed_with_429(envoy):
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions"))
    assert await s.send(body_msg(b"x" * 600, False)) == []
    assert immediate_status(await s.send(body_msg(b"x" * 600, False), expect=1)) == 429


async def test_prompt_over_max_prompt_tokens_is_shed_with_429(envoy):
    envoy.router.settings = dataclasses.replace(envoy.router.settings, max_prompt_tokens=100)
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions"))
    assert immediate_status(await s.send(body_msg(chat_body("word " * 200), True), expect=1)) == 429
    assert sum(w.inflight_requests for w in envoy.router.workers) == 0


@pytest.mark.parametrize("ext_config", [{"max_endpoints": 1}])
async def test_max_endpoints_one_sends_a_single_address(envoy):
    for i in range(5):
        s, header, md = await route_chat(envoy, f"single {i} " * 80)
        assert "," not in header and header == md
        await s.close()


@pytest.mark.parametrize("ext_config", [{"enabled": False}])
async def test_disabled_ext_proc_is_not_served(envoy):
    # No message is sent: the server refuses the method as the call opens, and a message the client
    # writes into that refusal races it (the client's failed write surfaces as INTERNAL instead).
    s = envoy.open()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(s.call.read(), 5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def headers_announcing(response_body_mode: int) -> ep.ProcessingRequest:
    """A chat request's headers with Envoy's protocol_config: request bodies full duplex, response
    bodies in ``response_body_mode``."""
    first = headers_msg("/v1/chat/completions")
    first.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = response_body_mode
    return first


async def test_response_body_with_another_mode_is_passed_without_mutation(envoy):
    s = envoy.open()
    await s.send(headers_announcing(processing_mode_pb2.ProcessingMode.STREAMED))
    await s.send(body_msg(chat_body("mode"), True), expect=2)
    (reply,) = await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"abc")), expect=1)
    assert reply.WhichOneof("response") == "response_body"
    assert not reply.response_body.response.HasField("body_mutation")
    await s.close()


def test_missing_tokenizer_file_fails_config():
    with pytest.raises(ConfigError, match="ext_proc.tokenizer"):
        parse_config({"ext_proc": {"tokenizer": "/nonexistent/tokenizer.json"}})


@pytest.mark.parametrize("bad", [{"max_endpoints": 0}, {"max_body_bytes": 0}])
def test_bad_ext_proc_settings_fail_config(bad):
    with pytest.raises(ConfigError, match=f"ext_proc.{next(iter(bad))}"):
        parse_config({"ext_proc": bad})


async def test_invalid_tokenizer_file_fails_start(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "ext_proc": {"tokenizer": str(path)}}))
    with pytest.raises(ConfigError, match="ext_proc.tokenizer"):
        await daemon.start()


# ---- admission queue mode ------------------------------------------------------------------

ONE = ["10.0.0.1:8000"]


@pytest.mark.parametrize("daemon_extra", [{"admission": {"max_inflight": 1, "max_wait_s": 5.0}}])
async def test_admission_queue_holds_the_request_until_the_worker_completes_one(envoy):
    first, header, _ = await route_chat(envoy, "first " * 50, subset=ONE)
    assert header == ONE[0]
    second = envoy.open()
    await second.send(headers_msg("/v1/chat/completions", subset=ONE))
    await second.queue.put(body_msg(chat_body("second " * 50), True))
    pending = asyncio.ensure_future(second.call.read())
    await asyncio.sleep(0.2)
    assert not pending.done()  # waiting in the worker's queue: no answer to Envoy yet
    await first.send(response_headers_msg(200, served=ONE[0]), expect=1)
    await first.close()  # the first request completes, which admits the second
    reply = await asyncio.wait_for(pending, 5)
    assert destination(reply)[0] == ONE[0]
    echo = await asyncio.wait_for(second.call.read(), 5)
    assert echo.request_body.response.body_mutation.streamed_response.end_of_stream
    await second.close()


@pytest.mark.parametrize("daemon_extra", [{"admission": {"max_inflight": 1, "max_wait_s": 0.2}}])
async def test_admission_queue_timeout_is_shed_with_429(envoy):
    first, _, _ = await route_chat(envoy, "first " * 50, subset=ONE)
    second = envoy.open()
    await second.send(headers_msg("/v1/chat/completions", subset=ONE))
    assert immediate_status(await second.send(body_msg(chat_body("second " * 50), True), expect=1)) == 429
    await first.close()


@pytest.mark.parametrize("daemon_extra", [
    {"admission": {"deadline": "shed", "latency": {"prefill_ms_per_1k_tokens": 1000.0, "calibrate": False}}}])
async def test_x_slo_ttft_ms_header_is_the_requests_deadline(envoy):
    """llm-d's ``x-slo-ttft-ms`` declares the request's TTFT objective: deadline admission
    refuses it with 429 when no worker can meet it; without the header the request is
    steered by the default SLO but not refused; a malformed value is 400."""
    first, _, _ = await route_chat(envoy, "first " * 50, subset=ONE)  # work queued ahead on ONE
    tight = envoy.open()
    await tight.send(headers_msg("/v1/chat/completions", subset=ONE, extra=[("x-slo-ttft-ms", "1")]))
    assert immediate_status(await tight.send(body_msg(chat_body("second " * 50), True), expect=1)) == 429
    undeclared, header, _ = await route_chat(envoy, "third " * 50, subset=ONE)
    assert header == ONE[0]
    for bad in ("soon", "nan", "-5"):
        s = envoy.open()
        await s.send(headers_msg("/v1/chat/completions", subset=ONE, extra=[("x-slo-ttft-ms", bad)]))
        assert immediate_status(await s.send(body_msg(chat_body("fourth " * 50), True), expect=1)) == 400, bad
    assert envoy.daemon.admission.guard.shed == 1
    await first.close()
    await undeclared.close()


POOLED = [{"id": "a", "address": "10.0.1.1:8000", "models": ["A"]},
          {"id": "b", "address": "10.0.1.2:8000", "models": ["B"], "loras": ["sql-lora"]}]


@pytest.mark.parametrize("worker_list", [POOLED])
async def test_a_body_goes_to_its_models_pool_and_a_model_nobody_serves_is_404(envoy):
    """Issue #31 item 1: the body's ``model`` picks the pool; naming an adapter asks for it."""
    for model, address in (("B", "10.0.1.2:8000"), ("A", "10.0.1.1:8000"), ("sql-lora", "10.0.1.2:8000")):
        s = envoy.open()
        await s.send(headers_msg("/v1/chat/completions"))
        replies = await s.send(body_msg(chat_body("hello", model), True), expect=2)
        assert destination(replies[0])[0] == address
        await s.close()
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions"))
    replies = await s.send(body_msg(chat_body("hello", "C"), True), expect=1)
    assert immediate_status(replies) == 404 and "'C'" in replies[0].immediate_response.body.decode()


@pytest.mark.parametrize("worker_list", [POOLED])
async def test_a_request_without_a_prompt_keeps_to_its_models_pool_and_an_unknown_model_is_404(envoy):
    """Issue #31 item 1 for requests routed without a prompt: a GET's model comes from the
    inference extension's ``x-gateway-model-name`` header, another path's from its body's
    ``model``; a model nobody serves is the 404 a prompt gets. Nothing is committed."""

    async def get(model: str | None) -> ep.ProcessingResponse:
        extra = [] if model is None else [("x-gateway-model-name", model)]
        s = envoy.open()
        replies = await s.send(headers_msg("/v1/models", eos=True, method="GET", extra=extra), expect=1)
        await s.close()
        return replies[0]

    async def embed(model: str) -> ep.ProcessingResponse:
        s = envoy.open()
        await s.send(headers_msg("/v1/embeddings"))
        body = json.dumps({"model": model, "input": "hello"}).encode()
        replies = await s.send(body_msg(body, True), expect=2 if model != "C" else 1)
        await s.close()
        return replies[0]

    # without a model either worker may take it: the least loaded, the first registered on a tie
    assert destination(await get(None))[0] == "10.0.1.1:8000"
    for model, address in (("B", "10.0.1.2:8000"), ("A", "10.0.1.1:8000"), ("sql-lora", "10.0.1.2:8000")):
        assert destination(await get(model))[0] == address, model
        assert destination(await embed(model))[0] == address, model
    for refused in (await get("C"), await embed("C")):
        assert immediate_status([refused]) == 404 and "'C'" in refused.immediate_response.body.decode()
    assert envoy.router.workers.inflight_count == 0 and envoy.router.counters["decisions"] == 0


PD_POOL = [{"id": "p1", "address": "10.0.2.1:8000", "models": ["A"], "role": "prefill"},
           {"id": "d1", "address": "10.0.2.2:8000", "models": ["A"], "role": "decode"}]


def set_headers(resp: ep.ProcessingResponse) -> dict[str, str]:
    common = resp.request_headers.response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


@pytest.mark.parametrize("worker_list", [PD_POOL])
@pytest.mark.parametrize("daemon_extra", [{"disaggregation": {"local_prefill_max_uncached_tokens": 64}}])
async def test_a_pd_pool_sets_the_decode_destination_and_the_prefill_header(envoy):
    """Issue #31 items 3-4: the decode pod is the destination, the prefill pod goes in llm-d's
    x-prefiller-host-port; the prefill hop is released at the response headers, the decode
    hop at the stream's end; a short prompt prefills on the decode pod and the header is removed."""
    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions", extra=[("x-request-id", "pd-1"), ("x-prefiller-host-port", "evil:1")]))
    replies = await s.send(body_msg(chat_body("a long document to prefill " * 40, "A"), True), expect=2)
    sent = set_headers(replies[0])
    assert destination(replies[0]) == ("10.0.2.2:8000", "10.0.2.2:8000")
    assert sent["x-prefiller-host-port"] == "10.0.2.1:8000"
    assert "x-prefiller-host-port" not in replies[0].request_headers.response.header_mutation.remove_headers
    p1, d1 = envoy.router.workers.get("p1"), envoy.router.workers.get("d1")
    assert (p1.inflight_requests, d1.inflight_requests) == (1, 1) and p1.pending_prefill_tokens > 0
    await s.send(response_headers_msg(200, served="10.0.2.2:8000"), expect=1)
    assert (p1.inflight_requests, p1.pending_prefill_tokens, d1.inflight_requests) == (0, 0, 1)
    await s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)), expect=1)
    await s.close()
    await asyncio.sleep(0.05)
    assert d1.inflight_requests == 0

    s = envoy.open()
    await s.send(headers_msg("/v1/chat/completions", extra=[("x-prefiller-host-port", "evil:1")]))
    replies = await s.send(body_msg(chat_body("hi", "A"), True), expect=2)
    assert destination(replies[0])[0] == "10.0.2.2:8000"
    assert "x-prefiller-host-port" not in set_headers(replies[0])
    assert list(replies[0].request_headers.response.header_mutation.remove_headers) == ["x-prefiller-host-port"]
    await s.close()


@pytest.mark.parametrize("worker_list", [PD_POOL])
async def test_a_request_without_a_prompt_goes_to_a_decode_worker_of_a_pd_pool(envoy):
    """A prefill pod takes no request of its own: a GET goes to the decode pod (the prefill pod,
    registered first, would win the tie otherwise), with no prefill header."""
    s = envoy.open()
    replies = await s.send(headers_msg("/v1/models", eos=True, method="GET", extra=[("x-prefiller-host-port", "evil:1")]),
                           expect=1)
    assert destination(replies[0])[0] == "10.0.2.2:8000"
    assert list(replies[0].request_headers.response.header_mutation.remove_headers) == ["x-prefiller-host-port"]
    await s.close()


@pytest.mark.parametrize("daemon_extra", [{"admission": {"max_inflight": 1, "max_wait_s": 5.0}}])
async def test_an_x_request_id_already_waiting_or_too_long_is_renamed_not_refused(envoy):
    """A mesh passes one x-request-id to parallel calls; the id is a trace label, so a second
    request under it waits and is served under a name of the router's, as one in flight is."""
    first, _, _ = await route_chat(envoy, "first " * 50, subset=ONE, extra=[("x-request-id", "dup")])
    waiting = []
    for text, rid in (("second ", "dup"), ("third ", "dup"), ("fourth ", "x" * 300)):
        s = envoy.open()
        await s.send(headers_msg("/v1/chat/completions", subset=ONE, extra=[("x-request-id", rid)]))
        await s.queue.put(body_msg(chat_body(text * 50), True))
        waiting.append((s, asyncio.ensure_future(s.call.read())))
        await asyncio.sleep(0.1)
    assert not any(pending.done() for _, pending in waiting)  # all three wait for ONE, none refused
    await first.send(response_headers_msg(200, served=ONE[0]), expect=1)
    await first.close()
    for s, pending in waiting:  # each completes in turn, admitting the next
        reply = await asyncio.wait_for(pending, 5)
        assert destination(reply)[0] == ONE[0]
        await asyncio.wait_for(s.call.read(), 5)  # the body's echo
        await s.send(response_headers_msg(200, served=ONE[0]), expect=1)
        await s.close()
    await asyncio.sleep(0.05)
    assert envoy.router.workers.inflight_count == 0


async def test_response_bodies_not_sent_are_warned_about_once(envoy, caplog):
    for _ in range(2):
        s = envoy.open()
        await s.send(headers_announcing(processing_mode_pb2.ProcessingMode.NONE))
        await s.send(body_msg(chat_body("mode"), True), expect=2)
        await s.close()
    warnings = [r for r in caplog.records if "response_body_mode: NONE" in r.getMessage()]
    assert len(warnings) == 1 and "FULL_DUPLEX_STREAMED" in warnings[0].getMessage()


@pytest.mark.parametrize("daemon_extra", [{"admission": {"max_inflight": 1, "max_wait_s": 5.0}}])
async def test_a_queued_requests_ttft_counts_its_wait_from_arrival(envoy):
    """As the caller sees it and as the simulator times it: a request that waited 2 s in an
    admission queue and then got its first token 0.1 s after dispatch took 2.1 s to its first
    token, which deadline admission judges against its SLO."""
    first, _, _ = await route_chat(envoy, "first " * 50, subset=ONE)
    second = envoy.open()
    await second.send(headers_msg("/v1/chat/completions", subset=ONE, extra=[("x-request-id", "queued")]))
    await second.queue.put(body_msg(chat_body("second " * 50), True))
    pending = asyncio.ensure_future(second.call.read())
    await asyncio.sleep(0.1)
    envoy.clock.advance(2.0)
    await first.send(response_headers_msg(200, served=ONE[0]), expect=1)
    await first.close()
    await asyncio.wait_for(pending, 5)
    await asyncio.wait_for(second.call.read(), 5)  # the body's echo
    seen = []
    complete = envoy.router.complete
    envoy.router.complete = lambda c: (seen.append(c), complete(c))[1]  # type: ignore[method-assign]
    envoy.clock.advance(0.1)
    await second.send(response_headers_msg(200, served=ONE[0]), expect=1)
    await second.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: {}\n\n", end_of_stream=True)),
                      expect=1)
    await second.close()
    await asyncio.sleep(0.05)
    (c,) = seen
    assert c.request_id == "queued" and c.ttft_ms == pytest.approx(2100.0) and c.e2e_ms == pytest.approx(2100.0)


@pytest.mark.parametrize("worker_list", [[{"id": "a", "address": "10.0.0.1:8000", "mode": "events",
                                           "models": ["base"], "loras": ["sql"]}]])
async def test_a_body_naming_an_adapter_in_model_is_keyed_as_its_engine_stores_it(envoy):
    """vLLM serves a LoRA adapter under its own name in ``model``; its KV events carry the base
    model (the endpoint's) and the adapter (``lora_name``): the body's keys must be those."""
    tokens = list(range(5000, 5000 + 8 * BS))
    s = envoy.open()
    await s.send(headers_msg("/v1/completions", extra=[("x-request-id", "adapter")]))
    await s.send(body_msg(json.dumps({"model": "sql", "prompt": tokens}).encode(), True), expect=2)
    req = envoy.router.request("adapter")
    assert list(req.keys) == block_keys(tokens, BS, model="base", lora="sql") and req.model == "sql"
    await s.close()
