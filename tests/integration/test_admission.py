"""Admission queue mode over gRPC: Route waits while its worker is full, honouring deadlines."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.router import request_bytes

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
    assert running.router.waiting_bytes == 0  # what it held while waiting is released


async def test_waiting_longer_than_max_wait_is_shed(running):
    stub = running.stub
    await setup(stub)
    await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Route(pb.RouteRequest(token_ids=PROMPT))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "admission queue" in err.value.details()
    assert len(running.daemon.admission.queues) == 0
    assert running.router.waiting_bytes == 0


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
    assert running.router.waiting_bytes == 0


class TestWaitingRequestsCountTowardTheInflightBudget:
    """A queued Route holds its keys and ids as an in-flight one does (issue #16 item 3): a
    queue that grows without bound would bypass limits.max_inflight_bytes."""

    @pytest.fixture
    def daemon_config(self):  # type: ignore[no-untyped-def]
        # a 20-block request costs ~700 bytes (request_bytes): two fit, a third does not
        return {"admission": {"max_inflight": 1, "max_wait_s": 5}, "limits": {"max_inflight_bytes": 2000}}

    async def test_a_route_that_would_overflow_with_the_waiting_ones_is_resource_exhausted(self, running):  # type: ignore[no-untyped-def]
        stub, router = running.stub, running.router
        await setup(stub)
        first = await stub.Route(pb.RouteRequest(token_ids=PROMPT, request_id="first"))
        waiting = asyncio.ensure_future(stub.Route(pb.RouteRequest(token_ids=PROMPT, request_id="second")))
        await asyncio.sleep(0.1)
        assert [e.request_id for e in running.daemon.admission.queues.queue("a")] == ["second"]
        inflight, held = router.inflight_bytes, router.waiting_bytes
        assert inflight > 0 and held > 0 and inflight + 2 * held > 2000 >= inflight + held
        with pytest.raises(grpc.aio.AioRpcError) as err:  # "third": one character shorter than "second"
            await stub.Route(pb.RouteRequest(token_ids=PROMPT, request_id="third"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == (
            f"the in-flight table holds {inflight} bytes of routed, not completed requests and {held} bytes of "
            f"requests waiting for admission; this one ({held - 1} bytes) would exceed "
            "limits.max_inflight_bytes=2000: complete requests (or let them expire) first")
        # rejected: nothing queued, nothing charged
        assert [e.request_id for e in running.daemon.admission.queues.queue("a")] == ["second"]
        assert (router.inflight_bytes, router.waiting_bytes) == (inflight, held)
        # admitted, the second request's bytes move from the queue to the in-flight table
        await stub.Complete(pb.CompleteRequest(request_id=first.request_id, success=True))
        assert (await asyncio.wait_for(waiting, 2)).request_id == "second"
        assert router.waiting_bytes == 0 and router.inflight_bytes == request_bytes(router.request("second"))
