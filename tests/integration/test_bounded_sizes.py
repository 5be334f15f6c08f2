"""Budgets on what clients make the daemon hold (issue #16 item 3): all workers' descriptions,
the in-flight table's bytes and one client's share of it, an approximate worker's modelled
cache. Real grpc.aio on loopback."""

from __future__ import annotations

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

from .test_daemon import BS, register


@pytest.fixture
def daemon_config() -> dict:
    return {"limits": {"max_message_bytes": 65536, "max_inflight_bytes": 8192, "approximate_capacity_blocks": 40}}


async def test_labels_too_large_for_list_workers_are_refused_and_list_workers_keeps_answering(running):
    """Three workers with 6 MB labels made ListWorkers and GetStats fail for everyone: all workers'
    descriptions together stay under half of max_message_bytes (64 KiB here)."""
    labels = {f"k{i}": "v" * 1000 for i in range(10)}  # 10 kB each, under max_labels_length
    added = 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        for i in range(10):
            await running.stub.RegisterWorker(pb.RegisterWorkerRequest(
                worker=pb.Worker(id=f"w{i}", address=f"10.0.0.{i}:80", labels=labels)))
            added += 1
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "ListWorkers" in err.value.details()
    assert added == 3 and len(running.router.workers) == 3
    listed = await running.stub.ListWorkers(pb.ListWorkersRequest())
    stats = await running.stub.GetStats(pb.GetStatsRequest())
    assert len(listed.workers) == 3 and len(stats.workers) == 3
    # re-registering a known worker replaces its description rather than adding to the total
    await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="w0", address="10.0.0.0:80", labels=labels)))
    too_big = {"k": "v" * 20_000}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="w0", address="h:1", labels=too_big)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_labels_length" in err.value.details()
    assert dict(running.router.workers.get("w0").spec.labels) == labels


async def test_the_in_flight_table_has_a_byte_budget(running):
    await register(running.stub, "a", mode=pb.CACHE_STATE_MODE_APPROXIMATE)
    prompt = list(range(64 * BS))  # 64 keys: ~1 kB in flight each
    routed = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        for i in range(20):
            routed.append(await running.stub.Route(pb.RouteRequest(token_ids=prompt, request_id=f"r{i}")))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_inflight_bytes" in err.value.details()
    assert 2 <= len(routed) < 20
    assert running.router.inflight_bytes <= 8192 and running.router.workers.inflight_count == len(routed)
    await running.stub.Complete(pb.CompleteRequest(request_id="r0"))
    await running.stub.Route(pb.RouteRequest(token_ids=prompt, request_id="again"))  # room again


@pytest.mark.parametrize("daemon_config", [{"limits": {"max_inflight_per_client": 3}}])
async def test_one_client_that_never_completes_holds_at_most_its_share_of_the_in_flight_table(running):
    """Issue #28 item 6: a client (one connection) past limits.max_inflight_per_client is
    RESOURCE_EXHAUSTED, on Route and on its RouteStreams alike; another client routes on."""
    await register(running.stub, "a", mode=pb.CACHE_STATE_MODE_APPROXIMATE)
    prompt = list(range(2 * BS))
    for i in range(3):
        await running.stub.Route(pb.RouteRequest(token_ids=prompt, request_id=f"r{i}"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(pb.RouteRequest(token_ids=prompt, request_id="r3"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_inflight_per_client" in err.value.details()
    answers = [r async for r in running.stub.RouteStream(iter([pb.RouteStreamRequest(
        id=1, route=pb.RouteRequest(token_ids=prompt, request_id="s0"))]))]
    assert answers[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    # another client: its own connection (channels of one process share one unless told not to)
    own = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.daemon.port}", options=own) as other:
        await router_pb2_grpc.KVRouterStub(other).Route(pb.RouteRequest(token_ids=prompt, request_id="other"))
    await running.stub.Complete(pb.CompleteRequest(request_id="r0"))
    await running.stub.Route(pb.RouteRequest(token_ids=prompt, request_id="r3"))  # room again


async def test_an_approximate_worker_without_capacity_models_the_default_capacity(running):
    await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="h:1")))
    worker = running.router.workers.get("a")
    assert worker.spec.capacity_blocks == 0
    for i in range(10):
        await running.stub.Route(pb.RouteRequest(token_ids=list(range(i * 1000, i * 1000 + 10 * BS)), request_id=f"r{i}"))
        await running.stub.Complete(pb.CompleteRequest(request_id=f"r{i}"))
    # 100 distinct blocks routed; the modelled cache holds limits.approximate_capacity_blocks
    assert running.router.index.count(worker.slot) == 40
