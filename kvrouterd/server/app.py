"""Run the gRPC daemon.

Life cycle: load config -> build the Router (static workers registered) -> start the gRPC
server (KVRouter, health, reflection) -> start periodic maintenance -> health SERVING ->
serve until SIGINT/SIGTERM -> health NOT_SERVING, stop accepting, drain in-flight RPCs for
the grace period, stop maintenance, flush traces.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import random
import signal
import socket
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace.export import SpanExporter

from .. import grpc_runtime
from .._generated.kvrouter.v1 import router_pb2, router_pb2_grpc
from ..clock import Clock, SystemClock
from ..config import ENV_PREFIX, Config, load_config
from ..decimals import decimal_arg, number_arg, parse_decimal
from ..discovery import KubernetesDiscovery
from ..errors import ConfigError, InvalidRequest, KVRouterError
from ..events.bridge import BridgedEvents
from ..events.endpoints import check_worker_endpoints
from ..events.nats_bus import BusEventSource
from ..events.replica_sync import ReplicaSync
from ..events.zmq_source import ZmqEventSource
from ..index import native
from ..index.workers import WorkerSpec
from ..protocols import BatchOutcome, Completion, Dispatch, EventBatch
from ..router import Router, RouteResult
from ..tasks import stop_task
from ..telemetry.bus_metrics import register_bus_metrics
from ..telemetry.loop_lag import LoopMonitor, freeze_heap, unfreeze_heap
from ..telemetry.loop_reads import LoopReads
from ..telemetry.metrics import Metrics, build_meter_provider
from ..telemetry.prometheus import MetricsEndpoint, register_ops_metrics
from ..telemetry.tracing import ServerSpans, build_tracer_provider, service_name
from . import convert
from .admission import AdmissionGate
from .bus_resync import BusResyncAsker
from .decoding import SafeRegistrar
from .ext_proc import EXT_PROC_SERVICE, ExtProcService
from .logs import configure_logging
from .reload import ConfigReloader
from .security import CertificateFiles, build_interceptors, client_token, server_credentials
from .service import KVRouterService
from .snapshot import encode_snapshot_aside, restore_snapshot, snapshot_position, warm_from_peer
from .stream_answers import passes_bytes

__all__ = ["Daemon", "add_arguments", "run"]

log = logging.getLogger("kvrouterd.server")

#: how long start-up waits for the first Kubernetes pod listing before serving anyway
DISCOVERY_SYNC_TIMEOUT_S = 30.0

KVROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["KVRouter"].full_name
#: health service names the Gateway API Inference Extension's endpoint-picker protocol probes
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"


class Daemon:
    """One kvrouterd process: a Router behind a grpc.aio server."""

    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        span_exporter: SpanExporter | None = None,
        metric_readers: Sequence[MetricReader] = (),
        seed: int | None = None,
        config_path: str | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> None:
        self.config = config
        self.router = Router(config.router_settings(), clock or SystemClock(), random.Random(seed))
        for w in config.workers:
            self.router.add_worker(w.to_spec(config.block_size))
        tel = config.telemetry
        name = service_name(tel.service_name)
        self.tracer_provider = build_tracer_provider(name, tel.traces, span_exporter)
        self.tracer = self.tracer_provider.get_tracer("kvrouterd") if self.tracer_provider else None
        #: Prometheus /metrics, fed by the same MeterProvider as OTLP (None when metrics.listen is empty)
        self.metrics_endpoint = MetricsEndpoint(config.metrics.listen) if config.metrics.listen else None
        if self.metrics_endpoint is not None:
            metric_readers = [*metric_readers, self.metrics_endpoint.reader]
        self.meter_provider = build_meter_provider(name, metric_readers)
        #: runs the observable instruments' callbacks (router state) on this daemon's event loop
        #: for collections on other threads (a scrape, an OTLP export)
        self.loop_reads = LoopReads()
        #: scrape-time router metrics; event sources attach with ops_metrics.add_event_source
        self.ops_metrics = register_ops_metrics(self.meter_provider, self.router, self.loop_reads)
        #: event-loop lag and gc pauses, and a warning naming what blocked the loop
        self.loop_monitor = LoopMonitor(self.meter_provider, tel.loop_stall_warn_ms / 1000.0)
        #: SIGHUP / file-change reload of routing policy parameters
        self.reloader = ConfigReloader(self.router, config, config_path, overrides)
        self._watch: asyncio.Task[None] | None = None
        #: the TLS files being watched (None without TLS)
        self.certificates: CertificateFiles | None = None
        self.service = KVRouterService(
            self.router, self.tracer, None, config.limits.max_batch_events, config.limits.max_message_bytes,  # type: ignore[arg-type]
            max_event_batch_bytes=config.limits.max_event_batch_bytes, max_batch_blocks=config.limits.max_batch_blocks,
        )
        self.admission = AdmissionGate(self.router, config.admission) if config.admission.enabled else None
        self.service.admission = self.admission
        self.ops_metrics.admission = self.admission
        self.service.allowed_endpoints = config.events.allow_list
        self.events: ZmqEventSource | None = None
        #: the shared event stream replicas follow (events.bus; None without one)
        self.bus: BusEventSource | None = None
        #: in-flight load and approximate prefixes shared with the other replicas (None: not shared)
        self.sync: ReplicaSync | None = None
        #: asks bus publishers to resync workers whose view lost events (None without a bus)
        self.resync_asker: BusResyncAsker | None = None
        self._resync_asks: asyncio.Task[None] | None = None
        self._snapshots: asyncio.Task[None] | None = None
        self.discovery: KubernetesDiscovery | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        speculative = self.router.speculative
        self.metrics = Metrics(self.meter_provider, lambda: self.router.indexed_blocks, self.service.worker_modes,
                               speculative=lambda: (speculative.outcomes, speculative.live),
                               decode_workers_without_events=lambda: self.router.decode_workers_without_events(),
                               loop_reads=self.loop_reads)
        self.service.metrics = self.metrics
        self.service.call_errors.metrics = self.metrics
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        #: the Envoy endpoint picker, once serving (None when ext_proc.enabled is off)
        self.ext_proc: ExtProcService | None = None
        self.port = 0
        self._maintenance: asyncio.Task[None] | None = None
        #: start() completed (stop() after a failed start closes quietly)
        self.serving = False

    def _server_options(self) -> list[tuple[str, int]]:
        lim = self.config.limits
        return [
            ("grpc.max_receive_message_length", lim.max_message_bytes),
            ("grpc.max_send_message_length", lim.max_message_bytes),
            ("grpc.max_concurrent_streams", lim.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]

    async def start(self) -> int:
        """Bind, start serving and report SERVING. Returns the bound port (useful with :0)."""
        # read TLS files and tokens before creating the server, so bad ones fail with nothing to clean up
        interceptors = build_interceptors(self.config.auth, self.service.call_errors)
        if self.tracer is not None:
            # first, so a call the token check refuses still has its span (installed only with tracing on)
            interceptors.insert(0, ServerSpans(self.tracer))
        creds = None
        if self.config.tls.enabled:
            creds, self.certificates = server_credentials(self.config.tls)
        server = grpc.aio.server(options=self._server_options(), interceptors=interceptors)
        # every service registers through this, so bytes that do not parse answer INVALID_ARGUMENT,
        # a handler bug INTERNAL, and every refused or failed call is counted and logged sampled
        self.service.off_loop_prompt_bytes = self.config.limits.off_loop_prompt_bytes
        safe = SafeRegistrar(server, self.service.call_errors,
                             {"/kvrouter.v1.KVRouter/Route": self.service.route_message,
                              "/kvrouter.v1.KVRouter/RouteStream": self.service.route_stream_message,
                              "/kvrouter.v1.KVRouter/PublishEvents": self.service.event_batch_message},
                             # RouteStream's batch answers are made as wire bytes (stream_answers)
                             {"/kvrouter.v1.KVRouter/RouteStream":
                                  passes_bytes(router_pb2.RouteStreamResponse.SerializeToString)})
        router_pb2_grpc.add_KVRouterServicer_to_server(self.service, safe)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, safe)
        served = [KVROUTER_SERVICE]
        if self.config.ext_proc.enabled:
            # Envoy's ext_proc filter calls this port as its endpoint picker (docs/envoy.md)
            self.ext_proc = ExtProcService.from_config(
                self.router, self.config.ext_proc, self.tracer, self.metrics, self.admission
            )
            # a body as large as a prompt read off the loop by Route is read off the loop too
            self.ext_proc.off_loop_body_bytes = self.config.limits.off_loop_prompt_bytes
            self.ext_proc.call_errors = self.service.call_errors
            self.ext_proc.add_to_server(safe)  # type: ignore[arg-type]
            served.append(EXT_PROC_SERVICE)
        # what reflection.enable_server_reflection does for an aio server (it type-checks the server)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer((*served, health.SERVICE_NAME, reflection.SERVICE_NAME)), safe
        )
        try:
            if creds is not None:
                self.port = server.add_secure_port(self.config.listen, creds)
            else:
                self.port = server.add_insecure_port(self.config.listen)
        except RuntimeError:
            raise ConfigError(f"listen: cannot bind {self.config.listen}: {bind_problem(self.config.listen)}") from None
        self.loop_monitor.start()  # stop() ends it, as after any later failure to start
        # grpc's health servicer starts with "" SERVING: not ready until the index is warm (a
        # peer's copy, the bus snapshot and backlog, the first pod listing): probes wait
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self.server = server
        # the endpoint-picker protocol's probes: alive as soon as we answer, ready below
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.config.warm_from:
            await warm_from_peer(self.router, self.config, client_token(self.config.auth))
        await self._start_membership_sources()
        if self.config.events.bus.enabled:
            await self._follow_bus()
        self._maintenance = asyncio.create_task(self._maintain(), name="kvrouterd-maintenance")
        # from here on collections read router state on this loop; not before the bus's instruments
        # exist: creating one takes the lock a collection holds while it waits for the loop
        self.loop_reads.attach(asyncio.get_running_loop())
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.start()
        if self.reloader.path and self.config.reload_interval_s:
            self._watch = asyncio.create_task(self.reloader.watch(), name="kvrouterd-config-watch")
        # the start-up heap (modules, config, gRPC, OpenTelemetry, policies: ~50k objects) lives
        # as long as the process: out of every later full collection, which otherwise scanned it
        # all on the routing loop (40-180 ms gen-2 pauses in the long fuzz run, issue #16)
        freeze_heap()
        for name in ("", READINESS_SERVICE, *served):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.serving = True
        log.info(
            "serving",
            extra={"listen": self.config.listen, "port": self.port, "policy": self.router.default_routing,
                   "workers": len(self.router.workers), "fast_path": native.status,
                   "grpc_experiments": grpc_runtime.status,
                   "epoch": f"{self.service.epoch:016x}"},
        )
        if native.module is None and not native.disabled:
            log.warning("the C fast path is not built: every Route costs ~65 us more (reinstall with a C compiler)")
        return self.port

    async def _start_membership_sources(self) -> None:
        """ZMQ subscribers follow membership; Kubernetes discovery feeds it. With discovery on,
        the first pod listing is applied before the daemon reports SERVING."""
        if self.config.events.bus.enabled:
            # ZMQ engines reach replicas through `kvrouterd bridge` (events/bridge.py), which
            # reads each engine once; subscribing here too would apply every batch twice
            zmq_workers = [w.id for w in self.router.workers if w.spec.kv_events_endpoint]
            if zmq_workers:
                log.info("events.bus is on: ZMQ endpoints are read by `kvrouterd bridge`, not by this replica",
                         extra={"workers": zmq_workers})
        else:
            self.events = ZmqEventSource(
                self.config.events,
                apply=lambda batch: self.service.apply_batch(batch, per_event=True),
                reset=self._reset_events,
                rejected=self._note_rejected,
                # an engine batch of more blocks is applied in parts, the loop free between them
                max_part_blocks=self.config.limits.max_batch_blocks, block_size=self.router.block_size,
            )
            self.ops_metrics.add_event_source(self.events.stats)
        self.service.on_membership_change = self._membership_changed
        self._membership_changed()
        k8s = self.config.discovery.kubernetes
        if k8s.enabled:
            self.discovery = KubernetesDiscovery(k8s, self._discovered, self._departed, block_size=self.config.block_size)
            self._discovery_task = asyncio.create_task(self.discovery.run(), name="kvrouterd-discovery")
            try:
                await asyncio.wait_for(self.discovery.synced.wait(), DISCOVERY_SYNC_TIMEOUT_S)
            except TimeoutError:
                log.warning("no pod listing within %ss; serving with the workers known so far", DISCOVERY_SYNC_TIMEOUT_S)

    async def _follow_bus(self) -> None:
        """Restore the bus's latest index snapshot, follow the stream after it, and stay not
        ready until the backlog at start is applied. An unreachable bus fails start-up
        (``BusUnavailable``) rather than serve an index nobody feeds."""
        max_events = self.config.limits.max_batch_events

        def apply(batch: EventBatch) -> BatchOutcome:
            outcome = self.service.apply_batch(batch)
            if self.resync_asker is not None:
                self.resync_asker.applied(batch, outcome)
            return outcome

        self.bus = BusEventSource(
            self.config.events.bus,
            decode=lambda data: convert.event_batch_bytes(data, self.service.batch_limits),
            apply=apply,
            # what `kvrouterd bridge` publishes: the calls its ZMQ source made, replayed here
            bridged=BridgedEvents(lambda batch: self.service.apply_batch(batch, per_event=True),
                                  self._reset_events, self._note_rejected, max_events),
        )
        self.resync_asker = BusResyncAsker(self.router, self.bus)
        register_bus_metrics(self.meter_provider, self.bus.stats, self.loop_reads)
        try:
            await self.bus.connect()
        except BaseException:
            self.bus = None
            await self.stop(grace=0)
            raise
        start_after = 0
        data = await self.bus.load_snapshot()
        if data is not None:
            try:
                taken_after, digest = snapshot_position(data)
                _, warmed = await restore_snapshot(self.router, data)
            except InvalidRequest as exc:
                log.warning("bus snapshot unusable (%s); replaying the whole stream", exc)
            else:
                # a snapshot of a stream made again since (NATS lost it, or it was deleted) is a
                # reset, counted and logged there; its index stays loaded, as a replica that was
                # following that stream keeps its own: the new stream is followed from its start,
                # and a worker whose batches went into neither stream shows a gap against the
                # snapshot's batch numbers and is resynced (dropped, every worker's first batch
                # would read as a gap, and routing would be blind until each resync)
                start_after = await self.bus.snapshot_start(taken_after, digest)
                log.info("index restored from the bus snapshot",
                         extra={"stream_sequence": start_after, "blocks": warmed.blocks, "workers": warmed.workers})
        self.resync_asker.watch_all()  # workers the snapshot names as degraded
        await self.bus.start(start_after)
        await self.bus.caught_up.wait()
        self._resync_asks = asyncio.create_task(self.resync_asker.run(), name="kvrouterd-bus-resync-asks")
        if self.config.events.bus.replica_sync.enabled:
            await self._share_load()
        interval = self.config.events.bus.snapshot_interval_s
        if interval:
            self._snapshots = asyncio.create_task(self._snapshot_periodically(interval), name="kvrouterd-bus-snapshots")

    def _reset_events(self, worker_id: str, lost: bool) -> None:
        self.router.reset_events(worker_id, lost=lost)
        self.service.keep_draining()  # a large worker's old blocks go in steps

    def _note_rejected(self, worker_id: str, counts: Mapping[str, int], lost: bool) -> None:
        self.router.note_rejected_events(worker_id, counts, lost_removal=lost)

    async def _share_load(self) -> None:
        """Publish this replica's commits and completions, apply the others' (after the cache
        index is caught up, so approximate prefixes land on the blocks they name), and stay not
        ready until the last ``inflight_timeout_s`` of the fleet's deltas is replayed."""
        router = self.router
        sync = self.sync = ReplicaSync(self.config.events.bus, router.settings.inflight_timeout_s,
                                       decode=convert.load_delta, apply=self._apply_load_delta,
                                       marker=convert.marker_delta)
        try:
            await sync.connect()
        except BaseException:
            self.sync = None
            await self.stop(grace=0)
            raise

        def committed(result: RouteResult) -> None:
            entry = router.workers.inflight(result.request.request_id)
            prefill = entry.prefill_tokens if entry is not None else 0
            speculative = router.speculative.enabled
            sync.publish(lambda replica: convert.dispatched_delta(replica, result, prefill, speculative))
            if result.prefill_worker is not None:  # disaggregated: the prefill worker's charge too
                sync.publish(lambda replica: convert.prefill_hop_delta(replica, result, speculative))

        def completed(done: Completion) -> None:
            sync.publish(lambda replica: convert.completed_delta(replica, done))

        router.on_committed, router.on_completed = committed, completed
        stats = sync.stats
        self.ops_metrics.sync_losses = lambda: {"publish_error": stats.publish_errors, "rejected": stats.rejected,
                                                "stream_skip": stats.stream_skips,
                                                "stream_reset": stats.stream_resets}
        await sync.start()
        await sync.caught_up.wait()

    def _apply_load_delta(self, delta: object, own: bool) -> None:
        if isinstance(delta, Dispatch):
            if self.router.apply_dispatch(delta, own=own) and self.admission is not None:
                replaying = self.sync is not None and not self.sync.caught_up.is_set()
                self.admission.on_remote_dispatch(delta, replaying)
        elif isinstance(delta, Completion):
            entry = self.router.apply_completion(delta, own=own)
            if self.admission is None:
                return
            if delta.prefill_done:
                # a first token heard by another replica (a request's or its prefill hop's): the
                # routing replica's deadline model judges its TTFT now, as where it was heard
                # (the Complete that follows usually comes too late to move the margin)
                if not own and delta.ttft_ms > 0:
                    self.admission.on_first_token(delta)
            elif entry is not None:  # a released prefill hop frees no queue's room, as when received here
                self.admission.on_complete(entry.worker_id, delta)

    async def _snapshot_periodically(self, interval: float) -> None:
        assert self.bus is not None
        while True:
            await asyncio.sleep(interval)
            try:
                data = await encode_snapshot_aside(self.router, self.bus.stats.last_stream_sequence,
                                                   self.bus.applied_digest())
                await self.bus.save_snapshot(data)
            except Exception as exc:  # NATS errors of any kind: a missed snapshot only lengthens the next replay
                log.warning("writing the bus snapshot failed: %s", exc)

    def _membership_changed(self) -> None:
        if self.events is not None:
            self.events.sync(w.spec for w in self.router.workers)

    def _discovered(self, spec: WorkerSpec) -> None:
        replay = self.discovery.replay_endpoint(spec.id) if self.discovery is not None else ""
        if replay and spec.kv_events_endpoint and "replay=" not in spec.kv_events_endpoint:
            spec = dataclasses.replace(spec, kv_events_endpoint=f"{spec.kv_events_endpoint}?replay={replay}")
        try:
            # the same checks as RegisterWorker: sizes, then the endpoint allow-list
            self.router.check_worker_sizes(spec)
            if spec.kv_events_endpoint:
                check_worker_endpoints(self.service.allowed_endpoints, spec.id, spec.address, spec.kv_events_endpoint)
            self.router.add_worker(spec)
        except KVRouterError as exc:
            log.warning("discovered pod not routed to: %s", exc, extra={"worker_id": spec.id})
            return
        self._membership_changed()

    def _departed(self, worker_id: str) -> None:
        if worker_id in self.router.workers:
            self.service.forget_worker(worker_id)
        elif self.admission is not None:
            self.admission.drop_worker(worker_id)
        self._membership_changed()

    async def _maintain(self) -> None:
        """Policy ticks and metric flushes every tick_interval_s; expire lost in-flight requests about once a second."""
        interval = self.config.tick_interval_s
        every = max(1, round(1.0 / interval))
        n = 0
        while True:
            await asyncio.sleep(interval)
            # route latencies are queued per call and recorded here in one warm loop (telemetry.metrics)
            self.metrics.flush()
            self.service.call_errors.flush()  # the "suppressed K" lines of intervals that ended
            try:
                self.router.tick()
                if self.admission is not None:
                    self.admission.tick(self.router.clock.now())
                n += 1
                if n % every == 0:
                    expired = self.router.expire_inflight()
                    if expired:
                        log.warning("released %d requests that never completed", len(expired))
                        if self.admission is not None:
                            for entry in expired:
                                self.admission.on_expired(entry.request_id)
            except KVRouterError:  # pragma: no cover - policies raise nothing on tick
                log.exception("maintenance step failed")

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let in-flight RPCs finish for ``grace`` seconds, flush telemetry."""
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        await stop_task(self._watch)
        await stop_task(self._discovery_task)
        if self.events is not None:
            await self.events.close()
        await stop_task(self._snapshots)
        await stop_task(self._resync_asks)
        if self.sync is not None:
            self.router.on_committed = self.router.on_completed = None
            await self.sync.flush(1.0)
            await self.sync.close()
        if self.bus is not None:
            await self.bus.close()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.stop()
        await stop_task(self._maintenance)
        await self.loop_monitor.stop()
        # an exporter collecting from now on, or the final export below, reads router state on
        # its own thread: the loop may stop at any time once this returns
        self.loop_reads.detach()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        if self.serving:
            log.info("stopped")
            # what start froze can be collected again once no other daemon in the process holds
            # it frozen (tests run several)
            unfreeze_heap()
        self.serving = False

    async def run_until_signal(self, grace: float = 5.0) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reloader.reload)
        try:
            await self.start()
        except BaseException:
            # close what started (the gRPC server, sources) while the loop runs: left to the
            # garbage collector they print "Event loop is closed" tracebacks after our error line
            await self.stop(0)
            raise
        await stop.wait()
        log.info("shutting down")
        await self.stop(grace)


def bind_problem(listen: str) -> str:
    """Why gRPC could not bind ``listen`` (its own message only says that it failed)."""
    host, _, digits = listen.rpartition(":")
    host = host.strip("[]")
    if (port := parse_decimal(digits)) is None:
        return f"{digits!r} is not a port number"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as exc:
        return f"cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(address)
            except OSError as exc:
                reason = {errno.EADDRINUSE: "the port is already in use",
                          errno.EADDRNOTAVAIL: "the address is not assigned to this machine",
                          errno.EACCES: "permission denied (ports below 1024 need privileges)"}
                return reason.get(exc.errno or 0, exc.strerror or str(exc))
    return "gRPC refused the address (GRPC_VERBOSITY=debug shows its reason)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", metavar="HOST:PORT", help="address to serve gRPC on (default 127.0.0.1:50051)")
    parser.add_argument("--config", metavar="FILE", help="YAML config file (default: the embedded defaults)")
    parser.add_argument("--routing-policy", metavar="NAME", help="default routing policy (see `kvrouterd policies`)")
    parser.add_argument("--eviction-policy", metavar="NAME", help="eviction policy for hints and approximate mode")
    parser.add_argument("--block-size", type=decimal_arg, metavar="TOKENS", help="tokens per KV block (default 16)")
    parser.add_argument("--metrics-listen", metavar="HOST:PORT",
                        help="serve Prometheus /metrics on HOST:PORT (default: off; metrics.listen)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log threshold (default info)")
    parser.add_argument("--log-format", choices=["text", "json"], help="log lines as text or one JSON object each (default text)")
    parser.add_argument("--grace", type=number_arg, default=5.0, help="seconds to drain in-flight RPCs on shutdown")


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    pairs = {
        "listen": args.listen,
        "routing.name": args.routing_policy,
        "eviction.name": args.eviction_policy,
        "block_size": args.block_size,
        "metrics.listen": args.metrics_listen,
        "telemetry.log_level": args.log_level,
        "telemetry.log_format": args.log_format,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, _overrides(args))
    except ConfigError as exc:
        print(f"kvrouterd: configuration error: {exc}", flush=True)
        return 2
    configure_logging(config.telemetry.log_level, config.telemetry.log_format)
    import uvloop

    try:
        path = args.config or os.environ.get(ENV_PREFIX + "CONFIG") or None
        daemon = Daemon(config, config_path=path, overrides=_overrides(args))
        uvloop.run(daemon.run_until_signal(args.grace))
    except ConfigError as exc:
        print(f"kvrouterd: {exc}", flush=True)
        return 2
    return 0
