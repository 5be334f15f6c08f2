"""A fake KVRouter servicer on a real grpc.aio server (127.0.0.1, port 0) for SDK tests.

It keeps what the SDK sent and applies event batches with the router's sequence rules
(in order, duplicates ignored, 0 after a higher number = restart), so tests can assert
exactly what a real router would have received. It can be stopped and restarted on the
same port to play an unreachable router.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from kvrouter_client._generated.kvrouter.v1 import router_pb2 as pb
from kvrouter_client._generated.kvrouter.v1 import router_pb2_grpc


class FakeRouter(router_pb2_grpc.KVRouterServicer):
    def __init__(self) -> None:
        self.routes: list[pb.RouteRequest] = []
        self.completes: list[pb.CompleteRequest] = []
        self.loads: list[pb.ReportLoadRequest] = []
        self.evicts: list[pb.EvictHintRequest] = []
        self.registered: dict[str, pb.Worker] = {}
        self.applied: list[pb.EventBatch] = []  # in application order
        self.last_seq: dict[str, int] = {}
        self.duplicates = 0
        self.route_delay = 0.0
        self.route_error: grpc.StatusCode | None = None
        self.complete_error: grpc.StatusCode | None = None
        #: abort a PublishEvents stream with UNAVAILABLE after this many batches (then reset)
        self.break_stream_after: int | None = None
        #: reject batches of workers not registered (the real router says NOT_FOUND)
        self.require_registration = False
        #: reject (INVALID_ARGUMENT) the first batch with this sequence number, once
        self.reject_sequence: int | None = None
        #: end the next PublishEvents streams, one each, with these codes at their first batch
        self.fail_streams: list[grpc.StatusCode] = []
        #: RouteStream calls to end with these codes (whole-call, as gRPC's core ends a broken one)
        self.fail_route_streams: list[grpc.StatusCode] = []
        #: RouteStream calls to end with these codes as soon as they open, before any message
        self.end_route_streams_at_open: list[grpc.StatusCode] = []
        #: False plays a router that predates RouteStream (UNIMPLEMENTED)
        self.streams_supported = True
        #: RouteStream calls opened (including refused ones)
        self.streams_opened = 0
        #: abort the next RouteStream with UNAVAILABLE when it receives a message (then reset)
        self.break_route_stream = False
        #: every RouteStreamRequest received, in arrival order (a batch's items, not the batch)
        self.stream_messages: list[pb.RouteStreamRequest] = []
        #: False plays a router that predates batches: no advertisement, and a batch message is
        #: answered as the old router did, as a message of neither kind
        self.batches_supported = True
        #: the message size limit advertised to batching clients
        self.batch_limit_bytes = 4 << 20
        #: the block size advertised on RouteStream (None: none, as a router from before block keys)
        self.block_size: int | None = None
        #: cleared: RouteStream stops reading (and answering) after the message it has just
        #: recorded; the client's writes then block once HTTP/2's window is full. Set: go on
        self.stream_reading = asyncio.Event()
        self.stream_reading.set()
        #: items and serialised size of each batch message received, in arrival order
        self.stream_batches: list[int] = []
        #: workers on one ListWorkers page; None plays a router from before pages
        self.list_page_size: int | None = None
        #: every ListWorkersRequest received
        self.list_requests: list[pb.ListWorkersRequest] = []
        self.stream_batch_bytes: list[int] = []

    async def Route(self, request, context):
        self.routes.append(request)
        if self.route_delay:
            await asyncio.sleep(self.route_delay)
        if self.route_error is not None:
            await context.abort(self.route_error, "fake says no")
        return self._route_response(request)

    async def RouteStream(self, request_iterator, context):
        self.streams_opened += 1
        if not self.streams_supported:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        if self.end_route_streams_at_open:
            await context.abort(self.end_route_streams_at_open.pop(0), "the router is going away")
        if self.fail_route_streams:
            await request_iterator.__anext__()  # a message is under way when the call breaks
            await context.abort(self.fail_route_streams.pop(0), "Internal error from Core")
        metadata = []
        if self.batches_supported:
            metadata.append(("kvrouter-stream-batch", str(self.batch_limit_bytes)))
        if self.block_size is not None:
            metadata.append(("kvrouter-block-size", str(self.block_size)))
        if metadata:
            await context.send_initial_metadata(tuple(metadata))
        lock = asyncio.Lock()
        answering: set[asyncio.Task] = set()

        async def reply_to(msg: pb.RouteStreamRequest) -> pb.RouteStreamResponse:
            kind = msg.WhichOneof("kind")
            if kind == "route":
                self.routes.append(msg.route)
                if self.route_delay:
                    await asyncio.sleep(self.route_delay)
                if self.route_error is not None:
                    return pb.RouteStreamResponse(id=msg.id, error=pb.StreamError(code=self.route_error.value[0], message="fake says no"))
                return pb.RouteStreamResponse(id=msg.id, route=self._route_response(msg.route))
            if kind != "complete":
                return pb.RouteStreamResponse(id=msg.id, error=pb.StreamError(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="message carries neither route nor complete"))
            if self.complete_error is not None:
                return pb.RouteStreamResponse(id=msg.id, error=pb.StreamError(code=self.complete_error.value[0], message="fake says no"))
            self.completes.append(msg.complete)
            return pb.RouteStreamResponse(id=msg.id, complete=pb.CompleteResponse())

        async def answer(msg: pb.RouteStreamRequest) -> None:
            if msg.WhichOneof("kind") == "batch" and self.batches_supported:
                reply = pb.RouteStreamResponse()
                reply.batch.items.extend([await reply_to(item) for item in msg.batch.items])
            else:
                reply = await reply_to(msg)
            async with lock:
                await context.write(reply)

        async for msg in request_iterator:
            if msg.WhichOneof("kind") == "batch":
                self.stream_batches.append(len(msg.batch.items))
                self.stream_batch_bytes.append(msg.ByteSize())
                self.stream_messages.extend(msg.batch.items)
            else:
                self.stream_messages.append(msg)
            await self.stream_reading.wait()
            if self.break_route_stream:
                self.break_route_stream = False
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake connection drop")
            task = asyncio.create_task(answer(msg))
            answering.add(task)
            task.add_done_callback(answering.discard)
        await asyncio.gather(*answering)

    def _route_response(self, request: pb.RouteRequest) -> pb.RouteResponse:
        return pb.RouteResponse(
            request_id=request.request_id or f"req-{len(self.routes)}", worker_id="w1", worker_address="10.0.0.1:8000",
            matched_blocks=2, matched_tokens=32, prompt_blocks=len(request.block_keys) or len(request.token_ids_le32) // 64,
            alternative_worker_id="w2", alternative_worker_address="10.0.0.2:8000", policy="cache_aware",
            reason="prefix_match", estimated_ttft_ms=12.5,
        )

    async def Complete(self, request, context):
        if self.complete_error is not None:
            await context.abort(self.complete_error, "fake says no")
        self.completes.append(request)
        return pb.CompleteResponse()

    async def PublishEvents(self, request_iterator, context):
        summary = pb.PublishEventsResponse()
        n = 0
        async for batch in request_iterator:
            if self.fail_streams:
                await context.abort(self.fail_streams.pop(0), "fake fails this stream")
            if self.break_stream_after is not None and n >= self.break_stream_after:
                self.break_stream_after = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake connection drop")
            n += 1
            if self.require_registration and batch.worker_id not in self.registered:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {batch.worker_id!r}")
            if batch.sequence == self.reject_sequence:
                self.reject_sequence = None
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake rejects this batch")
            last = self.last_seq.get(batch.worker_id, -1)
            seq = batch.sequence
            if last >= 0 and seq <= last and not (seq == 0 and last > 0):
                self.duplicates += 1
                summary.batches_duplicate += 1
                continue
            if last >= 0 and seq != last + 1 and seq != 0:
                summary.gaps_detected += 1
            self.last_seq[batch.worker_id] = seq
            self.applied.append(batch)
            summary.batches_applied += 1
        return summary

    async def ReportLoad(self, request, context):
        self.loads.append(request)
        return pb.ReportLoadResponse()

    async def EvictHint(self, request, context):
        self.evicts.append(request)
        return pb.EvictHintResponse(keys=[7, 8], engine_hashes=[70, 80], exhausted=False, policy="lru")

    async def RegisterWorker(self, request, context):
        self.registered[request.worker.id] = request.worker
        w = pb.Worker()
        w.CopyFrom(request.worker)
        w.state = pb.WORKER_STATE_READY
        return pb.RegisterWorkerResponse(worker=w)

    async def DeregisterWorker(self, request, context):
        if request.worker_id not in self.registered:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown worker")
        del self.registered[request.worker_id]
        return pb.DeregisterWorkerResponse()

    async def ListWorkers(self, request, context):
        self.list_requests.append(request)
        workers = list(self.registered.values())
        if self.list_page_size is None:  # a router from before pages: everything, no token
            return pb.ListWorkersResponse(workers=workers)
        start = int(request.page_token or 0)
        end = start + self.list_page_size
        return pb.ListWorkersResponse(workers=workers[start:end], next_page_token=str(end) if end < len(workers) else "")

    # -- helpers for tests --
    def applied_events(self, worker_id: str) -> list[pb.CacheEvent]:
        return [ev for b in self.applied if b.worker_id == worker_id for ev in b.events]


class FakeServer:
    def __init__(self, fake: FakeRouter) -> None:
        self.fake = fake
        self.port = 0
        self.server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        # no BDP probing: the receive window stays at HTTP/2's 64 KiB, so a test can fill it
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.http2.bdp_probe", 0)])
        router_pb2_grpc.add_KVRouterServicer_to_server(self.fake, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        self.server = server

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


@pytest.fixture
async def fake_server() -> AsyncIterator[FakeServer]:
    server = FakeServer(FakeRouter())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
