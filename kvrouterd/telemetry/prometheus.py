"""Prometheus text-format endpoint (``GET /metrics``) on its own HTTP port.

The daemon keeps one metrics pipeline, OpenTelemetry: this module adds an
``opentelemetry-exporter-prometheus`` ``PrometheusMetricReader`` to the daemon's
MeterProvider, so the same instruments reach Prometheus and (when configured) OTLP. Chosen
over a parallel set of ``prometheus_client`` instruments because the service already records
every decision through OTel. Per Route, ``Metrics.route_decided`` (an int bump behind an
ObservableCounter and a queued latency, recorded in batches; see telemetry.metrics) costs
0.3 us with no reader and 6.2 us with this reader, in process with warm caches; the SDK's
own counter add + histogram record cost 11.0 and 24.7 us (recipe in docs/operations/observe.md), and
prometheus_client 2.7-7.2 us, which would add to the OTel cost, not replace it.

Besides the service's instruments (``kvrouter_decisions_total{policy,reason}``,
``kvrouter_route_duration_seconds``, event batches, gaps, index and per-worker blocks),
``register_ops_metrics`` adds observable instruments read from the router at scrape time, so
they cost nothing per request:

* ``kvrouter_prefix_decisions_total{policy,picked=best|worse|no_prefix}``: did the decision
  pick a worker holding the longest cached prefix any candidate held (``best``) or not;
  ``kvrouter_prefix_achieved_blocks_total`` / ``kvrouter_prefix_reachable_blocks_total``:
  the block-weighted version (achieved over reachable = prefix hit efficiency).
* per worker: ``kvrouter_worker_event_batches_total``, ``kvrouter_worker_event_gaps_total``,
  ``kvrouter_worker_events_rejected_total{reason}`` (events not applied, the rest of their batch was),
  ``kvrouter_worker_event_replays_total{outcome}`` (ZMQ sources), ``kvrouter_worker_inflight_requests``,
  ``kvrouter_worker_pending_prefill_tokens``, ``kvrouter_worker_reported_queue``.
* replica sync (``events.bus.replica_sync``): ``kvrouter_replica_sync_deltas_total{outcome}``
  (other replicas' deltas: ``charged``, ``released``, ``late`` = a Dispatch behind its
  completion, ``unknown_worker``) and ``kvrouter_replica_sync_lost_total{reason}``
  (``publish_error``, ``rejected``, ``stream_skip``: deltas lost; their requests expire).
* ``kvrouter_policy_rule_fired_total{policy,rule}``: a policy's own rule counts
  (``RoutingPolicyBase.counters``): DualMap's decisions with a decode-bottlenecked candidate
  (A.7) and those the flag moved; ``kvrouter_admission_migrations_total``: DualMap's hotspot
  migrations (A.1.2) in admission queue mode.
* ``kvrouter_workers{mode,state}``, ``kvrouter_inflight_requests``, and the process
  collector's ``process_resident_memory_bytes`` etc.

The HTTP server runs on the daemon's event loop (not prometheus_client's thread server) so
a scrape reads router state between, never during, the loop's updates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder

from ..decimals import parse_decimal
from ..errors import ConfigError
from ..protocols import CacheMode

__all__ = ["MetricsEndpoint", "OpsMetrics", "register_ops_metrics"]

log = logging.getLogger("kvrouterd.telemetry")

#: largest request head accepted, bytes (a scrape's is a few hundred)
_MAX_HEAD = 8192
_READ_TIMEOUT_S = 5.0

EventStats = Callable[[], Mapping[str, Any]]


class MetricsEndpoint:
    """A private Prometheus registry fed by a PrometheusMetricReader, served over HTTP."""

    def __init__(self, listen: str) -> None:
        host, _, digits = listen.rpartition(":")
        port = parse_decimal(digits)
        if port is None:
            raise ConfigError(f"metrics.listen: expected HOST:PORT, got {listen!r}")
        self.host, self.port = host.strip("[]"), port
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.reader = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with :0)."""
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=_MAX_HEAD)
        except OSError as exc:
            raise ConfigError(f"metrics.listen: cannot bind {self.host}:{self.port}: {exc.strerror}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics endpoint serving", extra={"metrics_port": self.port})
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def render(self, accept: str = "") -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            status, body, ctype = self._respond(head.decode("latin-1"))
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass  # a client that hung up or sent garbage gets nothing
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _respond(self, head: str) -> tuple[str, bytes, str]:
        request_line, *header_lines = head.split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3:
            return "400 Bad Request", b"bad request line\n", "text/plain"
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"only GET\n", "text/plain"
        if target.split("?", 1)[0] != "/metrics":
            return "404 Not Found", b"metrics are at /metrics\n", "text/plain"
        accept = ""
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        body, ctype = self.render(accept)
        return "200 OK", (b"" if method == "HEAD" else body), ctype


class OpsMetrics:
    """What ``register_ops_metrics`` set up; event sources can be attached later."""

    def __init__(self) -> None:
        self.event_sources: list[EventStats] = []
        #: the replica sync's loss counters (reason -> count), once the daemon shares load
        self.sync_losses: Callable[[], Mapping[str, int]] = dict
        #: the daemon's admission gate (``server.admission.AdmissionGate``), when it runs one
        self.admission: Any = None

    def add_event_source(self, stats: EventStats) -> None:
        """Export the replay counts of an event source (``ZmqEventSource.stats``: worker -> stats)."""
        self.event_sources.append(stats)


def register_ops_metrics(provider: MeterProvider, router: Any) -> OpsMetrics:
    """Scrape-time instruments over ``router`` state (see the module docstring)."""
    meter = provider.get_meter("kvrouterd.ops")
    ops = OpsMetrics()

    def prefix_decisions(_: CallbackOptions) -> Iterable[Observation]:
        for policy, h in list(router.prefix_hits.items()):
            yield Observation(h.best, {"policy": policy, "picked": "best"})
            yield Observation(h.worse, {"policy": policy, "picked": "worse"})
            yield Observation(h.no_prefix, {"policy": policy, "picked": "no_prefix"})

    def achieved(_: CallbackOptions) -> Iterable[Observation]:
        for policy, h in list(router.prefix_hits.items()):
            yield Observation(h.achieved_blocks, {"policy": policy})

    def reachable(_: CallbackOptions) -> Iterable[Observation]:
        for policy, h in list(router.prefix_hits.items()):
            yield Observation(h.reachable_blocks, {"policy": policy})

    def per_worker(attr: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            for w in list(router.workers):
                yield Observation(max(0, getattr(w, attr)), {"worker": w.id})

        return observe

    def rejected_events(_: CallbackOptions) -> Iterable[Observation]:
        for w in list(router.workers):
            for reason, n in list(w.events_rejected.items()):
                yield Observation(n, {"worker": w.id, "reason": reason})

    def replays(_: CallbackOptions) -> Iterable[Observation]:
        for source in list(ops.event_sources):
            for worker_id, st in source().items():
                yield Observation(st.replays_ok, {"worker": worker_id, "outcome": "ok"})
                yield Observation(st.replays_failed, {"worker": worker_id, "outcome": "failed"})

    def workers_by_mode(_: CallbackOptions) -> Iterable[Observation]:
        counts: dict[tuple[str, str], int] = {}
        for w in list(router.workers):
            key = ("events" if w.mode is CacheMode.EVENTS else "approximate", w.state.name.lower())
            counts[key] = counts.get(key, 0) + 1
        for mode in ("events", "approximate"):
            for state in ("ready", "degraded", "draining"):
                yield Observation(counts.get((mode, state), 0), {"mode": mode, "state": state})

    def inflight(_: CallbackOptions) -> Iterable[Observation]:
        yield Observation(router.workers.inflight_count)

    def rules_fired(_: CallbackOptions) -> Iterable[Observation]:
        for policy, counts in router.policy_counters().items():
            for rule, n in counts.items():
                yield Observation(n, {"policy": policy, "rule": rule})

    def migrations(_: CallbackOptions) -> Iterable[Observation]:
        if ops.admission is not None:
            yield Observation(ops.admission.migrations)

    meter.create_observable_counter(
        "kvrouter.prefix.decisions", [prefix_decisions],
        description="decisions by whether the chosen worker held the longest cached prefix of any candidate",
    )
    meter.create_observable_counter(
        "kvrouter.prefix.achieved_blocks", [achieved], description="prompt blocks cached on the chosen worker"
    )
    meter.create_observable_counter(
        "kvrouter.prefix.reachable_blocks", [reachable],
        description="prompt blocks cached on the best candidate (upper bound of achieved)",
    )
    meter.create_observable_counter(
        "kvrouter.worker.event_batches", [per_worker("batches_applied")], description="event batches applied per worker"
    )
    meter.create_observable_counter(
        "kvrouter.worker.event_gaps", [per_worker("gaps")], description="event sequence gaps (lost batches) per worker"
    )
    meter.create_observable_counter(
        "kvrouter.worker.event_replays", [replays], description="event replays requested from engines, by outcome"
    )
    meter.create_observable_counter(
        "kvrouter.worker.events_rejected", [rejected_events],
        description="cache events not applied (undecodable, malformed, unknown type, rank mismatch), by reason",
    )
    meter.create_observable_gauge(
        "kvrouter.worker.inflight_requests", [per_worker("inflight_requests")],
        description="requests routed to the worker and not yet completed",
    )
    meter.create_observable_gauge(
        "kvrouter.worker.pending_prefill_tokens", [per_worker("pending_prefill_tokens")],
        description="uncached prompt tokens of the worker's in-flight requests",
    )
    meter.create_observable_gauge(
        "kvrouter.worker.reported_queue", [per_worker("reported_queue")],
        description="queued requests the engine last reported (ReportLoad)",
    )
    def sync_deltas(_: CallbackOptions) -> Iterable[Observation]:
        c = router.counters
        for outcome, key in (("charged", "remote_dispatches"), ("released", "remote_completions"),
                             ("late", "remote_late_dispatches"), ("unknown_worker", "remote_unknown_workers")):
            yield Observation(c.get(key, 0), {"outcome": outcome})

    def sync_lost(_: CallbackOptions) -> Iterable[Observation]:
        for reason, n in ops.sync_losses().items():
            yield Observation(n, {"reason": reason})

    meter.create_observable_counter(
        "kvrouter.replica_sync.deltas", [sync_deltas], description="other replicas' load deltas applied, by outcome"
    )
    meter.create_observable_counter(
        "kvrouter.replica_sync.lost", [sync_lost], description="load deltas lost (their requests expire), by reason"
    )
    meter.create_observable_counter(
        "kvrouter.policy.rule_fired", [rules_fired],
        description="decisions in which a policy's own rule fired, e.g. DualMap's decode-bottleneck rule (A.7)",
    )
    meter.create_observable_counter(
        "kvrouter.admission.migrations", [migrations],
        description="queued requests moved to their other candidate by DualMap's hotspot migration (A.1.2)",
    )
    meter.create_observable_gauge("kvrouter.workers", [workers_by_mode], description="registered workers by mode and state")
    meter.create_observable_gauge("kvrouter.inflight_requests", [inflight], description="requests routed and not completed")
    return ops
