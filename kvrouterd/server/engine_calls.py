"""The engines' calls to the KVRouter service: PublishEvents (with every batch's apply), ReportLoad, EvictHint.

``EngineCalls`` is the part of ``KVRouterService`` (one of its bases) that engines and their
publishers talk to, apart from the gateways' data path and the control plane in ``service``.
It reads the servicer's state declared below, which ``KVRouterService.__init__`` sets. The ZMQ
subscribers and the event bus apply their batches through ``apply_batch`` as well, so every
batch gets the same span and metrics; the old slots a Cleared or a mode change leaves the
Router draining are dropped in steps by ``keep_draining``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from ..errors import KVRouterError
from ..protocols import BatchOutcome, EventBatch, Stored
from ..router import Router
from ..telemetry.metrics import Metrics
from ..telemetry.tracing import annotate_batch
from . import convert
from .convert import pb
from .status import abort, status_message

__all__ = ["EVICT_STEP_ENTRIES", "MAX_NAMESPACES", "EngineCalls"]

#: (model, lora) namespaces remembered for the key-mismatch warning: names come from clients,
#: so the sets are capped (past the cap the check is off; a fleet serves a handful of models)
MAX_NAMESPACES = 1024

#: entries of work an EvictHint does between yields to the loop: its first hint's engine-hash
#: map, the leaves a policy without its own order scores, the ranking (``Router.evict_hint_steps``);
#: ~1-2 ms a part idle at 512 (scoring a leaf costs 1.5-3 us in Python)
EVICT_STEP_ENTRIES = 512


class EngineCalls:
    """PublishEvents, ReportLoad and EvictHint, and ``apply_batch``, which every engine batch goes through."""

    # what this part reads of the servicer (KVRouterService.__init__ sets them)
    router: Router
    metrics: Metrics
    tracing: bool
    tracer: trace.Tracer
    batch_limits: convert.BatchLimits
    epoch: int
    stored_namespaces: set[tuple[str, str]]
    _draining: set[asyncio.Task[None]]
    _slot_drain: asyncio.Task[None] | None

    def event_batch_message(self, data: bytes) -> EventBatch | pb.EventBatch | convert.BatchTooLarge:
        """PublishEvents' request deserializer, which the daemon registers: a plain message read
        natively into its core batch, one over the byte limit left unparsed, anything else parsed
        (``convert.event_batch_message``)."""
        return convert.event_batch_message(data, self.batch_limits)

    async def PublishEvents(
        self, request_iterator: AsyncIterator[pb.EventBatch | EventBatch | convert.BatchTooLarge],
        context: grpc.aio.ServicerContext,
    ) -> pb.PublishEventsResponse:
        limits = self.batch_limits
        summary = pb.PublishEventsResponse(router_epoch=self.epoch, max_event_batch_bytes=limits.max_bytes,
                                           max_batch_blocks=limits.max_blocks)
        published: dict[str, None] = {}  # workers named, in order
        async for msg in request_iterator:
            if type(msg) is convert.BatchTooLarge:
                # refused unparsed (no worker to name); earlier batches of the stream stay applied
                # (counted and logged, sampled, as every refused call is: call_errors)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, msg.message)
            try:
                # the daemon's deserializer (event_batch_message) has read a plain message already
                batch = msg if isinstance(msg, EventBatch) else convert.event_batch(msg, limits)
                outcome = self.apply_batch(batch)
            except KVRouterError as exc:
                # earlier batches of the stream stay applied; this one changed nothing
                await abort(context, exc)
            published[batch.worker_id] = None
            if outcome.duplicate:
                summary.batches_duplicate += 1
                continue
            summary.batches_applied += 1
            summary.blocks_stored += outcome.blocks_stored
            summary.blocks_removed += outcome.blocks_removed
            summary.gaps_detected += 1 if outcome.gap else 0
        if self._slot_drain is not None and not self._slot_drain.done():
            # a Cleared in this stream: answer once the old blocks are gone, as DeregisterWorker does
            await asyncio.shield(self._slot_drain)
        for worker_id in published:
            worker = self.router.workers.find(worker_id)
            if worker is not None:  # else deregistered meanwhile
                summary.workers.add(worker_id=worker_id, last_sequence=worker.last_sequence,
                                    resync_needed=worker.resync_needed)
        return summary

    def apply_batch(self, batch: EventBatch, per_event: bool = False) -> BatchOutcome:
        """Apply one engine batch with its span and metrics: the gRPC stream and the ZMQ
        subscribers both come through here (ZMQ engine batches event by event: ``Router.apply``)."""
        if self.tracing:
            with self.tracer.start_as_current_span("kvrouter.events.apply") as span:
                outcome = self._apply_traced(batch, per_event, span)
        else:
            # no span when tracing is off: entering even the no-op one costs 35,400 instructions
            # (callgrind), 69 per block of a 512-block batch
            outcome = self._apply_traced(batch, per_event, None)
        if outcome.duplicate:
            self.metrics.event_batches.count("duplicate")
            return outcome
        self.metrics.event_batches.count("applied")
        if outcome.blocks_stored:
            self.metrics.blocks.count("stored", outcome.blocks_stored)
            namespaces = self.stored_namespaces
            for ev in batch.events:
                if type(ev) is Stored and (ev.model, ev.lora) not in namespaces and len(namespaces) < MAX_NAMESPACES:
                    namespaces.add((ev.model, ev.lora))
        if outcome.blocks_removed:
            self.metrics.blocks.count("removed", outcome.blocks_removed)
        if outcome.gap or outcome.restarted:
            self.metrics.gaps.add(1, {"worker": batch.worker_id, "kind": "gap" if outcome.gap else "restart"})
        if self.router.draining:
            self.keep_draining()
        return outcome

    def keep_draining(self) -> None:
        """Run the router's pending drains (a large cleared worker's old slot, ``Router.drain_step``)
        in a task that yields to the loop between steps, unless one already does."""
        if (self._slot_drain is None or self._slot_drain.done()) and self.router.draining:
            self._slot_drain = asyncio.create_task(self._drain_slots(), name="drop cleared workers' old blocks")
            self._draining.add(self._slot_drain)
            self._slot_drain.add_done_callback(self._draining.discard)

    async def _drain_slots(self) -> None:
        while self.router.drain_step():
            await asyncio.sleep(0)

    def _apply_traced(self, batch: EventBatch, per_event: bool, span: trace.Span | None) -> BatchOutcome:
        try:
            outcome = self.router.apply(batch, per_event=per_event)
        except KVRouterError as exc:
            if span is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, status_message(exc)))
            self.metrics.event_batches.count("rejected")
            raise
        if span is not None and span.is_recording():
            annotate_batch(span, batch, outcome)
        return outcome

    async def ReportLoad(self, request: pb.ReportLoadRequest, context: grpc.aio.ServicerContext) -> pb.ReportLoadResponse:
        try:
            convert.check_id("worker_id", request.worker_id, self.router.settings.max_id_length)
            loaded = request.loaded_loras.names if request.HasField("loaded_loras") else None
            self.router.report_load(
                request.worker_id, request.queued_requests, request.running_requests, request.kv_utilization,
                None if loaded is None else list(loaded),
            )
        except KVRouterError as exc:
            await abort(context, exc)
        return pb.ReportLoadResponse()

    async def EvictHint(self, request: pb.EvictHintRequest, context: grpc.aio.ServicerContext) -> pb.EvictHintResponse:
        try:
            req, pinned_hashes = convert.evict_request(request, self.router)
            # what visits a whole worker runs in steps, the loop serving other calls between them
            steps = self.router.evict_hint_steps(req, pinned_hashes, EVICT_STEP_ENTRIES)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    advice = done.value
                    break
                await asyncio.sleep(0)
        except KVRouterError as exc:
            await abort(context, exc)
        return pb.EvictHintResponse(
            keys=advice.keys, engine_hashes=advice.engine_hashes, exhausted=advice.exhausted, policy=advice.policy
        )
