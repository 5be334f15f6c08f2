"""Client-chosen sizes are bounded and every bad input gets a precise, short status (issue #16 items 3-4).

Real grpc.aio daemon on loopback; raw bytes go through untyped channel methods, as a broken or
hostile client would send them.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.server.logs import JsonFormatter, TextFormatter
from kvrouterd.server.status import MAX_STATUS_MESSAGE_BYTES

from .test_daemon import BS, register

GARBAGE = b"\xff\xff\xff\xff\x0f\x12 not a protobuf"

#: method -> (request streaming, response streaming)
KVROUTER_METHODS = {
    "Route": (False, False), "Complete": (False, False), "RouteStream": (True, True),
    "EvictHint": (False, False), "RegisterWorker": (False, False), "DeregisterWorker": (False, False),
    "ListWorkers": (False, False), "ReportLoad": (False, False), "PublishEvents": (True, False),
    "GetStats": (False, False), "ExportIndex": (False, True),
}
OTHER_METHODS = {
    "/grpc.health.v1.Health/Check": (False, False),
    "/envoy.service.ext_proc.v3.ExternalProcessor/Process": (True, True),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": (True, True),
}


def state(running) -> tuple:  # type: ignore[no-untyped-def]
    r = running.router
    return (tuple((w.id, w.spec, w.state, r.index.count(w.slot), w.inflight_requests) for w in r.workers),
            len(r.index), r.workers.inflight_count, r.inflight_bytes, r.counters["batches_applied"])


async def call_raw(channel: grpc.aio.Channel, path: str, streaming: tuple[bool, bool], messages: list[bytes]) -> None:
    req_stream, resp_stream = streaming
    if not req_stream and not resp_stream:
        await channel.unary_unary(path)(messages[0])
    elif not req_stream:
        async for _ in channel.unary_stream(path)(messages[0]):
            pass
    elif not resp_stream:
        await channel.stream_unary(path)(iter(messages))
    else:
        async for _ in channel.stream_stream(path)(iter(messages)):
            pass


@pytest.mark.parametrize("path", [*(f"/kvrouter.v1.KVRouter/{m}" for m in KVROUTER_METHODS), *OTHER_METHODS])
async def test_bytes_that_do_not_parse_are_invalid_argument_for_every_method(running, path):
    await register(running.stub, "a")
    before = state(running)
    streaming = KVROUTER_METHODS.get(path.rsplit("/", 1)[1]) or OTHER_METHODS[path]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_raw(running.channel, path, streaming, [GARBAGE])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "is not a valid" in err.value.details()
    assert state(running) == before


async def test_a_bad_message_inside_publish_events_stops_the_stream_with_invalid_argument(running):
    await register(running.stub, "a")
    good = pb.EventBatch(worker_id="a", sequence=0, events=[pb.CacheEvent(
        stored=pb.StoredBlocks(token_ids=list(range(2 * BS)), engine_hashes=[1, 2]))]).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_raw(running.channel, "/kvrouter.v1.KVRouter/PublishEvents", (True, False), [good, GARBAGE, good])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the batch before it stays applied (as with any rejected batch), nothing after it is read
    assert running.router.index.count(running.router.workers.get("a").slot) == 2
    assert running.router.workers.get("a").last_sequence == 0


@pytest.mark.parametrize("size", [2_000, 100_000, 1_000_000])
async def test_an_oversized_id_gets_its_own_status_with_a_short_message(running, size):
    """A 100 kB id used to come back as RESOURCE_EXHAUSTED "Stream removed": the status message
    quoting it overflowed the client's 8 KiB metadata limit."""
    await register(running.stub, "a")
    before = state(running)
    long = "x" * size
    calls = [
        running.stub.Complete(pb.CompleteRequest(request_id=long)),
        running.stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=long)),
        running.stub.ReportLoad(pb.ReportLoadRequest(worker_id=long)),
        running.stub.EvictHint(pb.EvictHintRequest(worker_id=long, blocks=1)),
        running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), request_id=long)),
        running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), session_id=long)),
        running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), model=long)),
        running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), cache_salt=long)),
        running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), policy=long)),
        running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), candidate_workers=[long])),
        running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id=long, address="h:1"))),
        running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="b", address=long))),
        running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="b", address="h:1", labels={"k": "x" * max(size, 20_000)}))),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "limits.max_" in err.value.details()
        assert len(err.value.details().encode()) <= MAX_STATUS_MESSAGE_BYTES
    assert state(running) == before


async def test_log_lines_quote_client_input_truncated(running, caplog):
    caplog.set_level(logging.INFO, logger="kvrouterd")
    with pytest.raises(grpc.aio.AioRpcError):
        await running.stub.Complete(pb.CompleteRequest(request_id="y" * 1_000_000))
    with pytest.raises(grpc.aio.AioRpcError):
        await running.stub.PublishEvents(iter([pb.EventBatch(worker_id="z" * 1_000_000)]))
    # a handler's rejection is logged once its abort has sent the status, which the client may
    # see first: the line is waited for (its absence still fails)
    for _ in range(200):
        records = [r for r in caplog.records if "rejected" in r.getMessage()]
        if len(records) >= 2:
            break
        await asyncio.sleep(0.01)
    assert len(records) == 2
    for record in records:
        assert len(record.getMessage()) < 1000  # the message quotes the id's start only
        for formatter in (TextFormatter(), JsonFormatter()):
            assert len(formatter.format(record)) < 4096  # and the id passed as a field is cut


def test_the_log_formatters_cut_a_huge_message_and_field():
    record = logging.LogRecord("kvrouterd.x", logging.INFO, __file__, 1, "m" * 1_000_000, (), None)
    record.worker_id = "w" * 1_000_000
    for formatter in (TextFormatter(), JsonFormatter()):
        line = formatter.format(record)
        assert len(line) < 4096 and "(1000000 characters)" in line


@pytest.mark.parametrize(("fields", "named"), [
    ({"ttft_ms": 1e308}, "ttft_ms"), ({"ttft_ms": float("inf")}, "ttft_ms"), ({"e2e_ms": float("nan")}, "e2e_ms"),
    ({"output_tokens": 4294967295}, "output_tokens"), ({"cached_tokens": 2**63 - 1}, "cached_tokens"),
])
@pytest.mark.parametrize("policy", ["min_ttft", "preble"])
async def test_absurd_completions_are_refused_and_cannot_poison_the_latency_model(running, policy, fields, named):
    """Issue #28 item 1: eight such Completes were accepted, then every min_ttft/preble Route
    answered UNKNOWN (OverflowError) for every client."""
    await register(running.stub, "a")
    await register(running.stub, "b")
    for i in range(8):
        rid = f"poison-{i}"
        await running.stub.Route(pb.RouteRequest(token_ids=list(range(i, i + 4 * BS)), request_id=rid, policy=policy))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Complete(pb.CompleteRequest(request_id=rid, **{"ttft_ms": 50.0, **fields}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details(), err.value
        await running.stub.Complete(pb.CompleteRequest(request_id=rid, ttft_ms=50.0))  # a sane one is taken
    reply = await running.stub.Route(pb.RouteRequest(token_ids=list(range(4 * BS)), policy=policy))
    assert reply.worker_id in ("a", "b") and reply.estimated_ttft_ms < 1e6


async def test_absurd_reported_counts_are_refused_naming_the_field(running):
    await register(running.stub, "a")
    before = state(running)
    calls = [
        (running.stub.ReportLoad(pb.ReportLoadRequest(worker_id="a", queued_requests=4294967295)), "queued_requests"),
        (running.stub.ReportLoad(pb.ReportLoadRequest(worker_id="a", running_requests=4294967295)), "running_requests"),
        (running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), expected_output_tokens=4294967295)),
         "expected_output_tokens"),
        (running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="b", address="h:1",
                                                                               capacity_blocks=2**64 - 1))),
         "capacity_blocks"),
    ]
    for call, named in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details(), err.value
    assert state(running) == before
