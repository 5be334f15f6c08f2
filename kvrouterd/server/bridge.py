"""Run the ZMQ-to-NATS bridge: read each vLLM / SGLang KV-event publisher once, republish
its events into the JetStream stream every replica follows (``events.bus``).

Reads the same config file as ``kvrouterd serve``: the workers that declare a
``kv_events_endpoint`` (static, or found by ``discovery.kubernetes``), the ``events`` section
(topic, replay, silence, LoRA ids) and ``events.bus`` (where to publish). Replicas with
``events.bus`` on never subscribe to ZMQ themselves. Run exactly one bridge per set of
engines (docs/deploy.md, "ZMQ engines on the bus"). Prometheus metrics on ``metrics.listen``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from ..config import Config, load_config
from ..decimals import decimal_arg
from ..discovery import KubernetesDiscovery
from ..errors import ConfigError, KVRouterError
from ..events.bridge import DEFAULT_MAX_PENDING, BusBridge
from ..events.endpoints import check_worker_endpoints
from ..index.workers import WorkerSpec
from ..tasks import stop_task
from ..telemetry.metrics import build_meter_provider
from ..telemetry.prometheus import MetricsEndpoint
from .logs import configure_logging

__all__ = ["BridgeProcess", "add_arguments", "run"]

log = logging.getLogger("kvrouterd.bridge")


class BridgeProcess:
    """One bridge: static and discovered workers -> ZMQ subscribers -> JetStream."""

    def __init__(self, config: Config, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if not config.events.bus.enabled:
            raise ConfigError("kvrouterd bridge: events.bus.kind must be 'nats' (the bridge publishes into the bus)")
        self.config = config
        self.bridge = BusBridge(config.events, max_pending=max_pending, max_part_blocks=config.limits.max_batch_blocks,
                                block_size=config.block_size)
        self.workers: dict[str, WorkerSpec] = {w.id: w.to_spec(config.block_size) for w in config.workers}
        self.discovery: KubernetesDiscovery | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self.metrics_endpoint = MetricsEndpoint(config.metrics.listen) if config.metrics.listen else None
        readers = [self.metrics_endpoint.reader] if self.metrics_endpoint is not None else []
        self.meter_provider = build_meter_provider("kvrouterd-bridge", readers)
        self._register_metrics()

    async def start(self) -> None:
        """Connect to the bus (``BusUnavailable`` if it cannot), then subscribe to the engines."""
        await self.bridge.start()
        self._sync()
        k8s = self.config.discovery.kubernetes
        if k8s.enabled:
            self.discovery = KubernetesDiscovery(k8s, self._discovered, self._departed, block_size=self.config.block_size)
            self._discovery_task = asyncio.create_task(self.discovery.run(), name="kvrouterd-bridge-discovery")
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.start()
        log.info("bridge running", extra={"engines": len(self.bridge.source.subscribers)})

    def _sync(self) -> None:
        self.bridge.sync(self.workers.values())

    def _discovered(self, spec: WorkerSpec) -> None:
        # as the daemon does: a discovered replay port rides on the endpoint string
        replay = self.discovery.replay_endpoint(spec.id) if self.discovery is not None else ""
        if replay and spec.kv_events_endpoint and "replay=" not in spec.kv_events_endpoint:
            spec = dataclasses.replace(spec, kv_events_endpoint=f"{spec.kv_events_endpoint}?replay={replay}")
        if spec.kv_events_endpoint:  # the daemon's check (events.allowed_endpoints), before dialling
            try:
                check_worker_endpoints(self.config.events.allow_list, spec.id, spec.address, spec.kv_events_endpoint)
            except KVRouterError as exc:
                log.warning("discovered pod not bridged: %s", exc, extra={"worker_id": spec.id})
                return
        self.workers[spec.id] = spec
        self._sync()

    def _departed(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self._sync()

    def _register_metrics(self) -> None:
        meter = self.meter_provider.get_meter("kvrouterd.bridge")
        stats = self.bridge.stats

        def counter(name: str, attr: str, description: str) -> None:
            def observe(_: CallbackOptions) -> Iterable[Observation]:
                yield Observation(getattr(stats, attr))

            meter.create_observable_counter(name, [observe], description=description)

        counter("kvrouter.bridge.published", "published", "messages JetStream acknowledged")
        counter("kvrouter.bridge.publish_retries", "publish_retries", "publishes retried after a timeout or outage")
        counter("kvrouter.bridge.lost_resets", "lost_resets", "workers reported to replicas as having lost events")
        counter("kvrouter.bridge.overflow_dropped", "overflow_dropped", "batches dropped with max_pending calls queued")

        def pending(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(stats.pending)

        meter.create_observable_gauge("kvrouter.bridge.pending", [pending], description="calls queued for NATS")

        def per_engine(_: CallbackOptions) -> Iterable[Observation]:
            for wid, st in self.bridge.source.stats().items():
                for kind in ("gaps", "replays_ok", "replays_failed", "desyncs", "restarts", "parts_abandoned"):
                    yield Observation(getattr(st, kind), {"worker": wid, "kind": kind})

        meter.create_observable_counter("kvrouter.bridge.engine_events", [per_engine],
                                        description="per engine: gaps, replays, desyncs (lost beyond replay), restarts, batches "
                                                    "whose later parts were dropped (worker removed or reset meanwhile)")

    async def stop(self) -> None:
        await stop_task(self._discovery_task)
        await self.bridge.close()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.stop()
        self.meter_provider.shutdown()

    async def run_until_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        await stop.wait()
        log.info("bridge shutting down")
        await self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="the replicas' YAML config file (workers, events, events.bus)")
    parser.add_argument("--max-pending", type=decimal_arg, default=DEFAULT_MAX_PENDING, metavar="N",
                        help=f"calls queued for NATS before a worker is dropped and resynced (default {DEFAULT_MAX_PENDING})")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log threshold (default info)")
    parser.add_argument("--log-format", choices=["text", "json"], help="log lines as text or one JSON object each")


def run(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in {"telemetry.log_level": args.log_level,
                                   "telemetry.log_format": args.log_format}.items() if v is not None}
    try:
        config = load_config(args.config, overrides)
        if args.max_pending < 2:
            raise ConfigError(f"--max-pending must be >= 2, got {args.max_pending}")
        process = BridgeProcess(config, max_pending=args.max_pending)
    except ConfigError as exc:
        print(f"kvrouterd: configuration error: {exc}", flush=True)
        return 2
    configure_logging(config.telemetry.log_level, config.telemetry.log_format)
    import uvloop

    try:
        uvloop.run(process.run_until_signal())
    except KVRouterError as exc:  # BusUnavailable: a clear line and exit 2, as `serve` does
        print(f"kvrouterd: {exc}", flush=True)
        return 2
    return 0
