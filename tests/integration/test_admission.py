"""Admission queue mode over gRPC: Route waits while its worker is full, honouring deadlines."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

BS = 16
PROMPT = list(range(20 * BS))


@pytest.fixture
def daemon_config():
    return {"admission": {"max_inflight": 1, "max_wait_s": 0.5}}


async def setup(stub):
    for wid in ("a", "b"):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id=wid, address=f"{wid}:1", mode=pb.CACHE_STATE_MODE_EVENTS)))

    async def batches():
        yield pb.EventBatch(worker_id="a", sequence=0, events=[pb.CacheEvent(stored=pb.StoredBlocks(token_ids=PROMPT))])

    await stub.PublishEvents(batches())


async def test_route_waits_for_its_worker_and_is_admitted_on_complete(running):
    stub = running.stub
    await setup(stub)
    first = await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    assert first.worker_id == "a"
    waiting = asyncio.ensure_future(stub.Route(pb.RouteRequest(token_ids=PROMPT, request_id="second")))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    assert [e.request_id for e in running.daemon.admission.queues.queue("a")] == ["second"]
    await stub.Complete(pb.CompleteRequest(request_id=first.request_id, success=True))
    second = await asyncio.wait_for(waiting, 2)
    assert second.worker_id == "a" and second.request_id == "second" and second.matched_blocks == 20
    assert len(running.daemon.admission.queues) == 0


async def test_the_callers_deadline_removes_the_waiting_request(running):
    stub = running.stub
    await setup(stub)
    await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Route(pb.RouteRequest(token_ids=PROMPT, request_id="late"), timeout=0.15)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.05)
    assert len(running.daemon.admission.queues) == 0
    assert running.router.request("late") is None


async def test_waiting_longer_than_max_wait_is_shed(running):
    stub = running.stub
    await setup(stub)
    await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "admission queue" in err.value.details()
    assert len(running.daemon.admission.queues) == 0


async def test_deregistering_the_worker_fails_its_waiters_fast(running):
    stub = running.stub
    await setup(stub)
    await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    waiting = asyncio.ensure_future(stub.Route(pb.RouteRequest(token_ids=PROMPT)))
    await asyncio.sleep(0.1)
    await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="a"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(waiting, 2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
