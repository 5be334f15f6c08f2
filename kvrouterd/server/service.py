"""The kvrouter.v1.KVRouter gRPC servicer: converts, calls the Router, records telemetry.

Here are the servicer's state and the control plane; the gateways' data path (Route, Complete,
RouteStream) is its base ``gateway_calls.GatewayCalls``, the engines' calls (PublishEvents,
ReportLoad, EvictHint) its base ``engine_calls.EngineCalls``.
All handlers run on the daemon's single event loop and call the synchronous Router
directly, so decisions and event application never interleave mid-operation.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

import grpc
from opentelemetry import trace

from .._generated.kvrouter.v1 import router_pb2_grpc
from ..config import LimitsConfig
from ..errors import InvalidRequest, KVRouterError, quote
from ..events.endpoints import EndpointAllowList, check_worker_endpoints
from ..index.workers import MAX_WORKERS, is_host_port
from ..protocols import CacheMode, RouteRequest
from ..router import DRAIN_STEP_BLOCKS, Router, RouteResult
from ..telemetry.metrics import Metrics
from . import convert, off_loop
from .admission import AdmissionGate
from .call_errors import CallErrors
from .convert import pb
from .engine_calls import EngineCalls
from .gateway_calls import MAX_STREAM_BATCH_ITEMS, STREAM_BATCH_METADATA, STREAM_BLOCK_SIZE_METADATA, GatewayCalls
from .snapshot import export_chunks
from .status import abort
from .worker_pages import PAGE_BYTES, worker_page

__all__ = ["MAX_STREAM_BATCH_ITEMS", "STREAM_BATCH_METADATA", "STREAM_BLOCK_SIZE_METADATA", "KVRouterService"]

log = logging.getLogger("kvrouterd.server")


async def _drain(steps: Iterable[int]) -> None:
    for _ in steps:
        await asyncio.sleep(0)


class KVRouterService(GatewayCalls, EngineCalls, router_pb2_grpc.KVRouterServicer):
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
        self.off_loop_prompt_bytes = 0  # sets route_message and route_stream_message
        #: what that thread runs (a test wraps it to see the loop serve calls meanwhile)
        self.hash_prompt: off_loop.HashPrompt = off_loop.hash_wire_prompt

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

