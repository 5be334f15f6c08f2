"""One simulated run: a workload through the daemon's own Router and a fleet of engines, event by event.

The router is the daemon's: ``Router(cfg.router_settings(), clock, rng)`` built from the same
``kvrouterd.config`` Config through the same policy registry, with the run's routing and
eviction specs (``sim.policy_specs``) swapped in. Only the edges differ: the workload is the
request source, ``SimEngine``s (``sim.engine``) serve and publish Stored/Removed events into
``Router.apply`` (``CacheMode.EVENTS``, optionally delayed or lost) or the router models
their caches itself (``APPROXIMATE``), a ``ManualClock`` moves from event to event, and
``Router.tick`` runs at the config's ``tick_interval_s``. Completions report the observed
TTFT and end-to-end latency back through ``Router.complete``, as a gateway would.

With the clairvoyant ``belady`` eviction (``sim.belady``) the engines evict by the workload's
future, which only the simulator knows; the router's own eviction policy is then LRU, which in
events mode only keeps books (it ranks only for EvictHint and approximate-mode cache models,
so ``belady`` needs ``CacheMode.EVENTS``).

``Simulation.run`` takes the earliest of the next arrival, an engine step ending, a request
finishing and a delayed event batch, after the ticks, load samples and ReportLoad calls due
before it. ``simulate`` is one run; ``sim.cluster_cli`` (``kvrouterd sim cluster``) sweeps
policy pairs, rates and seeds and writes the report.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..admission import AdmissionQueues, Waiting, plan_hotspot_migration, policy_slo_ms
from ..clock import ManualClock
from ..config import Config
from ..deadline import DEADLINE_MODES, DeadlineGuard, Pricing, admit_priced, nothing_queued
from ..errors import ConfigError, NotFound, SloUnreachable
from ..index.keys import ROOT_SEED
from ..index.workers import WorkerSpec
from ..policies.latency import LatencyParams
from ..protocols import CacheMode, Completion, EventBatch, RouteRequest
from ..router import Router, RouteResult
from . import metrics as m
from .belady import NextUse
from .engine import EngineParams, FleetMemory, Job, PooledEngine, SimEngine
from .policy_specs import build_eviction, profiled_spec, simulator_only
from .results import RunResult
from .workloads import Workload

__all__ = ["ClusterSettings", "Simulation", "simulate"]

_DELIVER, _STEP, _FINISH = 0, 1, 2
_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class ClusterSettings:
    """The simulated fleet and its edges (everything the router config does not say)."""

    workers: int = 8
    engine: EngineParams = field(default_factory=EngineParams)
    cache_mode: CacheMode = CacheMode.EVENTS
    #: seconds between an engine's event and the router applying it
    event_delay_s: float = 0.0
    #: probability that an event batch is lost (the router sees a sequence gap)
    event_loss: float = 0.0
    #: TTFT objective for attainment and for policies that read request SLOs (0 = config's)
    slo_ms: float = 0.0
    #: requests at the start excluded from the metrics (they still run)
    warmup: int = 0
    #: seconds between load-imbalance samples
    sample_interval_s: float = 1.0
    #: seconds between each engine's ReportLoad (queued, running, KV use); 0 = engines never report
    load_report_interval_s: float = 0.0
    #: the client says when a conversation ends: the last request of each session completes
    #: with ``session_ended`` and the engines' policies hear ``end_session`` (end-aware T-LRU)
    signal_session_end: bool = False
    #: the daemon's admission queue mode (``admission.max_inflight``): a worker takes at most
    #: this many routed, uncompleted requests, the rest wait in its queue inside the router,
    #: where DualMap's hotspot migration (A.1.2) can move them; 0 = off (dispatch at once)
    admission_max_inflight: int = 0
    #: the daemon's deadline admission (``admission.deadline``, ``kvrouterd.deadline``): off,
    #: shed (refuse at arrival a request predicted to miss its SLO on every worker) or defer
    #: (also drop a queued one once it can no longer meet it; needs admission_max_inflight).
    #: Its TTFT model is the engines' profile, as ``profiled_spec`` gives the policies.
    #: None: the config's, so a simulation runs what the daemon with that config runs
    admission_deadline: str | None = None
    #: the share of admitted requests deadline admission aims to see meet their SLO
    #: (``admission.deadline_quantile``; None: the config's)
    admission_deadline_quantile: float | None = None
    #: the gateway reports each request's first token (a ``prefill_done`` Complete with its
    #: TTFT, as ext_proc does on the first response chunk), so deadline admission learns a TTFT
    #: when it happens, not when the request ends
    first_token_reports: bool = True
    #: a bound, not a fleet (``engine.FleetMemory``): the engines' KV memory is one pool of the
    #: fleet's summed capacity that every engine reads, fills, pins and reserves in (any prefix
    #: any engine computed is a hit everywhere, no block is held twice, no engine lacks room
    #: another has), and the router hears every engine's events as every worker's, so its view
    #: is that pool. No routing of separate engines reuses more or balances memory better
    shared_cache: bool = False

    def validate(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.event_delay_s < 0:
            raise ConfigError(f"event delay must be >= 0, got {self.event_delay_s}")
        if not 0.0 <= self.event_loss < 1.0:
            raise ConfigError(f"event loss must be in [0, 1), got {self.event_loss}")
        if self.slo_ms < 0 or self.warmup < 0 or self.sample_interval_s <= 0 or self.load_report_interval_s < 0:
            raise ConfigError("slo_ms, warmup and load_report_interval_s must be >= 0, sample_interval_s > 0")
        if self.admission_max_inflight < 0:
            raise ConfigError(f"admission max_inflight must be >= 0 (0 = off), got {self.admission_max_inflight}")
        if self.admission_deadline is not None and self.admission_deadline not in DEADLINE_MODES:
            raise ConfigError(f"admission deadline: expected one of {', '.join(DEADLINE_MODES)}, "
                              f"got {self.admission_deadline!r}")
        if self.admission_deadline == "defer" and not self.admission_max_inflight:
            raise ConfigError("admission deadline defer holds requests in admission queues: set admission max_inflight")
        try:
            self.engine.validate()
        except ValueError as exc:
            raise ConfigError(f"engine: {exc}") from None
        if self.shared_cache and self.cache_mode is not CacheMode.EVENTS:
            raise ConfigError("the router hears a fleet-wide cache through its engines' events: "
                              "shared_cache needs events cache mode")



class _Keys:
    """Block ids -> the router's chained block keys, and ids -> the token bytes engines publish.

    An id's block holds ``block_tokens`` tokens whose first two carry the id, so distinct
    ids hash apart and the router, rehashing a Stored event's tokens, gets the same keys.
    """

    def __init__(self, block_tokens: int) -> None:
        if block_tokens < 2:
            raise ConfigError("block_tokens must be >= 2")
        self._pad = bytes(block_tokens * 4 - 8)
        self._memo: dict[tuple[int, int], int] = {}

    def block_bytes(self, block_id: int) -> bytes:
        return block_id.to_bytes(8, "little") + self._pad

    def keys(self, ids: Sequence[int]) -> list[int]:
        memo = self._memo
        prev = ROOT_SEED
        out = []
        for h in ids:
            k = memo.get((prev, h))
            if k is None:
                k = _xxh3(self.block_bytes(h), prev)
                memo[(prev, h)] = k
            out.append(k)
            prev = k
        return out


class Simulation:
    """One run: a workload through one router and its engines. ``run()`` returns the result."""

    def __init__(self, cfg: Config, workload: Workload, settings: ClusterSettings, *, routing: str | Mapping[str, Any],
                 eviction: str | Mapping[str, Any], seed: int = 0, rate: float = 0.0,
                 progress: Callable[[float], None] | None = None, record: bool = False) -> None:
        settings.validate()
        self.settings = settings
        self.workload = workload
        self.seed = seed
        self.rate = rate
        self.progress = progress
        bs = workload.block_tokens
        routing_spec = profiled_spec("routing", {"name": routing} if isinstance(routing, str) else routing,
                                     settings.engine, bs)
        eviction_spec = profiled_spec("eviction", {"name": eviction} if isinstance(eviction, str) else eviction,
                                      settings.engine, bs)
        self.eviction_name: str = eviction_spec["name"]
        router_eviction = eviction_spec
        self.keys = _Keys(bs)
        future = None
        if simulator_only("eviction", eviction_spec):
            if settings.cache_mode is not CacheMode.EVENTS:
                raise ConfigError(f"eviction {self.eviction_name} runs in the engines only: it needs events cache mode")
            future = NextUse.of(workload, self.keys.keys)
            router_eviction = {"name": "lru"}  # keeps books only (see the module docstring)
        cfg = dataclasses.replace(cfg, block_size=bs, routing=routing_spec, eviction=router_eviction,
                                  extra_routing=[s for s in cfg.extra_routing if s.get("name") != routing_spec["name"]])
        self.cfg = cfg
        self.clock = ManualClock()
        # the router's generator is seeded exactly as the daemon's (``Daemon(seed=...)``), so a
        # recorded log replays through the gRPC server to the same decisions
        self.router = Router(cfg.router_settings(), self.clock, random.Random(seed))
        rng = random.Random(f"kvrouterd-sim-{seed}")
        self._loss_rng = random.Random(rng.getrandbits(64))
        self.slo_ms = settings.slo_ms or cfg.default_ttft_slo_ms
        self.engines: list[SimEngine] = []
        self._by_id: dict[str, int] = {}
        self._seq: list[int] = []
        memory = None
        engine_params = settings.engine
        if settings.shared_cache:
            memory = FleetMemory(build_eviction(eviction_spec, random.Random(rng.getrandbits(64)), future))
            # each engine may fill all the pool's free room, so each declares and reports the pool's
            engine_params = dataclasses.replace(engine_params, capacity_blocks=engine_params.capacity_blocks * settings.workers)
        for i in range(settings.workers):
            wid = f"w{i}"
            self.router.add_worker(WorkerSpec(id=wid, address=f"{wid}.sim:8000", capacity_blocks=engine_params.capacity_blocks,
                                              mode=settings.cache_mode))
            if memory is not None:
                self.engines.append(PooledEngine(wid, engine_params, memory, bs, self.keys.block_bytes))
            else:
                policy = build_eviction(eviction_spec, random.Random(rng.getrandbits(64)), future)
                self.engines.append(SimEngine(wid, settings.engine, policy, bs, self.keys.block_bytes))
            self._by_id[wid] = i
            self._seq.append(0)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = itertools.count()
        self.records: list[m.RequestRecord | None] = [None] * len(workload.requests)
        self.load_samples: list[float] = []
        self.events_lost = 0
        #: with ``record``: every call into the router, in order, as (op, time, payload, result):
        #: ("route", t, RouteRequest, worker_id), ("shed", t, RouteRequest, None) (deadline
        #: admission refused it), ("events", t, EventBatch, None),
        #: ("complete", t, Completion, None), ("tick", t, None, None),
        #: ("load", t, (worker_id, queued, running, kv_utilization), None); in admission queue
        #: mode also ("arrive", t, RouteRequest, None) when the Route call is made, its "route"
        #: following when the request is admitted
        self.log: list[tuple[str, float, Any, Any]] | None = [] if record else None
        #: the daemon's admission queues (``kvrouterd.admission``, the same pure objects), or None
        self.admission = (AdmissionQueues(settings.admission_max_inflight, on_change=self.router.note_admission_queue)
                          if settings.admission_max_inflight else None)
        #: deadline admission (None = off), judging with the engines' profiled cost model
        deadline = settings.admission_deadline if settings.admission_deadline is not None else cfg.admission.deadline
        quantile = (settings.admission_deadline_quantile if settings.admission_deadline_quantile is not None
                    else cfg.admission.deadline_quantile)
        if deadline == "defer" and not settings.admission_max_inflight:
            raise ConfigError("admission deadline defer holds requests in admission queues: set admission max_inflight")
        self.guard = (DeadlineGuard(deadline, LatencyParams(**settings.engine.latency_fields(), calibrate=False),  # type: ignore[arg-type]
                                    quantile, self.router.block_size)
                      if deadline != "off" else None)
        #: requests shed or dropped by deadline admission (they count as missing their SLO)
        self.shed: set[int] = set()
        self.migrations = 0
        self.queued_requests = 0
        self._last_of_session: set[int] = set()
        if settings.signal_session_end:
            last: dict[str, int] = {}
            for n, r in enumerate(workload.requests):
                if r.session_id:
                    last[r.session_id] = n
            self._last_of_session = set(last.values())

    # ---- edges ---------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._order), obj))

    def _publish(self, i: int, now: float) -> None:
        engine = self.engines[i]
        if not engine.outbox:
            return
        s = self.settings
        if s.shared_cache:
            # every worker holds what any engine stored: the router hears it as each one's
            events = tuple(engine.outbox)
            engine.outbox.clear()
            for j, other in enumerate(self.engines):
                self._apply(EventBatch(other.worker_id, self._seq[j], events), now)
                self._seq[j] += 1
            return
        batch = EventBatch(engine.worker_id, self._seq[i], tuple(engine.outbox))
        engine.outbox.clear()
        self._seq[i] += 1
        if s.cache_mode is CacheMode.APPROXIMATE:
            return  # the router models this worker's cache itself
        if s.event_loss and self._loss_rng.random() < s.event_loss:
            self.events_lost += 1
            return
        if s.event_delay_s:
            self._push(now + s.event_delay_s, _DELIVER, batch)
        else:
            self._apply(batch, now)

    def _apply(self, batch: EventBatch, now: float) -> None:
        if self.log is not None:
            self.log.append(("events", now, batch, None))
        self.router.apply(batch)

    def _deliver(self, obj: Any, now: float) -> None:
        """Something sent earlier arrives: a delayed event batch (``sim.pd`` adds KV transfers)."""
        self._apply(obj, now)

    def _kick(self, i: int, now: float) -> None:
        engine = self.engines[i]
        if engine.busy:
            return
        duration = engine.start_step(now)
        self._publish(i, now)
        if duration is not None:
            self._push(now + duration, _STEP, i)

    # ---- handlers ------------------------------------------------------------------------
    def _arrive(self, n: int, now: float) -> None:
        req = self.workload.requests[n]
        keys = self.keys.keys(req.block_ids)
        bs = self.workload.block_tokens
        rr = RouteRequest(request_id=f"r{n}", keys=keys, prompt_tokens=max(req.input_tokens, len(keys) * bs),
                          session_id=req.session_id, task=req.task, ttft_slo_ms=self.slo_ms,
                          expected_output_tokens=req.output_tokens)
        started = time.perf_counter()
        if self.admission is None and self.guard is None:
            result = self.router.route(rr, explain=False)
            self._dispatch(n, rr, result, now, (time.perf_counter() - started) * 1e6)
            return
        # admission queue mode, as the daemon's AdmissionGate runs it; the log records the call
        # now and its answer ("route") when the request is admitted, possibly later
        if self.log is not None and self.admission is not None:
            self.log.append(("arrive", now, rr, None))
        router, queues = self.router, self.admission
        decided = router.decide(rr, explain=False)
        priced = None
        if self.guard is not None:
            try:
                queued = self._queued if queues is not None else nothing_queued
                decided, priced = admit_priced(self.guard, router, rr, decided, self.slo_ms, queued)
            except SloUnreachable:
                self.shed.add(n)
                if self.log is not None:
                    self.log.append(("shed", now, rr, None))
                return
        decision, ctx, policy = decided
        wid = decision.worker_id
        worker = router.workers.get(wid)
        if queues is None or (not queues.queue(wid) and queues.may_dispatch(worker.inflight_requests)):
            result = router.commit(decision, ctx, policy)
            self._dispatch(n, rr, result, now, (time.perf_counter() - started) * 1e6, priced)
            return
        alt = router.workers.find(decision.alternative_worker_id) if decision.alternative_worker_id else None
        uncached = {wid: ctx.uncached_tokens(worker)}
        if alt is not None:
            uncached[alt.id] = ctx.uncached_tokens(alt)
        route_us = (time.perf_counter() - started) * 1e6
        # the simulated client has no deadline: a request waits until admitted
        queues.enqueue(Waiting(rr.request_id, wid, alt.id if alt is not None else "", uncached,
                               policy_slo_ms(policy, rr, self.slo_ms), now, None, (n, rr, route_us)))
        self.queued_requests += 1
        if decision.attributes.get("both_overloaded") and alt is not None:
            plan = plan_hotspot_migration(queues, router, [wid, alt.id], policy, now)
            if plan:
                queues.apply(plan)
                self.migrations += len(plan)
                self._admit({m.target for m in plan}, now)
        self._admit([wid] + ([alt.id] if alt is not None else []), now)

    def _queued(self, worker_id: str) -> tuple[int, int]:
        if self.admission is None:
            return (0, 0)
        return (len(self.admission.queue(worker_id)), self.admission.queued_tokens(worker_id))

    def _drop_late(self, now: float) -> None:
        """``defer``: drop queued requests that can no longer meet their SLO (the daemon's tick)."""
        assert self.guard is not None and self.admission is not None
        load, estimator = self.guard.queue_estimator(self.router, now)
        for entry in self.admission.drop_late(load, estimator, now):
            self.guard.late_refusal((now - entry.enqueued_at) * 1000.0, entry.slo_ms)  # counted, as the daemon's
            self.shed.add(entry.payload[0])  # type: ignore[index]

    def _admit(self, worker_ids: Any, now: float) -> None:
        """Dispatch what the admission queues of ``worker_ids`` let in, each re-decided on its
        admitted worker alone (as the daemon's gate does)."""
        assert self.admission is not None
        for wid in worker_ids:
            worker = self.router.workers.find(wid)
            if worker is None:
                continue
            for entry in self.admission.admit(wid, worker.inflight_requests):
                n, rr, route_us = entry.payload  # type: ignore[misc]
                rr.candidate_workers = (entry.worker_id,)
                started = time.perf_counter()
                result = self.router.route(rr, explain=False)
                self._dispatch(n, rr, result, now, route_us + (time.perf_counter() - started) * 1e6)

    def _dispatch(self, n: int, rr: RouteRequest, result: RouteResult, now: float, route_us: float,
                  priced: Pricing | None = None) -> None:
        req = self.workload.requests[n]
        keys = rr.keys
        bs = self.workload.block_tokens
        if self.log is not None:
            self.log.append(("route", now, rr, result.worker.id))
        i = self._by_id[result.worker.id]
        overlap = result.decision.overlap_blocks
        output_keys = None
        if req.output_block_ids and self.settings.engine.cache_decode:
            full = req.input_tokens // bs
            output_keys = self.keys.keys((*req.block_ids[:full], *req.output_block_ids))[full:]
        job = Job(n, req, keys, max(1, req.input_tokens - overlap * bs), overlap, output_keys)
        self.records[n] = m.RequestRecord(req.arrival_s, i, len(keys), 0, req.input_tokens, req.output_tokens,
                                          math.nan, math.nan, route_us, overlap)
        if self.guard is not None:
            self.guard.on_dispatch(result.worker, rr.request_id, max(0, rr.prompt_tokens - overlap * bs), now,
                                   overlap * bs, priced)
        self.engines[i].enqueue(job)
        self._kick(i, now)

    def _step_done(self, i: int, now: float) -> None:
        engine = self.engines[i]
        tpot = self.settings.engine.decode_step_seconds(1)
        batched = self.settings.engine.decode_model == "batched"
        reports = self.guard is not None and self.settings.first_token_reports
        for job in engine.finish_step(now):
            if reports and not job.preemptions:  # its first token (a recompute's is not)
                first = Completion(f"r{job.index}", ttft_ms=(now - job.req.arrival_s) * 1000.0, prefill_done=True)
                if self.log is not None:
                    self.log.append(("first_token", now, first, None))
                self.guard.on_first_token(first.request_id, first.ttft_ms, now)
            if not batched:
                self._push(now + max(job.req.output_tokens - 1, 0) * tpot, _FINISH, (i, job))
        self._publish(i, now)
        if batched:
            finished, engine.finished = engine.finished, []
            for job in finished:
                self._finish(i, job, now, kick=False)  # free all their room before the next step
        self._wake(i, now)

    def _wake(self, i: int, now: float) -> None:
        """Engine ``i`` may have freed KV room: it takes its next step. A pooled fleet's room is
        every engine's (``shared_cache``), so every idle engine tries too, the one whose next
        request came first before the others, or room freed by one would wait unused until
        another's next arrival woke it."""
        if not self.settings.shared_cache:
            self._kick(i, now)
            return
        engines = self.engines
        for j in sorted(range(len(engines)), key=lambda j: engines[j].waiting[0].req.arrival_s
                        if engines[j].waiting else math.inf):
            self._kick(j, now)

    def _finish(self, i: int, job: Job, now: float, kick: bool = True) -> None:
        self.engines[i].finish(job, now)
        self._publish(i, now)
        req = job.req
        rec = self.records[job.index]
        assert rec is not None
        rec.hit_blocks = job.first_hit_blocks
        rec.ttft_s = job.first_token_at - req.arrival_s
        rec.e2e_s = now - req.arrival_s
        ended = job.index in self._last_of_session
        completion = Completion(f"r{job.index}", ttft_ms=rec.ttft_s * 1000.0, e2e_ms=rec.e2e_s * 1000.0,
                                cached_tokens=job.first_hit_blocks * self.workload.block_tokens,
                                output_tokens=req.output_tokens, session_ended=ended)
        if ended:
            for engine in self.engines:  # the engines' own caches hear it too
                end_session = getattr(engine.policy, "end_session", None)
                if end_session is not None:
                    end_session(req.session_id)
        if self.log is not None:
            self.log.append(("complete", now, completion, None))
        if self.guard is not None:
            self.guard.on_complete(completion.request_id, completion.ttft_ms, now, completion.e2e_ms)
        try:
            self.router.complete(completion)
        except NotFound:
            pass  # expired by the router's in-flight timeout, as the daemon would have
        if self.admission is not None:
            self._admit((self.engines[i].worker_id,), now)
        if kick:
            self._wake(i, now)

    def _report_load(self, now: float) -> None:
        for e in self.engines:
            cap = e.params.capacity_blocks  # a pooled engine's is the pool's, as is its use
            queued = len(e.waiting) + len(e.prefilling)
            # KV use as vLLM reports it (``used_blocks``): an engine whose cache is full of blocks
            # no request holds is idle to it, not full
            report = (e.worker_id, queued, e.running - len(e.prefilling),
                      min(1.0, e.used_blocks / cap) if cap else 0.0)
            if self.log is not None:
                self.log.append(("load", now, report, None))
            self.router.report_load(*report)

    def _sample_load(self) -> None:
        loads = [e.pending_tokens for e in self.engines]
        self.load_samples.append(m.cv(loads) if sum(loads) > 0 else math.nan)

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> RunResult:
        started = time.perf_counter()
        reqs = self.workload.requests
        heap = self._heap
        clock, router = self.clock, self.router
        tick = self.cfg.tick_interval_s
        sample = self.settings.sample_interval_s
        t0 = reqs[0].arrival_s if reqs else 0.0
        clock.set(max(t0, 0.0))
        next_tick = clock.now() + tick
        next_sample = clock.now() + sample
        load_every = self.settings.load_report_interval_s
        next_report = clock.now() + load_every if load_every else math.inf
        n, total = 0, len(reqs)
        ticks, expire_every = 0, max(1, round(1.0 / tick))
        report_every = max(total // 50, 1)
        while n < total or heap:
            t_arr = reqs[n].arrival_s if n < total else math.inf
            t = heap[0][0] if heap and heap[0][0] <= t_arr else t_arr
            # periodic work due before this event, in time order (ticks first on ties)
            while True:
                due = min(next_tick, next_sample, next_report)
                if due > t:
                    break
                if due == next_tick:
                    clock.set(next_tick)
                    if self.log is not None:
                        self.log.append(("tick", next_tick, None, None))
                    router.tick()
                    if self.guard is not None and self.guard.mode == "defer":
                        self._drop_late(next_tick)
                    ticks += 1
                    if ticks % expire_every == 0:  # as the daemon's maintenance loop does
                        expired = router.expire_inflight()
                        if self.guard is not None:
                            for entry in expired:
                                self.guard.on_expired(entry.request_id)
                        if self.admission is not None:
                            self._admit(self.admission.workers(), next_tick)
                    next_tick += tick
                elif due == next_sample:
                    self._sample_load()
                    next_sample += sample
                else:
                    clock.set(next_report)
                    self._report_load(next_report)
                    next_report += load_every
            clock.set(max(t, clock.now()))
            if heap and heap[0][0] <= t_arr:
                _, kind, _, obj = heapq.heappop(heap)
                if kind == _STEP:
                    self._step_done(obj, t)
                elif kind == _FINISH:
                    self._finish(obj[0], obj[1], t)
                else:
                    self._deliver(obj, t)
            else:
                self._arrive(n, t)
                n += 1
                if self.progress is not None and n % report_every == 0:
                    self.progress(n / total)
        wall = time.perf_counter() - started
        measured = self.records[self.settings.warmup:]
        # a request still waiting when events ran out never fit its engine's cache (a policy
        # that cannot free room) or never left an admission queue; count it rather than let
        # NaN into the percentiles
        done = [r for r in measured if r is not None and not math.isnan(r.e2e_s)]
        shed = sum(1 for k in self.shed if k >= self.settings.warmup)
        evict_s = sum(e.rank_seconds for e in self.engines)
        evict_n = sum(e.rank_calls for e in self.engines)
        summary = m.summarize(done, len(self.engines), self.slo_ms, self.load_samples, evict_s, evict_n, shed)
        counters = dict(router.counters, events_lost=self.events_lost,
                        unfinished=len(measured) - len(done) - shed,
                        admission_queued=self.queued_requests, migrations=self.migrations)
        if self.guard is not None:
            counters.update(self.guard.counters())
        for outcome, blocks in router.speculative.outcomes.items():  # claimed blocks, by how they ended
            counters[f"speculative_{outcome}"] = blocks
        for policy_counts in router.policy_counters().values():  # e.g. DualMap's A.7 rule firing
            for key, count in policy_counts.items():
                counters[key] = counters.get(key, 0) + count
        stats = [{"worker": e.worker_id, "cached_blocks": e.cached_blocks, "peak_blocks": e.peak_blocks,
                  "evicted_blocks": e.evicted_blocks, "uncacheable_requests": e.uncacheable,
                  "preempted": e.preempted} for e in self.engines]
        return RunResult(router.default_routing, self.eviction_name, self.workload.name, self.rate, self.seed,
                         self.settings.engine.capacity_blocks, self.workload.block_tokens, summary, done, wall,
                         counters, stats)


def simulate(cfg: Config, workload: Workload, settings: ClusterSettings, *, routing: str | Mapping[str, Any],
             eviction: str | Mapping[str, Any], seed: int = 0, rate: float = 0.0,
             progress: Callable[[float], None] | None = None) -> RunResult:
    """Run ``workload`` through a fresh router and fleet; see ``Simulation``."""
    return Simulation(cfg, workload, settings, routing=routing, eviction=eviction, seed=seed, rate=rate,
                      progress=progress).run()
