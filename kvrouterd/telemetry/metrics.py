"""OpenTelemetry instruments for the daemon: decisions, route latency, events, gaps, workers.

The daemon owns its MeterProvider. Readers follow ``OTEL_METRICS_EXPORTER`` (``otlp``,
``console`` or ``none``, default none); a test can pass its own reader.

The two instruments every Route touches are built for the hot path. An SDK ``Counter.add``
costs 3 us with no reader and 6 us with the Prometheus one (a Measurement object, attribute
cleaning, an exemplar check, a locked aggregation), so ``kvrouter.decisions`` is an
ObservableCounter over plain ints the service bumps (``DecisionCounter``); so are the two
counters every event batch touches (``kvrouter.events.batches`` and ``.blocks``,
``LabelledCount``: two SDK adds a batch cost ~66,000 instructions, ~130 a stored block of the
bench's 512-block batches, by callgrind). The route-latency
histogram has no observable form, so ``RouteLatency`` queues each value and records the queue
into the SDK histogram in one loop: once ``FLUSH_AT`` values are queued, on the daemon's
maintenance tick (every 20 ms by default) and at the start of every collection, so a scrape or
export always sees every finished Route.
In the daemon under load that loop costs about a third of recording inline, where each call
runs the SDK's path with cold caches (py-spy, Prometheus reader on). What a Complete reports
(latencies and cached tokens) is queued the same way (``Completions``). With no reader nothing
is queued.

Series of a worker that left are dropped (``Metrics.forget_worker``), so worker churn does not
grow the exported series forever. Observable instruments report only the workers their
callbacks see; the synchronous per-worker instruments (gaps, request latencies, cached
tokens) keep every attribute set they ever saw, and the OpenTelemetry API has no call to
delete one, so ``drop_series`` removes them from the SDK's per-reader storage (private
structures: ``tests/integration/test_metrics_endpoint.py`` scrapes before and after
DeregisterWorker, so an SDK change that breaks this fails the suite, not production).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from ..errors import ConfigError
from ..index.workers import InFlight
from ..protocols import Completion
from .loop_reads import LoopReads

__all__ = ["FLUSH_AT", "Completions", "DecisionCounter", "LabelledCount", "Metrics", "PairCount", "RouteLatency",
           "build_meter_provider", "drop_series"]

log = logging.getLogger("kvrouterd.telemetry")

#: decisions take tens of microseconds to a few ms: the SDK's default buckets (0, 5, 10, ...) are for ms
ROUTE_LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


#: the Route rejections the alerts and the dashboard watch (server/status.py maps errors to them)
ROUTE_ERROR_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "INVALID_ARGUMENT", "NOT_FOUND")

#: TTFT and end-to-end times run from tens of ms to minutes
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: attribute dicts of completion series kept for reuse; past this many (the model label is a
#: client-sent name) they are built afresh
MAX_COMPLETION_SERIES = 4096
#: a queue (``RouteLatency``, ``Completions``) records itself once it holds this many values,
#: besides on the maintenance tick and at every collection. Recording holds the event loop
#: (~7 us an SDK record, two a Complete), so this bounds each stall: ~1 ms for Route
#: durations, ~2 ms for Completes. With the tick's flush alone (20 ms of calls at once) the
#: streamed bench's p99 Route latency against the ``observed`` daemon was 12.4-12.9 ms, at 128
#: 7.4-8.8, at the same CPU (docs/operations/performance.md)
FLUSH_AT = 128


def build_info() -> dict[str, str]:
    """Labels of ``kvrouter.build.info``."""
    import platform

    from .. import __version__
    from ..index import native

    return {"version": __version__, "python": platform.python_version(),
            "fast_path": "native" if native.module is not None else "pure_python"}


def build_meter_provider(service_name: str, readers: Sequence[MetricReader] = ()) -> MeterProvider:
    readers = list(readers)
    name = os.environ.get("OTEL_METRICS_EXPORTER", "none").split(",")[0].strip().lower()
    if name == "console":
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    elif name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    elif name not in ("", "none"):
        raise ConfigError(f"OTEL_METRICS_EXPORTER: unknown metrics exporter {name!r} (one of otlp, console, none)")
    return MeterProvider(resource=Resource.create({"service.name": service_name}), metric_readers=readers)


def _has_readers(provider: MeterProvider) -> bool:
    """Whether anything will ever collect from ``provider`` (readers are fixed at construction).

    The SDK has no public accessor; if its private field moves, assume a reader (record).
    """
    return bool(getattr(provider, "_metric_readers", True))


def drop_series(provider: MeterProvider, instruments: Iterable[object], key: str, value: str) -> int:
    """Forget every series of ``instruments`` whose attribute ``key`` is ``value``, in every
    reader's storage of ``provider``; returns how many were dropped (see the module docstring)."""
    wanted = set(map(id, instruments))
    tag = (key, ("str", value))  # how the SDK keys a string attribute (_hash_attributes)
    dropped = 0
    try:
        storages = provider._measurement_consumer._reader_storages.values()  # type: ignore[attr-defined]
        for storage in list(storages):
            for instrument, matches in list(storage._instrument_view_instrument_matches.items()):
                if id(instrument) not in wanted:
                    continue
                for match in matches:
                    with match._lock:
                        current = match._attributes_aggregation
                        kept = {k: a for k, a in current.items() if not (k[0] == "mapping" and tag in k[1])}
                        dropped += len(current) - len(kept)
                        match._attributes_aggregation = kept
    except AttributeError as exc:  # pragma: no cover - an SDK whose internals moved: keep serving
        log.warning("cannot drop the metric series of %s=%r (OpenTelemetry SDK internals changed: %s)", key, value, exc)
    return dropped


class DecisionCounter:
    """``kvrouter.decisions{policy,reason[,pool]}``: cumulative ints, observed at collection time.

    ``counts`` holds every decision by policy and reason; ``pooled`` those placed in a model pool
    (``Decision.pool``: a model some worker declares, so its values are bounded by configuration,
    never by what clients send), which are observed with a ``pool`` label, the rest without one,
    as before pools existed. ``count`` is the hot path (a dict update, two in a pool); ``add``
    keeps the SDK Counter's signature for callers that pass an attribute dict.
    """

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.pooled: dict[tuple[str, str, str], int] = {}

    def count(self, policy: str, reason: str, pool: str = "", amount: int = 1) -> None:
        key = (policy, reason)
        counts = self.counts
        counts[key] = counts.get(key, 0) + amount
        if pool:
            pooled = self.pooled
            pkey = (policy, reason, pool)
            pooled[pkey] = pooled.get(pkey, 0) + amount

    def add(self, amount: int, attributes: Mapping[str, str]) -> None:
        self.count(attributes["policy"], attributes["reason"], attributes.get("pool", ""), amount)

    def observe(self, _: CallbackOptions) -> Iterable[Observation]:
        # copies: an exporter thread (OTLP) may collect while the event loop counts. ``pooled``
        # first: ``count`` adds to ``counts`` before ``pooled``, so the later copy of ``counts``
        # holds every pooled decision of the earlier one and no remainder goes negative
        pooled = self.pooled.copy()
        unpooled = self.counts.copy()
        for (policy, reason, pool), n in pooled.items():
            unpooled[(policy, reason)] -= n
            yield Observation(n, {"policy": policy, "reason": reason, "pool": pool})
        has_pooled = {(policy, reason) for policy, reason, _ in pooled}
        for (policy, reason), n in unpooled.items():
            if n or (policy, reason) not in has_pooled:
                yield Observation(n, {"policy": policy, "reason": reason})


class LabelledCount:
    """A counter with one label, as cumulative ints observed at collection time: ``count`` is
    the hot path (one dict update). As with the SDK Counter, a label value is reported once it
    has been counted, so a scrape shows the same series either way."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.counts: dict[str, int] = {}

    def count(self, value: str, amount: int = 1) -> None:
        counts = self.counts
        counts[value] = counts.get(value, 0) + amount

    def add(self, amount: int, attributes: Mapping[str, str]) -> None:
        """The SDK Counter's signature, for callers that pass an attribute dict."""
        self.count(attributes[self.label], amount)

    def observe(self, _: CallbackOptions) -> Iterable[Observation]:
        # copy: an exporter thread (OTLP) may collect while the event loop counts
        label = self.label
        for value, n in self.counts.copy().items():
            yield Observation(n, {label: value})


class PairCount:
    """A counter with two labels, as ``LabelledCount`` is with one (``kvrouter.rpc.rejected{rpc,code}``)."""

    def __init__(self, first: str, second: str) -> None:
        self.labels = (first, second)
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, first: str, second: str, amount: int = 1) -> None:
        key = (first, second)
        self.counts[key] = self.counts.get(key, 0) + amount

    def observe(self, _: CallbackOptions) -> Iterable[Observation]:
        a, b = self.labels
        for (x, y), n in self.counts.copy().items():
            yield Observation(n, {a: x, b: y})


class RouteLatency:
    """``kvrouter.route.duration{policy}``: values queued per Route, recorded by ``flush``.

    The queue is a deque: its append and popleft are atomic, so an exporter thread collecting
    (and flushing) while the event loop observes loses and repeats nothing.
    """

    def __init__(self, histogram: Histogram, enabled: bool) -> None:
        self.histogram = histogram
        #: False when no reader collects: every record would be built and dropped
        self.enabled = enabled
        self._pending: deque[tuple[float, str]] = deque()
        self._attributes: dict[str, dict[str, str]] = {}

    def observe(self, seconds: float, policy: str) -> None:
        if self.enabled:
            pending = self._pending
            pending.append((seconds, policy))
            if len(pending) >= FLUSH_AT:
                self.flush()

    def record(self, seconds: float, attributes: Mapping[str, str]) -> None:
        """The SDK Histogram's signature, for callers that pass an attribute dict."""
        self.observe(seconds, attributes["policy"])

    def flush(self) -> None:
        """Record every queued value into the SDK histogram, one attribute dict per policy."""
        pending = self._pending
        record = self.histogram.record
        by_policy = self._attributes
        while pending:
            try:
                seconds, policy = pending.popleft()
            except IndexError:  # another thread took the last one
                return
            attributes = by_policy.get(policy)
            if attributes is None:
                attributes = by_policy[policy] = {"policy": policy}
            record(seconds, attributes)


class Tally:
    """A counter without labels, as a cumulative int observed at collection time: ``add`` is the
    hot path (an int add; the SDK Counter's costs ~6 us of attribute handling). Exported at
    zero from the start, as ``kvrouter.route.errors`` is, so rate() sees the first increase."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, amount: int) -> None:
        self.value += amount

    def observe(self, _: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self.value)


class Completions:
    """What each Complete reports, queued, and recorded into the SDK instruments by ``flush``:
    ``kvrouter.request.ttft`` / ``.e2e`` / ``.prefill_hop{worker,policy[,model][,phase]}`` (each
    value), ``kvrouter.completed.prompt_tokens{worker[,model]}`` and
    ``.cached_tokens{worker[,model],source}`` (summed per series, added once per flush).

    An SDK ``Histogram.record`` or ``Counter.add`` spends ~6 us cleaning and hashing its
    attributes. Made inline, a Complete that reported its TTFT and end-to-end time spent 14 us
    of the request path on them (in process; the token counts were already summed here), and
    under load each ran with the request path's caches cold. Queued, a Complete costs one
    append (0.5 us); the records run in one warm loop once ``FLUSH_AT`` are queued or on the
    daemon's maintenance tick, where values carry no exemplar (as Route durations do not).

    The queue is a deque (atomic append and popleft), as ``RouteLatency``'s, so an exporter
    thread flushing while the event loop observes loses nothing; a collection flushes first
    (``Metrics._collecting``), so a scrape is exact. A flush holds ``lock`` from its first pop
    to its last record, so ``Metrics.forget_worker`` (which holds it across its own flush and
    the drop) never drops a series that a flush on an exporter thread then brings back.
    """

    def __init__(self, ttft: Histogram, e2e: Histogram, prefill_hop: Histogram, prompt_tokens: Counter,
                 cached_tokens: Counter) -> None:
        self.ttft, self.e2e, self.prefill_hop = ttft, e2e, prefill_hop
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        #: (worker, policy, model, ttft_s, e2e_s, prefill_s, kv_transfer_s, prompt, engine_cached
        #: (-1: not reported), router_cached); a time <= 0 was not reported
        self._pending: deque[tuple[str, str, str, float, float, float, float, int, int, int]] = deque()
        #: (worker, policy, model) -> its latency histograms' attributes, built once per series
        self._attributes: dict[tuple[str, str, str], dict[str, str]] = {}
        self.lock = threading.RLock()

    def observe(self, worker_id: str, policy: str, model: str, completion: Completion, prompt: int,
                router_cached: int) -> None:
        """One Complete: ``router_cached`` is the prompt tokens the router predicted were cached."""
        pending = self._pending
        pending.append((worker_id, policy, model, completion.ttft_ms, completion.e2e_ms, completion.prefill_ms,
                        completion.kv_transfer_ms, prompt, completion.cached_tokens, router_cached))
        if len(pending) >= FLUSH_AT:
            self.flush()

    def forget_worker(self, worker_id: str) -> None:
        with self.lock:
            self._attributes = {k: v for k, v in self._attributes.items() if k[0] != worker_id}

    def flush(self) -> None:
        pending = self._pending
        sums: dict[tuple[str, str], list[int]] = {}
        ttft, e2e, prefill_hop = self.ttft.record, self.e2e.record, self.prefill_hop.record
        with self.lock:
            by_series = self._attributes
            while pending:
                worker_id, policy, model, ttft_ms, e2e_ms, prefill_ms, kv_ms, prompt, engine_cached, router_cached = (
                    pending.popleft())
                if ttft_ms > 0 or e2e_ms > 0 or prefill_ms > 0 or kv_ms > 0:
                    key = (worker_id, policy, model)
                    attributes = by_series.get(key)
                    if attributes is None:
                        if len(by_series) >= MAX_COMPLETION_SERIES:  # models are client-sent names
                            by_series.clear()
                        attributes = {"worker": worker_id, "policy": policy}
                        if model:
                            attributes["model"] = model
                        by_series[key] = attributes
                    if ttft_ms > 0:
                        ttft(ttft_ms / 1000.0, attributes)
                    if e2e_ms > 0:
                        e2e(e2e_ms / 1000.0, attributes)
                    for phase, ms in (("prefill", prefill_ms), ("kv_transfer", kv_ms)):
                        if ms > 0:
                            prefill_hop(ms / 1000.0, {**attributes, "phase": phase})
                if engine_cached < 0:  # the engine did not say
                    continue
                total = sums.get((worker_id, model))
                if total is None:
                    sums[(worker_id, model)] = [prompt, engine_cached, router_cached]
                else:
                    total[0] += prompt
                    total[1] += engine_cached
                    total[2] += router_cached
            for (worker_id, model), (prompt, engine_cached, router_cached) in sums.items():
                per_worker = {"worker": worker_id, "model": model} if model else {"worker": worker_id}
                self.prompt_tokens.add(prompt, per_worker)
                self.cached_tokens.add(engine_cached, {**per_worker, "source": "engine"})
                self.cached_tokens.add(router_cached, {**per_worker, "source": "router"})


class Metrics:
    """The daemon's instruments. ``gauges`` callbacks read router state at collection time."""

    def __init__(
        self,
        provider: MeterProvider,
        index_blocks: Callable[[], int],
        worker_modes: Callable[[], Iterable[tuple[str, str, str, int]]],
        speculative: Callable[[], tuple[Mapping[str, int], int]] | None = None,
        decode_workers_without_events: Callable[[], int] = lambda: 0,
        loop_reads: LoopReads | None = None,
    ) -> None:
        meter = provider.get_meter("kvrouterd")
        if loop_reads is not None:  # the daemon's: observable callbacks run on its event loop
            meter = loop_reads.meter(meter)
        self.decisions = DecisionCounter()
        meter.create_observable_counter(
            "kvrouter.decisions", [self._collecting], description="routing decisions by policy and reason"
        )
        self.route_errors = meter.create_counter("kvrouter.route.errors", description="Route calls rejected, by gRPC code")
        # exported at zero from the start: a counter first seen at 1 hides that rejection from
        # rate() and increase(), so the shed alert and the dashboard would miss the first burst
        for code in ROUTE_ERROR_CODES:
            self.route_errors.add(0, {"code": code})
        # every call (and RouteStream item) a handler refused or failed, by RPC (server.call_errors)
        self.rejected_calls = PairCount("rpc", "code")
        meter.create_observable_counter(
            "kvrouter.rpc.rejected", [self.rejected_calls.observe],
            description="calls and RouteStream items refused with a status other than OK/INTERNAL, by rpc and code",
        )
        self.internal_errors = LabelledCount("rpc")
        meter.create_observable_counter(
            "kvrouter.internal_errors", [self.internal_errors.observe],
            description="unexpected exceptions in handlers (answered INTERNAL and logged), by rpc",
        )
        self.route_latency = RouteLatency(
            meter.create_histogram(
                "kvrouter.route.duration", unit="s", description="time to decide a Route (hash + match + policy)",
                explicit_bucket_boundaries_advisory=ROUTE_LATENCY_BUCKETS,
            ),
            enabled=_has_readers(provider),
        )
        self.event_batches = LabelledCount("outcome")
        meter.create_observable_counter(
            "kvrouter.events.batches", [self.event_batches.observe], description="event batches by outcome"
        )
        self.blocks = LabelledCount("op")
        meter.create_observable_counter(
            "kvrouter.events.blocks", [self.blocks.observe], description="blocks stored/removed by events"
        )
        self.gaps = meter.create_counter("kvrouter.events.gaps", description="sequence gaps detected, per worker")

        def _index(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(index_blocks())

        def _workers(_: CallbackOptions) -> Iterable[Observation]:
            for worker_id, mode, state, cached in worker_modes():
                yield Observation(cached, {"worker": worker_id, "mode": mode, "state": state})

        def _blind_decoders(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(decode_workers_without_events())

        meter.create_observable_gauge("kvrouter.index.blocks", [_index], description="blocks in the global index that routing sees (a removed worker's go at once)")
        meter.create_observable_gauge(
            "kvrouter.pd.decode_workers_without_events", [_blind_decoders],
            description="decode-role workers in events mode that never published a KV event: the prefill/decode "
                        "bypass check cannot see their caches",
        )
        # prefill/decode pools (router.disagg): each Route's hop choice, and the prefill hops' timings
        self.pd_decisions = LabelledCount("reason")
        meter.create_observable_counter(
            "kvrouter.pd.decisions", [self.pd_decisions.observe],
            description="Routes in prefill/decode pools by reason: remote_prefill, decode_busy, decode_cached, prefill_saturated, never "
                        "(+decode_cache_unknown when the decode worker's cache could not be read)",
        )
        meter.create_observable_gauge(
            "kvrouter.worker.cached_blocks", [_workers], description="blocks the index holds per worker, with mode and state"
        )
        if speculative is not None:
            # ``router.speculative``: (outcome -> blocks that ended so, blocks claimed now)
            def _speculative_ended(_: CallbackOptions) -> Iterable[Observation]:
                for outcome, blocks in speculative()[0].items():
                    yield Observation(blocks, {"outcome": outcome})

            meter.create_observable_counter(
                "kvrouter.speculative.blocks", [_speculative_ended],
                description="blocks of routed prompts counted as cached before their Stored events, by how that ended: "
                            "confirmed by Stored, expired (speculative.ttl_s), dropped (Removed/Cleared, failed request, bound)",
            )
            meter.create_observable_gauge(
                "kvrouter.speculative.live_blocks", [lambda _: [Observation(speculative()[1])]],
                description="blocks of routed prompts counted as cached now and not yet confirmed by Stored events",
            )

        self.provider = provider
        # counted per batch message only, so single stream messages pay nothing
        self.stream_batches = Tally()
        meter.create_observable_counter(
            "kvrouter.route_stream.batches", [self.stream_batches.observe],
            description="RouteStream batch messages received (RouteStreamRequest.batch)",
        )
        self.stream_batch_items = Tally()
        meter.create_observable_counter(
            "kvrouter.route_stream.batch_items", [self.stream_batch_items.observe],
            description="Route and Complete items those batches carried",
        )
        self.namespace_misses = meter.create_counter(
            "kvrouter.route.namespace_misses",
            description="Routes that matched nothing under a model/LoRA no engine stored blocks for, while others did",
        )
        # what Complete reports: per worker and policy, with the model where the caller gave one
        self.recording_completions = _has_readers(provider)
        self.ttft = meter.create_histogram(
            "kvrouter.request.ttft", unit="s", description="time to first token the caller observed, per worker and policy",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS,
        )
        self.e2e = meter.create_histogram(
            "kvrouter.request.e2e", unit="s", description="end-to-end request time the caller observed, per worker and policy",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_hop = meter.create_histogram(
            "kvrouter.request.prefill_hop", unit="s",
            description="a disaggregated request's prefill (phase=prefill) and KV transfer (phase=kv_transfer) the caller observed",
            explicit_bucket_boundaries_advisory=REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = meter.create_counter(
            "kvrouter.completed.prompt_tokens",
            description="prompt tokens of completed requests whose engine reported its cached tokens, per worker",
        )
        self.cached_tokens = meter.create_counter(
            "kvrouter.completed.cached_tokens",
            description="cached prompt tokens of the same requests: source=engine as observed, source=router as predicted",
        )
        self.completions = Completions(self.ttft, self.e2e, self.prefill_hop, self.prompt_tokens, self.cached_tokens)
        meter.create_observable_gauge(
            "kvrouter.build.info", [lambda _: [Observation(1, build_info())]],
            description="always 1; the labels name the kvrouterd version, Python and the index fast path",
        )

    def forget_worker(self, worker_id: str) -> int:
        """Drop the series labelled ``worker=worker_id`` (the worker left); returns how many."""
        # its queued completions first: recorded after the drop, they would bring its series back
        with self.completions.lock:
            self.completions.flush()
            self.completions.forget_worker(worker_id)
            return drop_series(self.provider, (self.gaps, self.ttft, self.e2e, self.prefill_hop, self.prompt_tokens,
                                               self.cached_tokens), "worker", worker_id)

    def completed(self, entry: InFlight, completion: Completion, model: str, block_size: int) -> None:
        """One Complete: latencies the caller observed, and its engine's cache hit beside our
        prediction (queued: ``Completions``)."""
        if not self.recording_completions:
            return
        if (completion.ttft_ms > 0 or completion.e2e_ms > 0 or completion.cached_tokens >= 0
                or completion.prefill_ms > 0 or completion.kv_transfer_ms > 0):
            self.completions.observe(entry.worker_id, entry.policy, model, completion, entry.prompt_tokens,
                                     min(entry.overlap_blocks * block_size, entry.prompt_tokens))

    def _collecting(self, options: CallbackOptions) -> Iterable[Observation]:
        # a collection runs every observable callback before it reads any instrument: flushing
        # here puts every finished Route into the histogram this collection reads, and every
        # Complete's tokens into the counters
        self.flush()
        return self.decisions.observe(options)

    def flush(self) -> None:
        """Record queued route latencies and completed tokens (the daemon calls this on its maintenance tick)."""
        self.route_latency.flush()
        self.completions.flush()

    def route_decided(self, policy: str, reason: str, seconds: float, pool: str = "", pd_reason: str = "") -> None:
        """One successful Route: count the decision (in its model pool, and its hop choice in a
        prefill/decode pool), record how long it took."""
        self.decisions.count(policy, reason, pool)
        if pd_reason:
            self.pd_decisions.count(pd_reason)
        self.route_latency.observe(seconds, policy)
