"""The gateways' calls to the KVRouter service: Route, Complete and RouteStream, the data path.

``GatewayCalls`` is the part of ``KVRouterService`` (one of its bases) that gateways and the
SDK's ``RouterClient`` call for every request, apart from the engines' calls
(``engine_calls``) and the control plane in ``service``. It reads the servicer's state
declared below, which ``KVRouterService.__init__`` sets. A Route is converted (natively where
the prompt comes packed), decided and committed in one synchronous step, or waits in an
admission queue; RouteStream answers each message, or each item of a batch, as its unary call
would be answered, a batch's items together in one answer written as wire bytes
(``stream_answers``), a batch read from its own bytes where it has the plain form
(``stream_wire``). A message too large to hash on the loop is split and hashed on a worker
thread (``off_loop``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from ..bounds import MAX_LATENCY_MS, check_range
from ..errors import KVRouterError
from ..index import native
from ..protocols import CacheMode, RouteRequest
from ..router import Router, RouteResult
from ..telemetry.metrics import Metrics
from ..telemetry.tracing import annotate_decision, decision_span
from . import convert, off_loop, stream_answers, stream_wire
from .admission import AdmissionGate
from .call_errors import CallErrors
from .convert import pb
from .decoding import UndecodableMessage, describe
from .engine_calls import MAX_NAMESPACES
from .status import abort, status_code, status_message
from .wire import STREAM_ROUTE

__all__ = ["MAX_STREAM_BATCH_ITEMS", "STREAM_BATCH_METADATA", "STREAM_BLOCK_SIZE_METADATA", "GatewayCalls"]

log = logging.getLogger("kvrouterd.server")

_perf_counter = time.perf_counter
#: a batch's Complete applied and answered in one native call (``_complete_plan``)
_native_stream_complete = native.module.stream_complete if native.module is not None else None


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


class GatewayCalls:
    """Route, Complete and RouteStream, with the deserializers the daemon registers for them."""

    # what this part reads of the servicer (KVRouterService.__init__ sets them)
    router: Router
    metrics: Metrics
    tracing: bool
    tracer: trace.Tracer
    call_errors: CallErrors
    _admission: AdmissionGate | None
    waiting_admission: AdmissionGate | None
    route_now: Callable[[RouteRequest, bool], RouteResult]
    max_message_bytes: int
    stored_namespaces: set[tuple[str, str]]
    _warned_namespaces: set[tuple[str, str]]
    _off_loop_prompt_bytes: int
    route_message: Callable[[bytes], pb.RouteRequest | off_loop.SplitRoute | off_loop.Refused]
    route_stream_message: Callable[
        [bytes], pb.RouteStreamRequest | stream_wire.WireBatch | off_loop.SplitStream | off_loop.Refused]
    hash_prompt: off_loop.HashPrompt

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
        ``off_loop_prompt_bytes``, so a batch is read whole on the loop (``stream_wire``: ~0.3 us
        an item) rather than the walk splitting its prompts out (~10 us a Route, in Python), which
        pays for a few huge prompts, not for a burst of ordinary ones. A Route too large for it
        alone still goes, in its own message, and is split; within ``max_message_bytes`` either way."""
        if not self._off_loop_prompt_bytes:
            return self.max_message_bytes
        return min(self.max_message_bytes, self._off_loop_prompt_bytes - 1)

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
        plan = self._complete_plan()
        parts: list[bytes] = []  # the answers, as wire bytes (stream_answers)
        for place, item in enumerate(items):
            kind = item.WhichOneof("kind")
            if kind == "route" and queued:
                admit_later(item, prompts.get(place))
            else:
                parts.append(self._stream_item(item.id, kind, getattr(item, kind) if kind is not None else None,
                                               prompts.get(place), client, plan))
        return stream_answers.batch_answer(parts) if parts else None

    def _stream_wire_batch(self, batch: stream_wire.WireBatch, client: str) -> bytes:
        """``_stream_batch`` of a batch read from its bytes (``stream_wire``; never with admission
        queues): each item's fields go to the native passes as read, the same answers."""
        items = batch.items
        self.metrics.stream_batches.add(1)
        self.metrics.stream_batch_items.add(len(items))
        plan = self._complete_plan()
        return stream_answers.batch_answer([self._stream_item(item_id, kind, fields, None, client, plan)
                                            for item_id, kind, fields in items])

    def _complete_plan(self) -> tuple[Any, ...] | None:
        """What the native ``stream_complete`` reads to apply and answer a batch's Complete in
        one call, read once per batch; None where its Completes take the Python path: without
        the native module, with admission queues (a Complete admits what waits), while
        completions are recorded (``Metrics.recording_completions``), or while a routing
        policy hears them (``Router.finish_plan``)."""
        if _native_stream_complete is None or self.waiting_admission is not None or self.metrics.recording_completions:
            return None
        router = self.router
        finish = router.finish_plan()
        if finish is None:
            return None
        guard = self._admission.guard if self._admission is not None else None
        return (*convert.completion_reading(router.settings.max_id_length), *finish, guard, router.clock.now)

    def _stream_item(self, item_id: int, kind: str | None, payload: Any, prompt: off_loop.StreamPrompt | None,
                     client: str, complete_plan: tuple[Any, ...] | None = None) -> bytes:
        """The answer to one batch item, as wire bytes: ``payload`` is its Route or Complete
        (a message or, read from the batch's bytes, its fields: ``stream_wire``) by ``kind``;
        ``complete_plan``: the batch's ``_complete_plan``."""
        if kind == "route":
            decided = self._stream_decided(item_id, payload, prompt, client)
            if type(decided) is pb.RouteStreamResponse:  # refused
                return stream_answers.message_answer(decided)
            try:
                return stream_answers.route_answer(item_id, decided, self.router.block_size)
            except Exception as exc:  # noqa: BLE001 - a bug fails this item only, the stream goes on
                return stream_answers.message_answer(self._stream_internal(pb.RouteStreamResponse(id=item_id), exc))
        if kind == "complete":
            done = self._stream_completed(item_id, payload, complete_plan)
            if done is None:
                return stream_answers.complete_answer(item_id)
            if isinstance(done, bytes):  # applied and answered natively
                return done
            return stream_answers.message_answer(done)
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
        refused = self._stream_completed(msg.id, msg.complete)  # no plan: never bytes
        if isinstance(refused, pb.RouteStreamResponse):
            return refused
        reply = pb.RouteStreamResponse(id=msg.id)
        reply.complete.SetInParent()
        return reply

    def _stream_completed(self, item_id: int, request: pb.CompleteRequest | stream_wire.WireComplete,
                          plan: tuple[Any, ...] | None = None) -> pb.RouteStreamResponse | bytes | None:
        """Apply stream message ``item_id``'s Complete (a message, or its fields as read from a
        batch's bytes: ``stream_wire``): None, or the answer refusing it (``item_id``'s error);
        with its batch's ``plan`` (``_complete_plan``) natively where it can, answered then
        (its bytes), else as ``_complete`` applies it."""
        try:
            if plan is not None:
                answered = _native_stream_complete(plan, item_id, request)  # type: ignore[misc]
                if answered is not NotImplemented:
                    return answered  # type: ignore[no-any-return]
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
