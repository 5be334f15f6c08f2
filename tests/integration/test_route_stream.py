"""RouteStream against a real daemon: every message answered as its unary twin would be."""

from __future__ import annotations

import asyncio
from array import array

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

BS = 16
PROMPT = list(range(500, 500 + 20 * BS))


async def setup(stub) -> None:
    for wid in ("a", "b"):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id=wid, address=f"{wid}:1", mode=pb.CACHE_STATE_MODE_EVENTS)))

    async def batches():
        yield pb.EventBatch(worker_id="b", sequence=0, events=[pb.CacheEvent(stored=pb.StoredBlocks(token_ids=PROMPT))])

    await stub.PublishEvents(batches())


def route(i: int, **fields) -> pb.RouteStreamRequest:
    return pb.RouteStreamRequest(id=i, route=pb.RouteRequest(**fields))


def complete(i: int, **fields) -> pb.RouteStreamRequest:
    return pb.RouteStreamRequest(id=i, complete=pb.CompleteRequest(**fields))


async def test_routes_and_completes_share_one_stream_and_a_bad_message_does_not_end_it(running):
    await setup(running.stub)
    call = running.stub.RouteStream()
    router = running.router

    await call.write(route(1, token_ids=PROMPT, request_id="r1", session_id="s"))
    ok = await call.read()
    assert ok.id == 1 and ok.WhichOneof("kind") == "route"
    assert (ok.route.worker_id, ok.route.request_id, ok.route.matched_blocks, ok.route.prompt_blocks) == ("b", "r1", 20, 20)
    assert router.workers.get("b").inflight_requests == 1

    before = (len(router.index), router.workers.inflight_count)
    bad = [
        (route(2), grpc.StatusCode.INVALID_ARGUMENT),  # no prompt
        (route(3, token_ids=PROMPT, policy="nope"), grpc.StatusCode.INVALID_ARGUMENT),
        (route(4, token_ids=PROMPT, candidate_workers=["ghost"]), grpc.StatusCode.NOT_FOUND),  # a typo, not an outage
        (route(5, token_ids=PROMPT, request_id="r1"), grpc.StatusCode.INVALID_ARGUMENT),  # already in flight
        (complete(6, request_id="never-routed"), grpc.StatusCode.NOT_FOUND),
        (pb.RouteStreamRequest(id=7), grpc.StatusCode.INVALID_ARGUMENT),  # neither kind
    ]
    for msg, code in bad:
        await call.write(msg)
        reply = await call.read()
        assert reply.id == msg.id and reply.WhichOneof("kind") == "error"
        assert reply.error.code == code.value[0], (msg, reply)
        assert reply.error.message
    assert (len(router.index), router.workers.inflight_count) == before

    # the stream survived every rejection: Complete on it releases r1's load
    await call.write(complete(8, request_id="r1", ttft_ms=5.0, success=True))
    done = await call.read()
    assert done.id == 8 and done.WhichOneof("kind") == "complete"
    assert router.workers.get("b").inflight_requests == 0
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert (await call.code()) == grpc.StatusCode.OK

    spans = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
    assert len(spans) == 5  # one per Route message, rejected ones included
    assert spans[0].attributes["kvrouter.chosen.worker_id"] == "b"
    assert spans[1].status.status_code.name == "ERROR"
    assert spans[1].attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def batch(*items: pb.RouteStreamRequest, i: int = 0) -> pb.RouteStreamRequest:
    return pb.RouteStreamRequest(id=i, batch=pb.RouteStreamRequestBatch(items=items))


async def test_a_batch_is_answered_item_by_item_in_one_batch_and_bad_items_change_nothing(running):
    await setup(running.stub)
    router = running.router
    call = running.stub.RouteStream()
    # the advertisement batching clients wait for: below limits.off_loop_prompt_bytes (256 KiB by
    # default), so a batch is parsed whole (KVRouterService.stream_batch_bytes)
    metadata = await call.initial_metadata()
    assert metadata.get("kvrouter-stream-batch") == str((256 << 10) - 1)
    # and the block size a client may key prompts with (RouterClient(send_block_keys=True))
    assert metadata.get("kvrouter-block-size") == str(router.block_size)

    await call.write(route(1, token_ids=PROMPT, request_id="r1"))
    assert (await call.read()).route.worker_id == "b"
    before = len(router.index)
    await call.write(batch(
        route(2, token_ids=PROMPT, request_id="r2", session_id="s"),
        route(3),  # no prompt
        route(4, token_ids=PROMPT, candidate_workers=["ghost"]),
        complete(5, request_id="never-routed"),
        batch(route(60, token_ids=PROMPT), i=6),  # a batch in a batch is not routed
        pb.RouteStreamRequest(id=7),  # neither kind
        complete(8, request_id="r1", success=True),
        route(9, token_ids=PROMPT, request_id="r2"),  # already in flight: decided after item 2
        i=99,
    ))
    reply = await call.read()
    assert reply.WhichOneof("kind") == "batch" and reply.id == 0
    items = reply.batch.items
    assert [a.id for a in items] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert items[0].route.request_id == "r2" and items[0].route.matched_blocks == 20
    codes = {a.id: a.error.code for a in items if a.WhichOneof("kind") == "error"}
    C = grpc.StatusCode
    assert codes == {3: C.INVALID_ARGUMENT.value[0], 4: C.NOT_FOUND.value[0], 5: C.NOT_FOUND.value[0],
                     6: C.INVALID_ARGUMENT.value[0], 7: C.INVALID_ARGUMENT.value[0], 9: C.INVALID_ARGUMENT.value[0]}
    assert "batch" in items[4].error.message and all(a.error.message for a in items if a.id in codes)
    assert items[6].WhichOneof("kind") == "complete"
    # r1 completed, r2 routed, nothing else committed
    assert router.request("r1") is None and router.request("r2") is not None
    assert router.workers.inflight_count == 1 and len(router.index) == before

    # an empty batch is an error under the batch's own id; single messages still get single answers
    await call.write(batch(i=42))
    empty = await call.read()
    assert (empty.id, empty.error.code) == (42, C.INVALID_ARGUMENT.value[0]) and "empty" in empty.error.message
    # so is one of more than 256 items, before any is handled (a batch holds the event loop)
    await call.write(batch(*[route(1000 + n, token_ids=PROMPT, request_id=f"x{n}") for n in range(257)], i=43))
    over = await call.read()
    assert (over.id, over.error.code) == (43, C.INVALID_ARGUMENT.value[0]) and "at most 256" in over.error.message
    assert router.request("x0") is None and router.workers.inflight_count == 1
    await call.write(complete(10, request_id="r2"))
    done = await call.read()
    assert done.id == 10 and done.WhichOneof("kind") == "complete"
    assert router.workers.inflight_count == 0
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF

    # one span per routed item, as for single messages: r1, then items 2, 3, 4 and 9
    spans = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
    assert len(spans) == 5
    assert [s.status.status_code.name for s in spans] == ["UNSET", "UNSET", "ERROR", "ERROR", "ERROR"]


async def test_pipelined_messages_are_answered_by_id(running):
    await setup(running.stub)
    call = running.stub.RouteStream()
    for i in range(20):
        await call.write(route(100 + i, token_ids=PROMPT, request_id=f"p{i}"))
    replies = [await call.read() for _ in range(20)]
    assert sorted(r.id for r in replies) == [100 + i for i in range(20)]
    assert all(r.route.request_id == f"p{r.id - 100}" for r in replies)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


class TestWithAdmission:
    @pytest.fixture
    def daemon_config(self):
        return {"admission": {"max_inflight": 1, "max_wait_s": 5.0}}

    async def test_a_queued_route_does_not_hold_up_the_stream(self, running):
        await setup(running.stub)
        call = running.stub.RouteStream()
        await call.write(route(1, token_ids=PROMPT, request_id="first"))
        assert (await call.read()).route.worker_id == "b"
        # b is full: "second" waits in its queue while later messages are answered
        await call.write(route(2, token_ids=PROMPT, request_id="second"))
        await call.write(route(3, token_ids=PROMPT, request_id="third", candidate_workers=["a"]))
        third = await call.read()
        assert third.id == 3 and third.route.worker_id == "a"
        assert [e.request_id for e in running.daemon.admission.queues.queue("b")] == ["second"]
        await call.write(complete(4, request_id="first", success=True))
        replies = {r.id: r for r in [await call.read(), await call.read()]}
        assert replies[4].WhichOneof("kind") == "complete"
        assert replies[2].route.worker_id == "b" and replies[2].route.request_id == "second"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF

    async def test_a_queued_route_does_not_hold_up_the_rest_of_its_batch(self, running):
        await setup(running.stub)
        call = running.stub.RouteStream()
        await call.write(route(1, token_ids=PROMPT, request_id="first"))
        assert (await call.read()).route.worker_id == "b"
        # b is full: "second" waits in its queue; the batch's other items are answered meanwhile
        await call.write(batch(
            route(2, token_ids=PROMPT, request_id="second"),
            route(3, token_ids=PROMPT, request_id="third", candidate_workers=["a"]),
            complete(4, request_id="never-routed"),
        ))
        replies = {}
        for _ in range(2):
            reply = await call.read()
            for item in (reply.batch.items if reply.WhichOneof("kind") == "batch" else [reply]):
                replies[item.id] = item
        assert sorted(replies) == [3, 4]
        assert replies[3].route.worker_id == "a"
        assert replies[4].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert [e.request_id for e in running.daemon.admission.queues.queue("b")] == ["second"]
        await call.write(complete(5, request_id="first", success=True))
        replies = {r.id: r for r in [await call.read(), await call.read()]}
        assert replies[5].WhichOneof("kind") == "complete"
        assert replies[2].route.worker_id == "b" and replies[2].route.request_id == "second"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF

    async def test_a_message_deadline_removes_the_waiting_request(self, running):
        await setup(running.stub)
        call = running.stub.RouteStream()
        await call.write(route(1, token_ids=PROMPT))
        await call.read()
        late = route(2, token_ids=PROMPT, request_id="late")
        late.timeout_ms = 100
        await call.write(late)
        reply = await asyncio.wait_for(call.read(), 3)
        assert reply.id == 2 and reply.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert len(running.daemon.admission.queues) == 0 and running.router.request("late") is None

    async def test_closing_the_stream_gives_up_its_queued_routes(self, running):
        await setup(running.stub)
        call = running.stub.RouteStream()
        await call.write(route(1, token_ids=PROMPT))
        await call.read()
        await call.write(route(2, token_ids=PROMPT, request_id="abandoned"))
        await asyncio.sleep(0.1)
        assert len(running.daemon.admission.queues) == 1
        call.cancel()
        for _ in range(100):
            if not len(running.daemon.admission.queues):
                break
            await asyncio.sleep(0.02)
        assert len(running.daemon.admission.queues) == 0 and running.router.request("abandoned") is None


@pytest.mark.parametrize("load", ["stream_coalesced", "stream_single", "stream_reported", "unary", "sdk", "sdk_keys"])
async def test_the_benchmark_loads_complete_every_route_so_decisions_take_the_prefix_path(running, load):
    # kvrouterd bench's daemon loads, briefly: they raise on any error reply, and complete each
    # routed request as the SDK does. Without the Completes the load piles up on the worker
    # holding the prompt until the policy calls the fleet imbalanced and routes by load alone
    from kvrouterd.benchmarks.grpc_bench import _load, _sdk_load, _stream_load

    await setup(running.stub)
    request = pb.RouteRequest(token_ids=PROMPT)
    if load == "unary":
        result = await _load(running.daemon.port, request, 6, 0.2)
    elif load.startswith("sdk"):  # the SDK's RouterClient, and the CPU this process spent per call
        result = await _sdk_load(running.daemon.port, list(PROMPT), 6, 0.2, send_block_keys=load == "sdk_keys")
        assert result["client_cpu_us_per_call"] > 0
    else:  # reported: the Completes carry a gateway's latencies and its engine's cached tokens
        coalesce = load != "stream_single"
        result = await _stream_load(running.daemon.port, request, 2, 3, 0.2, coalesce=coalesce,
                                    reported=load == "stream_reported")
        # coalesced: the 3 routes of a stream go together, then each answer batch's completes
        # and next routes; one per message: exactly that
        assert (result["batch_items_sent"] > 2) if coalesce else (result["batch_items_sent"] == 1.0)
        assert (result["batch_items_received"] > 2) if coalesce else (result["batch_items_received"] == 1.0)
    assert result["calls"] > 6 and result["rps"] > 0
    assert running.router.workers.inflight_count == 0  # every routed request was completed
    # the daemon's own decision counter agrees: only prefix matches (warm-ups included)
    counted = running.daemon.metrics.decisions.counts
    assert {reason for _, reason in counted} == {"prefix_match"}
    assert sum(counted.values()) > result["calls"]
    assert result["reasons"] == {"prefix_match": result["calls"]}


async def test_the_benchmarks_floor_router_matches_answers_and_completes_what_it_routes(running):
    """``kvrouterd bench``'s floor (``FloorService``) must do the work it stands for: hash and
    match each prompt in the daemon's index and route it to the worker holding it."""
    from kvrouterd.benchmarks.grpc_bench import _OPTIONS, FloorService, _stream_load
    from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

    await setup(running.stub)
    floor = FloorService(running.router)
    server = grpc.aio.server(options=_OPTIONS)
    router_pb2_grpc.add_KVRouterServicer_to_server(floor, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        result = await _stream_load(port, pb.RouteRequest(token_ids_le32=array("I", PROMPT).tobytes()), 2, 3, 0.2)
    finally:
        await server.stop(0)
    assert result["calls"] > 6 and result["reasons"] == {"prefix_match": result["calls"]}
    assert not floor._inflight and running.router.workers.inflight_count == 0


async def test_an_item_that_raises_gets_its_own_internal_error_and_the_stream_goes_on(running, monkeypatch):
    """Issue #28 item 3: one item raising an unexpected exception ended the whole stream UNKNOWN."""
    await setup(running.stub)
    router = running.router
    decide_for_real = router.decide  # every Route decides, with or without deadline admission

    def failing_decide(req, explain=True):  # type: ignore[no-untyped-def]
        if req.request_id.startswith("boom"):
            raise OverflowError("cannot convert float infinity to integer")
        return decide_for_real(req, explain=explain)

    monkeypatch.setattr(router, "decide", failing_decide)
    call = running.stub.RouteStream()
    await call.write(route(1, token_ids=PROMPT, request_id="boom-1"))
    reply = await call.read()
    assert reply.id == 1 and reply.WhichOneof("kind") == "error"
    assert reply.error.code == grpc.StatusCode.INTERNAL.value[0] and "OverflowError" in reply.error.message
    batch = pb.RouteStreamRequest(id=9, batch=pb.RouteStreamRequestBatch(items=[
        route(2, token_ids=PROMPT, request_id="ok-2"), route(3, token_ids=PROMPT, request_id="boom-3"),
        complete(4, request_id="ok-2", ttft_ms=5.0)]))
    await call.write(batch)
    reply = await call.read()
    items = {item.id: item for item in reply.batch.items}
    assert items[2].WhichOneof("kind") == "route" and items[4].WhichOneof("kind") == "complete"
    assert items[3].error.code == grpc.StatusCode.INTERNAL.value[0]
    await call.write(route(5, token_ids=PROMPT, request_id="ok-5"))
    assert (await call.read()).WhichOneof("kind") == "route"
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert (await call.code()) == grpc.StatusCode.OK
    assert running.daemon.service.call_errors.internal_count("RouteStream") == 2
