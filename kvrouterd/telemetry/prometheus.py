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
  completion, ``unknown_worker``, ``prefill_released`` = a prefill hop released early) and
  ``kvrouter_replica_sync_lost_total{reason}`` (``publish_error``, ``rejected``, ``stream_skip``,
  ``stream_reset``: deltas lost; their requests expire).
* ``kvrouter_policy_rule_fired_total{policy,rule}``: a policy's own rule counts
  (``RoutingPolicyBase.counters``): DualMap's decisions with a decode-bottlenecked candidate
  (A.7) and those the flag moved; ``kvrouter_admission_migrations_total``: DualMap's hotspot
  migrations (A.1.2) in admission queue mode; ``kvrouter_admission_deadline_total{outcome}``:
  deadline admission's shed, rerouted and expired Routes (``kvrouterd.deadline``);
  ``kvrouter_admission_deadline_margin``: its margin (1 = none).
* ``kvrouter_workers{mode,state}``, ``kvrouter_inflight_requests``, and the process
  collector's ``process_resident_memory_bytes`` etc.

HTTP is prometheus_client's own: its WSGI app (content negotiation, gzip, ``name[]``
filters) on the threaded wsgiref server its ``start_http_server`` uses, with only
``/metrics`` answered (anything else is a 404 naming it). The collection runs on the server's
thread too, but the observable callbacks, which iterate the router's live dicts, each run on
the daemon's event loop (``telemetry.loop_reads``), so a scrape reads router state between,
never during, the loop's updates, and the loop is held only for those reads.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ..decimals import parse_decimal
from ..errors import ConfigError
from ..protocols import CacheMode
from .loop_reads import LoopReads

__all__ = ["MetricsEndpoint", "OpsMetrics", "register_ops_metrics"]

log = logging.getLogger("kvrouterd.telemetry")

EventStats = Callable[[], Mapping[str, Any]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        pass  # a scrape every few seconds is not news


def _only_metrics(app: Callable[..., Any]) -> Callable[..., Any]:
    """prometheus_client's app answers on any path; ours only on /metrics, so a typo is visible."""

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes] | list[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"metrics are at /metrics\n"]
        return app(environ, start_response)  # type: ignore[no-any-return]

    return serve


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
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with :0)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        try:
            self._server = server_class((self.host, self.port), _Quiet)
        except OSError as exc:
            reason = (exc.strerror or str(exc)).lower()  # "address already in use", as in kvrouterd's other lines
            raise ConfigError(f"metrics.listen: cannot bind {self.host}:{self.port}: {reason}") from None
        self._server.set_app(_only_metrics(make_wsgi_app(self.registry)))
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvrouterd-metrics", daemon=True)
        self._thread.start()
        log.info("metrics endpoint serving", extra={"metrics_port": self.port})
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            # shutdown blocks until serve_forever's poll notices (up to half a second), and a
            # scrape in progress may be waiting for this loop: wait off the loop
            await asyncio.to_thread(self._server.shutdown)
            self._server.server_close()
            self._server = None


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


def register_ops_metrics(provider: MeterProvider, router: Any, loop_reads: LoopReads | None = None) -> OpsMetrics:
    """Scrape-time instruments over ``router`` state (see the module docstring); ``loop_reads``:
    the daemon's, which runs their callbacks on its event loop."""
    meter = provider.get_meter("kvrouterd.ops")
    if loop_reads is not None:
        meter = loop_reads.meter(meter)
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
        if ops.admission is not None and ops.admission.waits:  # migrations move queued requests only
            yield Observation(ops.admission.migrations)

    def deadline(_: CallbackOptions) -> Iterable[Observation]:
        guard = ops.admission.guard if ops.admission is not None else None
        if guard is not None:
            yield Observation(guard.shed, {"outcome": "shed"})
            yield Observation(guard.rerouted, {"outcome": "rerouted"})
            yield Observation(guard.expired, {"outcome": "expired"})
            yield Observation(guard.spared, {"outcome": "spared"})

    def deadline_margin(_: CallbackOptions) -> Iterable[Observation]:
        guard = ops.admission.guard if ops.admission is not None else None
        if guard is not None:
            yield Observation(guard.margin)

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
                             ("late", "remote_late_dispatches"), ("unknown_worker", "remote_unknown_workers"),
                             ("prefill_released", "remote_prefill_releases")):
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
    meter.create_observable_counter(
        "kvrouter.admission.deadline", [deadline],
        description="deadline admission: Routes shed (predicted to miss their TTFT SLO everywhere), rerouted to a "
                    "worker predicted to meet it, expired (dropped from a queue once they could no longer meet it) "
                    "or spared (predicted to miss everywhere but admitted: they declared no SLO of their own)",
    )
    meter.create_observable_gauge(
        "kvrouter.admission.deadline_margin", [deadline_margin],
        description="how much longer than predicted a request must still fit its SLO in: 1 until more than "
                    "1 - deadline_quantile of the requests admitted as meeting their SLO miss it",
    )
    meter.create_observable_gauge("kvrouter.workers", [workers_by_mode], description="registered workers by mode and state")
    meter.create_observable_gauge("kvrouter.inflight_requests", [inflight], description="requests routed and not completed")
    return ops
