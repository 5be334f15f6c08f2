"""Route on the daemon's default path (no tracer, no admission queue, deadline admission in one
synchronous step): the flat fast path in KVRouterService.Route answers and rejects exactly as the
traced one does."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon

from .conftest import RunningDaemon
from .test_daemon import BS, publish, register, stored


@pytest.fixture
async def untraced() -> AsyncIterator[RunningDaemon]:
    cfg = parse_config({"listen": "127.0.0.1:0", "limits": {"max_prompt_tokens": 4096}})
    daemon = Daemon(cfg, seed=1)  # no span exporter: tracing off, as deployed by default
    port = await daemon.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield RunningDaemon(daemon, channel, None)  # type: ignore[arg-type]
    finally:
        await channel.close()
        await daemon.stop(grace=0.5)


async def test_the_fast_path_routes_and_counts(untraced):
    service = untraced.daemon.service
    assert not service.tracing and service.waiting_admission is None
    assert service.route_now == service.admission.route_now  # deadline admission, on by default
    stub = untraced.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    prompt = list(range(100, 100 + 4 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt[: 3 * BS], [1, 2, 3])]))
    resp = await stub.Route(pb.RouteRequest(token_ids=prompt, request_id="r1", task=pb.TASK_CATEGORY_AGENTIC))
    assert (resp.request_id, resp.worker_id, resp.worker_address) == ("r1", "a", "a.local:8000")
    assert (resp.matched_blocks, resp.matched_tokens, resp.prompt_blocks) == (3, 3 * BS, 4)
    assert resp.policy == "cache_aware" and resp.reason
    assert untraced.router.request("r1").task == pb.TASK_CATEGORY_AGENTIC
    assert untraced.daemon.metrics.decisions.counts == {(resp.policy, resp.reason): 1}


@pytest.mark.parametrize(
    "request_msg,code",
    [
        (pb.RouteRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RouteRequest(token_ids=[1] * 32, block_keys=[1]), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RouteRequest(token_ids=[1] * 32, task=99), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RouteRequest(token_ids=[1] * 32, policy="nope"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RouteRequest(block_keys=[1, 2, 3], prompt_tokens=16), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RouteRequest(token_ids=[1] * 32, ttft_slo_ms=-1), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RouteRequest(token_ids=[1] * 32, candidate_workers=["ghost"]), grpc.StatusCode.NOT_FOUND),
        (pb.RouteRequest(token_ids=[1] * 5000), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (pb.RouteRequest(block_keys=[1], prompt_tokens=5000), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
async def test_bad_route_input_gets_a_precise_status_and_changes_nothing(untraced, request_msg, code):
    await register(untraced.stub, "a")
    router = untraced.router
    before = (len(router.index), router.workers.inflight_count)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await untraced.stub.Route(request_msg)
    assert err.value.code() == code and err.value.details()
    assert (len(router.index), router.workers.inflight_count) == before
    assert not untraced.daemon.metrics.decisions.counts
