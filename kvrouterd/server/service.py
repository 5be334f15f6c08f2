"""The kvrouter.v1.KVRouter gRPC servicer: converts, calls the Router, records telemetry.

Here are the gateways' data path (Route, Complete, RouteStream) and the control plane; the
engines' calls (PublishEvents, ReportLoad, EvictHint) are its base ``engine_calls.EngineCalls``.
All handlers run on the daemon's single event loop and call the synchronous Router
directly, so decisions and event application never interleave mid-operation.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from functools import partial
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from .._generated.kvrouter.v1 import router_pb2_grpc
from ..bounds import MAX_LATENCY_MS, check_range
from ..config import LimitsConfig
from ..errors import InvalidRequest, KVRouterError, quote
from ..events.endpoints import EndpointAllowList, check_worker_endpoints
from ..index.workers import MAX_WORKERS, is_host_port
from ..protocols import CacheMode, RouteRequest
from ..router import DRAIN_STEP_BLOCKS, Router, RouteResult
from ..telemetry.metrics import Metrics
from ..telemetry.tracing import annotate_decision, decision_span
from . import convert, off_loop, stream_answers, stream_wire
from .admission import AdmissionGate
from .call_errors import CallErrors
from .convert import pb
from .decoding import UndecodableMessage, describe
from .engine_calls import MAX_NAMESPACES, EngineCalls
from .snapshot import export_chunks
from .status import abort, status_code, status_message
from .wire import STREAM_ROUTE
from .worker_pages import PAGE_BYTES, worker_page

__all__ = ["MAX_STREAM_BATCH_ITEMS", "STREAM_BATCH_METADATA", "STREAM_BLOCK_SIZE_METADATA", "KVRouterService"]

log = logging.getLogger("kvrouterd.server")

_perf_counter = time.perf_counter


#: RouteStream's initial response metadata: this router takes batched stream messages (the
#: value: the most bytes a batch should have, ``KVRouterService.stream_batch_bytes``); clients batch only then
STREAM_BATCH_METADATA = "kvrouter-stream-batch"
#: and the block size its keys are hashed with: a client may send a Route's ``block_keys``
#: computed with it (``RouterClient(send_block_keys=True)``), an eighth of the token ids' bytes
STREAM_BLOCK_SIZE_METADATA = "kvrouter-block-size"

#: most items in one RouteStream batch: a batch is handled in one turn of the event loop, so the
#: cap bounds how long it holds the loop (the SDK sends at most 64)
MAX_STREAM_BATCH_ITEMS = 256


#: the prompts of a RouteStream message that was parsed whole: none
_NO_PROMPTS: Mapping[int, off_loop.StreamPrompt] = {}


async def _drain(steps: Iterable[int]) -> None:
    for _ in steps:
        await asyncio.sleep(0)


class KVRouterService(EngineCalls, router_pb2_grpc.KVRouterServicer):
    def __init__(
        self, router: Router, tracer: trace.Tracer | None, metrics: Metrics, max_batch_events: int,
        max_message_bytes: int = 4 * 1024 * 1024, *,
        max_event_batch_bytes: int = LimitsConfig.max_event_batch_bytes,
        max_batch_blocks: int = LimitsConfig.max_batch_blocks,
    ) -> None:
        self.router = router
        #: None when tracing is off
        self.tracing = tracer is not None
        self.tracer = tracer if tracer is not None else trace.NoOpTracer()
        self._admission: AdmissionGate | None = None
        #: the admission gate when a Route may wait in it (queues), else None: Routes are then
        #: decided in one synchronous step by ``route_now`` and streams keep their in-order paths
        self.waiting_admission: AdmissionGate | None = None
        #: decide and commit a Route at once: the router's, or deadline admission's around it
        self.route_now: Callable[[RouteRequest, bool], RouteResult] = router.route
        #: called after RegisterWorker/DeregisterWorker (the daemon re-syncs ZMQ subscribers)
        self.on_membership_change: Callable[[], None] = lambda: None
        self.metrics = metrics
        #: every refused or failed call and stream item, counted and logged sampled (the daemon's
        #: handler wrappers report to it too)
        self.call_errors = CallErrors(metrics)
        #: what one PublishEvents batch may carry (``convert.BatchLimits``)
        self.batch_limits = convert.BatchLimits(max_batch_events, router.settings.max_id_length, max_event_batch_bytes,
                                                max_batch_blocks, router.block_size)
        #: the server's limit on a received message (what RouteStream advertises to batching clients)
        self.max_message_bytes = max_message_bytes
        #: removed workers whose blocks are still being dropped (strong references to the tasks)
        self._draining: set[asyncio.Task[None]] = set()
        #: runs the router's drains (cleared workers' old slots: ``Router.drain_step``)
        self._slot_drain: asyncio.Task[None] | None = None
        #: (model, lora) namespaces engines have stored blocks under (a Route outside all of them
        #: while some exist is a key mismatch, not a cold cache: _check_namespace)
        self.stored_namespaces: set[tuple[str, str]] = set()
        self._warned_namespaces: set[tuple[str, str]] = set()
        #: this process's epoch (PublishEventsResponse.router_epoch): a publisher that sees it change
        #: knows this router's view of its worker was not built from its stream, and resyncs
        self.epoch = secrets.randbits(64) or 1
        #: which kv_events_endpoints RegisterWorker may name (the daemon sets events.allowed_endpoints)
        self.allowed_endpoints = EndpointAllowList()
        self.route_message: Callable[[bytes], pb.RouteRequest | off_loop.SplitRoute | off_loop.Refused]
        self.route_stream_message: Callable[
            [bytes], pb.RouteStreamRequest | stream_wire.WireBatch | off_loop.SplitStream | off_loop.Refused]
        self.off_loop_prompt_bytes = 0  # sets the two
        #: what that thread runs (a test wraps it to see the loop serve calls meanwhile)
        self.hash_prompt: off_loop.HashPrompt = off_loop.hash_wire_prompt

    @property
    def off_loop_prompt_bytes(self) -> int:
        """A Route whose prompt field takes this many bytes or more, and the Routes of a
        RouteStream message of this many bytes or more, are decoded and hashed on a worker thread
        (the daemon sets limits.off_loop_prompt_bytes; 0 = never); a message of this size in an
        encoding the split does not read is refused, not parsed whole on the loop. Setting it sets
        the two request deserializers the daemon registers, ``route_message`` and ``route_stream_message``."""
        return self._off_loop_prompt_bytes

    @off_loop_prompt_bytes.setter
    def off_loop_prompt_bytes(self, value: int) -> None:
        self._off_loop_prompt_bytes = value
        #: Route's: a huge prompt stays wire bytes (``SplitRoute``), hashed off the loop by ``Route``
        self.route_message = off_loop.deserializer(pb.RouteRequest.FromString, off_loop.route_message, value)
        #: RouteStream's: a huge message's Routes' prompts stay wire bytes (``SplitStream``),
        #: hashed off the loop by ``RouteStream``
        self.route_stream_message = off_loop.deserializer(
            partial(stream_wire.stream_message, max_items=MAX_STREAM_BATCH_ITEMS), off_loop.route_stream_message, value)

    @property
    def stream_batch_bytes(self) -> int:
        """The most bytes RouteStream invites a batching client to put in one message: below
        ``off_loop_prompt_bytes``, so upb parses a batch whole on the loop (~0.5 us a Route) rather
        than the walk splitting its prompts out (~10 us a Route, in Python), which pays for a few
        huge prompts, not for a burst of ordinary ones. A Route too large for it alone still goes,
        in its own message, and is split; within ``max_message_bytes`` either way."""
        if not self._off_loop_prompt_bytes:
            return self.max_message_bytes
        return min(self.max_message_bytes, self._off_loop_prompt_bytes - 1)

    # ---- data path --------------------------------------------------------------------
    async def Route(self, request: pb.RouteRequest | off_loop.SplitRoute | off_loop.Refused,
                    context: grpc.aio.ServicerContext) -> pb.RouteResponse:
        started = _perf_counter()
        router = self.router
        hashed = None
        if type(request) is not pb.RouteRequest:  # a huge message: split, or refused (off_loop.route_message)
            if type(request) is off_loop.Refused:
                self._note_refused(request)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            request, hashed = await self._hash_off_loop(request, context)
        if self.tracing:
            with decision_span(self.tracer) as span:
                result = await self._route(request, context, span, hashed)
        elif self.waiting_admission is not None:
            result = await self._route(request, context, None, hashed)
        else:
            # the common case, kept flat: no span, no queue, no inner coroutine
            try:
                req = convert.route_request(request, router, hashed, context.peer() or "")
                result = self.route_now(req, False)
            except KVRouterError as exc:
                await self._reject(request, context, exc, None)
        d = result.decision
        self.metrics.route_decided(d.policy, d.reason, _perf_counter() - started, d.pool, d.pd_reason)
        if self.stored_namespaces and (not d.overlap_blocks or result.worker.mode is CacheMode.EVENTS):
            self._check_namespace(request)
        return convert.route_response(result, router.block_size)

    async def _hash_off_loop(
        self, split: off_loop.SplitRoute, context: grpc.aio.ServicerContext
    ) -> tuple[pb.RouteRequest, convert.HashedPrompt]:
        """Check a huge prompt's Route, decode and hash the prompt on a worker thread (the native
        path releases the GIL), so other calls run meanwhile; the decision that follows runs on
        the loop as for any Route. A message upb refuses gets upb's error, as from the deserializer."""
        try:
            prompt = await asyncio.to_thread(off_loop.hash_route, split, self.router, self.hash_prompt,
                                             self.router.adapter_bases())
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                describe(pb.RouteRequest.DESCRIPTOR.full_name, exc, len(split.prompt.data)))
        assert split.msg is not None  # else hash_route raised
        if isinstance(prompt.hashed, KVRouterError):
            await self._reject(split.msg, context, prompt.hashed, None)
        return split.msg, prompt.hashed

    async def _route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext, span: trace.Span | None,
        hashed: convert.HashedPrompt | None = None,
    ) -> RouteResult:
        router = self.router
        recording = span is not None and span.is_recording()
        try:
            req = convert.route_request(request, router, hashed, (context.peer() or "") if context is not None else "")
            if self.waiting_admission is None:
                result = self.route_now(req, recording)
            else:
                timeout = context.time_remaining() if context is not None else None
                result = await self.waiting_admission.route(req, timeout, recording)
        except KVRouterError as exc:
            await self._reject(request, context, exc, span)
        if recording:
            annotate_decision(span, result, router.block_size)  # type: ignore[arg-type]
        return result

    async def _reject(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext, exc: KVRouterError, span: trace.Span | None
    ) -> NoReturn:
        self._note_rejection(exc, span)
        await abort(context, exc)

    def _note_rejection(self, exc: KVRouterError, span: trace.Span | None) -> grpc.StatusCode:
        """Count a refused Route; its log line is the call's (``call_errors``, sampled)."""
        code = status_code(exc)
        self.metrics.route_errors.add(1, {"code": code.name})
        if span is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, status_message(exc)))
            span.set_attribute("rpc.grpc.status_code", code.value[0])
        return code

    def _note_refused(self, refused: off_loop.Refused) -> None:
        """A huge message in an encoding the split does not read (``off_loop.Refused``): counted
        as a rejected Route (its message tells what was found)."""
        self.metrics.route_errors.add(1, {"code": grpc.StatusCode.INVALID_ARGUMENT.name})

    async def Complete(self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        try:
            self._complete(request)
        except KVRouterError as exc:
            await abort(context, exc)
        return pb.CompleteResponse()

    def _complete(self, request: pb.CompleteRequest | stream_wire.WireComplete) -> None:
        completion = convert.completion(request, self.router.settings.max_id_length)
        # the model labels the Complete's metrics alone: looked up only while they are recorded
        model = self.router.request_model(completion.request_id) if self.metrics.recording_completions else ""
        if completion.prefill_done:
            # the prefill hop alone (router.disagg), or the first token of any request (with
            # its TTFT, which deadline admission learns from); the request's own Complete follows
            self.router.release_prefill(completion)
            if self.admission is not None:
                self.admission.on_first_token(completion)
            return
        entry = self.router.complete_anywhere(completion, checked=True)  # convert.completion checked it
        if entry is None:
            # replica sync: routed by another replica whose Dispatch has not arrived yet; the
            # completion is published, so every replica releases the load when the Dispatch
            # comes (the completion's TTFT and e2e are then in no replica's histograms)
            return
        self.metrics.completed(entry, completion, model or "", self.router.block_size)
        admission = self._admission  # not the property: a Python call a Complete
        if admission is not None:
            admission.on_complete(entry.worker_id, completion)

    @property
    def admission(self) -> AdmissionGate | None:
        """Admission (queues and/or deadline), None when both are off."""
        return self._admission

    @admission.setter
    def admission(self, gate: AdmissionGate | None) -> None:
        self._admission = gate
        self.waiting_admission = gate if gate is not None and gate.waits else None
        self.route_now = gate.route_now if gate is not None and not gate.waits else self.router.route

    async def RouteStream(
        self, request_iterator: AsyncIterator[pb.RouteStreamRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Route and Complete messages on one stream, each answered as its unary call would be.

        Without admission queues every message is answered before the next is read, in order,
        so the loop never creates a task; a batch's items are answered together in one batch.
        With queues a Route may wait, so each Route runs in its own task (answers then come out
        of order, a batched one on its own) and the stream ends once all are answered.
        A message of ``off_loop_prompt_bytes`` or more arrives split (``off_loop.SplitStream``):
        its Routes' prompts are hashed on a worker thread first, the next message read after. One
        in an encoding the split does not read (``off_loop.Refused``) is answered INVALID_ARGUMENT
        under its id, and the stream goes on.
        """
        # the advertisement a batching client waits for: batches welcome, up to this many bytes;
        # and the block size to key prompts with, for a client that sends keys
        await context.send_initial_metadata(((STREAM_BATCH_METADATA, str(self.stream_batch_bytes)),
                                             (STREAM_BLOCK_SIZE_METADATA, str(self.router.block_size))))
        write = context.write
        waiting: set[asyncio.Task[None]] = set()
        lock = asyncio.Lock()  # grpc allows one write in flight per call

        async def locked_write(reply: pb.RouteStreamResponse | bytes) -> None:
            async with lock:
                await write(reply)

        # only admitted routes' tasks write concurrently with this loop (admission is fixed at start-up)
        answer = write if self.waiting_admission is None else locked_write
        client = context.peer() or ""  # in-flight requests are bounded per client (RouteRequest.client)

        def admit_later(msg: pb.RouteStreamRequest, prompt: off_loop.StreamPrompt | None) -> None:
            task = asyncio.create_task(self._stream_route_admitted(msg, answer, prompt, client))
            waiting.add(task)
            task.add_done_callback(waiting.discard)

        try:
            async for msg in request_iterator:
                prompts = _NO_PROMPTS
                if type(msg) is not pb.RouteStreamRequest:
                    if type(msg) is stream_wire.WireBatch:  # a batch read from its bytes
                        if self.waiting_admission is None:
                            await answer(self._stream_wire_batch(msg, client))
                            continue
                        msg = msg.message()  # queued Routes wait as messages
                    elif type(msg) is off_loop.Refused:  # huge, in an encoding the split does not read
                        self._note_refused(msg)
                        if msg.id is None:  # no id to answer it under: the stream ends, as for bytes that do not parse
                            raise UndecodableMessage(msg.message)
                        await answer(self._stream_invalid(pb.RouteStreamResponse(id=msg.id), msg.message))
                        continue
                    else:  # huge: split (off_loop.route_stream_message)
                        msg, prompts = await self._hash_stream_off_loop(msg)
                kind = msg.WhichOneof("kind")
                if kind == "route":
                    if self.waiting_admission is None:
                        await answer(self._stream_route(msg, prompts.get(STREAM_ROUTE), client))
                    else:
                        admit_later(msg, prompts.get(STREAM_ROUTE))
                elif kind == "complete":
                    await answer(self._stream_complete(msg))
                elif kind == "batch":
                    reply = self._stream_batch(msg, admit_later, prompts, client)
                    if reply is not None:
                        await answer(reply)
                else:
                    await answer(self._stream_invalid(pb.RouteStreamResponse(id=msg.id),
                                                      "message carries neither route nor complete"))
            if waiting:
                await asyncio.gather(*waiting)
        finally:
            for task in waiting:  # the caller went away: give up the queued routes
                task.cancel()

    async def _hash_stream_off_loop(
        self, split: off_loop.SplitStream
    ) -> tuple[pb.RouteStreamRequest, Mapping[int, off_loop.StreamPrompt]]:
        """A split RouteStream message's Routes checked, their prompts decoded and hashed on a
        worker thread, all in one hand-off (the native path releases the GIL), so other calls run
        meanwhile; their decisions follow on the loop as for a parsed message."""
        try:
            hashed = await asyncio.to_thread(off_loop.hash_stream, split, self.router, self.hash_prompt,
                                             self.router.adapter_bases())
        except DecodeError as exc:  # as the deserializer would have raised it, for the same answer
            raise UndecodableMessage(describe(pb.RouteStreamRequest.DESCRIPTOR.full_name, exc, len(split.data))) from None
        assert split.msg is not None  # else hash_stream raised
        return split.msg, hashed

    def _stream_batch(
        self, msg: pb.RouteStreamRequest, admit_later: Callable[[pb.RouteStreamRequest, off_loop.StreamPrompt | None], None],
        prompts: Mapping[int, off_loop.StreamPrompt], client: str = "",
    ) -> pb.RouteStreamResponse | bytes | None:
        """One batch of stream messages: each item is handled as if it came alone, and the answers
        of all but the queued Routes (which answer when admitted) go back in one batch, made as
        wire bytes (``stream_answers``); a batch refused whole is answered as a message."""
        items = msg.batch.items
        if not items or len(items) > MAX_STREAM_BATCH_ITEMS:
            # refused whole, before any item is handled
            why = "the batch is empty" if not items else f"a batch holds at most {MAX_STREAM_BATCH_ITEMS} items, not {len(items)}"
            return self._stream_invalid(pb.RouteStreamResponse(id=msg.id), why)
        self.metrics.stream_batches.add(1)
        self.metrics.stream_batch_items.add(len(items))
        queued = self.waiting_admission is not None
        parts: list[bytes] = []  # the answers, as wire bytes (stream_answers)
        for place, item in enumerate(items):
            kind = item.WhichOneof("kind")
            if kind == "route" and queued:
                admit_later(item, prompts.get(place))
            else:
                parts.append(self._stream_item(item.id, kind, getattr(item, kind) if kind is not None else None,
                                               prompts.get(place), client))
        return stream_answers.batch_answer(parts) if parts else None

    def _stream_wire_batch(self, batch: stream_wire.WireBatch, client: str) -> bytes:
        """``_stream_batch`` of a batch read from its bytes (``stream_wire``; never with admission
        queues): each item's fields go to the native passes as read, the same answers."""
        items = batch.items
        self.metrics.stream_batches.add(1)
        self.metrics.stream_batch_items.add(len(items))
        return stream_answers.batch_answer([self._stream_item(item_id, kind, fields, None, client)
                                            for item_id, kind, fields in items])

    def _stream_item(self, item_id: int, kind: str | None, payload: Any, prompt: off_loop.StreamPrompt | None,
                     client: str) -> bytes:
        """The answer to one batch item, as wire bytes: ``payload`` is its Route or Complete
        (a message or, read from the batch's bytes, its fields: ``stream_wire``) by ``kind``."""
        if kind == "route":
            decided = self._stream_decided(item_id, payload, prompt, client)
            if type(decided) is pb.RouteStreamResponse:  # refused
                return stream_answers.message_answer(decided)
            try:
                return stream_answers.route_answer(item_id, decided, self.router.block_size)
            except Exception as exc:  # noqa: BLE001 - a bug fails this item only, the stream goes on
                return stream_answers.message_answer(self._stream_internal(pb.RouteStreamResponse(id=item_id), exc))
        if kind == "complete":
            refused = self._stream_completed(item_id, payload)
            if refused is None:
                return stream_answers.complete_answer(item_id)
            return stream_answers.message_answer(refused)
        why = ("a batch item cannot itself be a batch" if kind == "batch"
               else "message carries neither route nor complete")
        return stream_answers.message_answer(self._stream_invalid(pb.RouteStreamResponse(id=item_id), why))

    def _stream_route(self, msg: pb.RouteStreamRequest, prompt: off_loop.StreamPrompt | None = None,
                      client: str = "") -> pb.RouteStreamResponse:
        """The answer to a stream message that is one Route (``_stream_decided``), as a message."""
        decided = self._stream_decided(msg.id, msg.route, prompt, client)
        if type(decided) is pb.RouteStreamResponse:
            return decided
        reply = pb.RouteStreamResponse(id=msg.id)
        try:
            convert.route_response(decided, self.router.block_size, into=reply.route)
        except Exception as exc:  # noqa: BLE001 - a bug fails this item only, the stream goes on
            return self._stream_internal(reply, exc)
        return reply

    def _stream_decided(
        self, item_id: int, request: pb.RouteRequest | stream_wire.WireRoute,
        prompt: off_loop.StreamPrompt | None = None, client: str = "",
    ) -> RouteResult | pb.RouteStreamResponse:
        """Decide stream message ``item_id``'s Route (a message, or its fields as read from a
        batch's bytes: ``stream_wire``): its result, or the answer refusing it (``item_id``'s
        error); ``prompt``: its prompt when the message was split (``_hash_stream_off_loop``)."""
        started = _perf_counter() if prompt is None else _perf_counter() - prompt.seconds
        router = self.router
        try:
            if self.tracing:
                with decision_span(self.tracer) as span:
                    recording = span.is_recording()
                    try:
                        req = off_loop.split_route_request(request, router, prompt, client)
                        result = self.route_now(req, recording)
                    except KVRouterError as exc:
                        return self._stream_route_error(exc, span, pb.RouteStreamResponse(id=item_id))
                    if recording:
                        annotate_decision(span, result, router.block_size)
            else:
                req = off_loop.split_route_request(request, router, prompt, client)
                result = self.route_now(req, False)
            d = result.decision
            self.metrics.route_decided(d.policy, d.reason, _perf_counter() - started, d.pool, d.pd_reason)
            if self.stored_namespaces and (not d.overlap_blocks or result.worker.mode is CacheMode.EVENTS):
                self._check_namespace(req)
        except KVRouterError as exc:
            return self._stream_route_error(exc, None, pb.RouteStreamResponse(id=item_id))
        except Exception as exc:  # noqa: BLE001 - a bug fails this item only, the stream goes on
            return self._stream_internal(pb.RouteStreamResponse(id=item_id), exc)
        return result

    def _stream_internal(self, reply: pb.RouteStreamResponse, exc: Exception) -> pb.RouteStreamResponse:
        """An item that raised what no handler expected: INTERNAL for it alone (the API's promise:
        each item is answered as its unary call would be), counted and logged by ``call_errors``."""
        reply.error.code = grpc.StatusCode.INTERNAL.value[0]
        reply.error.message = self.call_errors.internal("RouteStream", exc)
        return reply

    def _stream_invalid(self, reply: pb.RouteStreamResponse, message: str) -> pb.RouteStreamResponse:
        code = grpc.StatusCode.INVALID_ARGUMENT
        reply.error.code = code.value[0]
        reply.error.message = message
        self.call_errors.rejected("RouteStream", code.name, message)
        return reply

    async def _stream_route_admitted(
        self, msg: pb.RouteStreamRequest, answer: Callable[[pb.RouteStreamResponse], Awaitable[None]],
        prompt: off_loop.StreamPrompt | None = None, client: str = "",
    ) -> None:
        assert self.waiting_admission is not None
        started = _perf_counter() if prompt is None else _perf_counter() - prompt.seconds
        request = msg.route
        router = self.router
        reply = pb.RouteStreamResponse(id=msg.id)
        try:
            with decision_span(self.tracer) as span:
                recording = self.tracing and span.is_recording()
                try:
                    check_range("timeout_ms", msg.timeout_ms, 0.0, MAX_LATENCY_MS)
                    timeout = msg.timeout_ms / 1000 if msg.timeout_ms > 0 else None
                    req = off_loop.split_route_request(request, router, prompt, client)
                    result = await asyncio.wait_for(self.waiting_admission.route(req, timeout, recording), timeout)
                except KVRouterError as exc:
                    await answer(self._stream_route_error(exc, span if self.tracing else None, reply))
                    return
                except TimeoutError:
                    # what a unary caller's expired deadline would have ended with; the queue entry is gone
                    code = grpc.StatusCode.DEADLINE_EXCEEDED
                    self.metrics.route_errors.add(1, {"code": code.name})
                    reply.error.code = code.value[0]
                    reply.error.message = f"not admitted within {msg.timeout_ms:g} ms"
                    self.call_errors.rejected("RouteStream", code.name, reply.error.message)
                    await answer(reply)
                    return
                if recording:
                    annotate_decision(span, result, router.block_size)
            d = result.decision
            self.metrics.route_decided(d.policy, d.reason, _perf_counter() - started, d.pool, d.pd_reason)
            if self.stored_namespaces and (not d.overlap_blocks or result.worker.mode is CacheMode.EVENTS):
                self._check_namespace(request)
            convert.route_response(result, router.block_size, into=reply.route)
        except Exception as exc:  # noqa: BLE001 - a bug fails this item only, the stream goes on
            self._stream_internal(reply, exc)
        await answer(reply)

    def _check_namespace(self, request: pb.RouteRequest | RouteRequest) -> None:
        """A Route that matched nothing, under a model/LoRA no engine ever stored blocks for while
        others did: almost surely the gateway and the engines name the model differently (keys are
        salted with both), a silent 0% hit rate. Counted every time, logged once per namespace.
        Routes to events-mode workers are checked even when they matched: what they matched
        under such a namespace can only be the router's own speculative blocks."""
        namespace = (request.model, request.lora)
        if namespace in self.stored_namespaces or len(self.stored_namespaces) >= MAX_NAMESPACES:
            return
        self.metrics.namespace_misses.add(1, {"model": request.model, "lora": request.lora})
        if namespace not in self._warned_namespaces and len(self._warned_namespaces) < MAX_NAMESPACES:
            self._warned_namespaces.add(namespace)
            known = ", ".join(f"model={m!r} lora={lo!r}" for m, lo in sorted(self.stored_namespaces)[:16])
            log.warning(
                "Route for model=%r lora=%r: no engine has stored blocks under that name, only under %s; "
                "gateways and engines must pass the same model and lora (they salt the block keys)",
                request.model, request.lora, known,
            )

    def _stream_route_error(
        self, exc: KVRouterError, span: trace.Span | None, reply: pb.RouteStreamResponse
    ) -> pb.RouteStreamResponse:
        code = self._note_rejection(exc, span)
        reply.error.code = code.value[0]
        reply.error.message = status_message(exc)
        self.call_errors.rejected("RouteStream", code.name, reply.error.message)
        return reply

    def _stream_complete(self, msg: pb.RouteStreamRequest) -> pb.RouteStreamResponse:
        """The answer to a stream message that is one Complete (``_stream_completed``), as a message."""
        refused = self._stream_completed(msg.id, msg.complete)
        if refused is not None:
            return refused
        reply = pb.RouteStreamResponse(id=msg.id)
        reply.complete.SetInParent()
        return reply

    def _stream_completed(self, item_id: int, request: pb.CompleteRequest | stream_wire.WireComplete
                          ) -> pb.RouteStreamResponse | None:
        """Apply stream message ``item_id``'s Complete (a message, or its fields as read from a
        batch's bytes: ``stream_wire``): None, or the answer refusing it (``item_id``'s error)."""
        try:
            self._complete(request)
        except KVRouterError as exc:
            reply = pb.RouteStreamResponse(id=item_id)
            code = status_code(exc)
            reply.error.code = code.value[0]
            reply.error.message = status_message(exc)
            self.call_errors.rejected("RouteStream", code.name, reply.error.message)
            return reply
        except Exception as exc:  # noqa: BLE001 - a bug fails this item only, the stream goes on
            return self._stream_internal(pb.RouteStreamResponse(id=item_id), exc)
        return None

    # ---- control plane ------------------------------------------------------------------
    async def RegisterWorker(
        self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterWorkerResponse:
        try:
            spec = convert.worker_spec(request.worker)
            self.router.check_worker_sizes(spec)  # first: the checks below quote the spec
            if spec.address and not is_host_port(spec.address):  # the simulator's workers need not be
                raise InvalidRequest(f"worker {spec.id!r}: address {quote(spec.address)} must be HOST:PORT "
                                     "(IPv6 as [ADDR]:PORT), the endpoint gateways send requests to")
            if spec.kv_events_endpoint:  # before anything changes
                check_worker_endpoints(self.allowed_endpoints, spec.id, spec.address, spec.kv_events_endpoint)
            worker = self.router.add_worker(spec)
        except KVRouterError as exc:
            await abort(context, exc)
        self.keep_draining()  # a mode change clears the worker's view: a large one in steps
        self.on_membership_change()
        return pb.RegisterWorkerResponse(worker=self._worker_message(worker))

    async def DeregisterWorker(
        self, request: pb.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterWorkerResponse:
        try:
            convert.check_id("worker_id", request.worker_id, self.router.settings.max_id_length)
            drained = self.forget_worker(request.worker_id)
        except KVRouterError as exc:
            await abort(context, exc)
        self.on_membership_change()
        # answer once the blocks are gone; a caller that gives up does not stop the drain
        await asyncio.shield(drained)
        return pb.DeregisterWorkerResponse()

    def forget_worker(self, worker_id: str) -> asyncio.Task[None]:
        """Remove a worker from routing now and drop its blocks from the index in steps of
        ``DRAIN_STEP_BLOCKS``, yielding to the loop between them (the returned task)."""
        _, steps = self.router.detach_worker(worker_id, DRAIN_STEP_BLOCKS)
        if self.admission is not None:
            self.admission.drop_worker(worker_id)
        self.metrics.forget_worker(worker_id)  # its per-worker series go with it
        task = asyncio.create_task(_drain(steps), name=f"drop blocks of {worker_id}")
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)
        return task

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext) -> pb.ListWorkersResponse:
        try:
            workers, token = worker_page(self.router.workers, self._worker_message, request.page_size,
                                         request.page_token, self._page_bytes)
        except KVRouterError as exc:
            await abort(context, exc)
        return pb.ListWorkersResponse(workers=workers, next_page_token=token)

    async def ExportIndex(
        self, request: pb.ExportIndexRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IndexChunk]:
        try:
            if len(request.worker_ids) > MAX_WORKERS:
                raise InvalidRequest(f"{len(request.worker_ids)} worker_ids; at most {MAX_WORKERS} workers exist")
            for worker_id in request.worker_ids:
                convert.check_id("worker_ids[]", worker_id, self.router.settings.max_id_length)
            async for chunk in export_chunks(self.router, tuple(request.worker_ids), request.max_blocks_per_chunk):
                yield chunk
        except KVRouterError as exc:
            await abort(context, exc)

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        r = self.router
        # a summary: ListWorkers pages through the rest
        first, _ = worker_page(r.workers, self._worker_message, max_bytes=self._page_bytes)
        return pb.GetStatsResponse(
            indexed_blocks=r.indexed_blocks,
            workers=first,
            worker_count=len(r.workers),
            default_routing_policy=r.default_routing,
            default_eviction_policy=r.eviction.name,
            decisions_by_policy=dict(r.decisions_by_policy),
            event_batches_applied=r.counters["batches_applied"],
            event_gaps=r.counters["gaps"],
            events_rejected=_sum_by_reason(w.events_rejected for w in r.workers),
        )

    @property
    def _page_bytes(self) -> int:
        """A page of workers' most bytes: room beside it for the rest of a reply the daemon may send."""
        return min(PAGE_BYTES, self.max_message_bytes // 2)

    def _worker_message(self, worker) -> pb.Worker:  # type: ignore[no-untyped-def]
        router = self.router
        return convert.worker_message(worker, self._cached_blocks(worker), router.block_size, router.clock.now())

    def _cached_blocks(self, worker) -> int:  # type: ignore[no-untyped-def]
        """The worker's blocks as its engine reported them: the index's, less the speculative
        ones its engine has not stored yet (``kvrouter.speculative.live_blocks`` counts those)."""
        return self.router.index.count(worker.slot) - self.router.speculative.live_on(worker.id)

    def worker_modes(self):  # type: ignore[no-untyped-def]
        """(id, mode, state, cached blocks) per worker, for the metrics gauges."""
        for w in self.router.workers:
            mode = "events" if w.mode is CacheMode.EVENTS else "approximate"
            yield w.id, mode, w.state.name.lower(), self._cached_blocks(w)


def _sum_by_reason(per_worker: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in per_worker:
        for reason, n in counts.items():
            total[reason] = total.get(reason, 0) + n
    return total

