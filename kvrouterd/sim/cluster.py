"""Simulate a cluster of engines behind the daemon's own router, on a trace or a generator.

    kvrouterd sim cluster --trace conversation_trace.jsonl --workers 8 --rate 10 \\
        --routing cache_aware,least_loaded --eviction lru --capacity-fraction 0.3 --out report/

The router is the daemon's: ``Router(cfg.router_settings(), clock, rng)`` built from the same
``kvrouterd.config`` Config (``--config``, the daemon's YAML) through the same policy
registry, with the routing and eviction names swapped in per run. Only the edges differ:
the workload is the request source, ``SimEngine``s (``sim.engine``) serve and publish
Stored/Removed events into ``Router.apply`` (``--cache-mode events``, optionally delayed or
lost) or the router models their caches itself (``approximate``), a ``ManualClock`` moves
from event to event, and ``Router.tick`` runs at the config's ``tick_interval_s``.
Completions report the observed TTFT and end-to-end latency back through
``Router.complete``, as a gateway would.

Policy parameters come from the config file: a run of routing policy NAME uses the config's
``routing`` spec if its name is NAME, else an ``extra_routing`` entry named NAME, else the
policy's defaults (likewise ``eviction``); ``--set NAME.FIELD=VALUE`` overrides one field.

One command sweeps every routing x eviction pair over ``--rate``s and ``--seeds`` and writes
one report (``--out DIR``: report.md, results.json, PNG plots; ``--json`` prints the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import xxhash

from ..admission import AdmissionQueues, Waiting, plan_hotspot_migration, policy_slo_ms
from ..clock import ManualClock
from ..config import Config, load_config
from ..errors import ConfigError, KVRouterError, NotFound
from ..index.keys import ROOT_SEED
from ..index.workers import WorkerSpec
from ..policies import registry
from ..policies.eviction.tlru import TLRUParams
from ..policies.latency import LATENCY_FIELDS, LatencyModel, LatencyParams
from ..policies.routing.compose import ComposeParams
from ..protocols import CacheMode, Completion, EventBatch, RouteRequest
from ..router import Router, RouteResult
from . import metrics as m
from .engine import EngineParams, Job, SimEngine
from .workloads import GENERATORS, Workload, build_workload

__all__ = ["ClusterPlan", "ClusterSettings", "RunResult", "Simulation", "add_arguments", "plan", "policy_spec",
           "profiled_spec", "run", "simulate", "sweep"]

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
        try:
            self.engine.validate()
        except ValueError as exc:
            raise ConfigError(f"engine: {exc}") from None


@dataclass
class RunResult:
    routing: str
    eviction: str
    workload: str
    rate: float
    seed: int
    capacity_blocks: int
    summary: m.RunSummary
    records: list[m.RequestRecord]
    wall_s: float
    counters: dict[str, int]
    engine_stats: list[dict[str, Any]]

    def as_dict(self, with_records: bool = False) -> dict[str, Any]:
        out = {"routing": self.routing, "eviction": self.eviction, "workload": self.workload, "rate": self.rate,
               "seed": self.seed, "capacity_blocks": self.capacity_blocks, "wall_s": round(self.wall_s, 3), **self.summary.as_dict(),
               "router_counters": self.counters, "engines": self.engine_stats}
        if with_records:
            out["ttft_s"] = [r.ttft_s for r in self.records]
        return out


def policy_spec(cfg: Config, kind: str, name: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The spec to build policy ``name`` with: the config's, else defaults, plus --set overrides."""
    spec: dict[str, Any] = {"name": name}
    if kind == "routing":
        for s in (cfg.routing, *cfg.extra_routing):
            if s.get("name") == name:
                spec = dict(s)
                break
    elif cfg.eviction.get("name") == name:
        spec = dict(cfg.eviction)
    spec.update((overrides or {}).get(name, {}))
    registry.build(kind, spec)  # type: ignore[arg-type]  # fail now, naming the field
    return spec


def profiled_spec(kind: str, spec: Mapping[str, Any], engine: EngineParams, block_tokens: int) -> dict[str, Any]:
    """``spec`` with the engines' cost model filled in wherever the policy estimates time and
    the spec (config or ``--set``) leaves it unset, so routers judge the engines they route to
    as DualMap's does its profiled GPU (section 3.2):

    - a policy whose Params are ``LatencyParams`` (dualmap, min_ttft, preble) gets the
      engines' ``prefill_model`` and its coefficients (``EngineParams.latency_fields``);
    - ``tlru`` gets ``alpha`` (``prefill_ms_per_block``) as the engines' cost per block of a
      prompt that just meets its threshold ``xi``: ``xi / (tokens prefilled in xi / block)``
      (T-LRU section 1: ``xi / alpha`` uncached blocks meet the threshold); under the linear
      model that is exactly ``ms_per_1k * block_tokens / 1000``;
    - ``compose`` passes both of its inner policies through the same.

    LBGR's Cost (Eq. 5) is left alone: its ``alpha`` is the paper's per-1k-token unit
    (appendix A), not a profiled time, and its residual learns the rest.
    """
    out = dict(spec)
    name = out["name"]
    params = registry.params_class(kind, name)  # type: ignore[arg-type]
    hardware = engine.latency_fields()
    if issubclass(params, LatencyParams):
        for key in LATENCY_FIELDS:
            out.setdefault(key, hardware[key])
    if kind == "eviction" and name == "tlru" and "prefill_ms_per_block" not in out:
        xi = float(out.get("latency_threshold_ms", TLRUParams().latency_threshold_ms))
        model = LatencyModel(LatencyParams(**hardware, calibrate=False))
        tokens = model.tokens_within(xi)
        out["prefill_ms_per_block"] = (xi * block_tokens / tokens if tokens > 0
                                       else model.prefill_ms(block_tokens))
    if kind == "routing" and name == "compose":
        defaults = ComposeParams()
        for role in ("candidates", "scorer"):
            inner = {"name": out.get(role, getattr(defaults, role)), **out.get(f"{role}_params", {})}
            profiled = profiled_spec(kind, inner, engine, block_tokens)
            del profiled["name"]
            out[f"{role}_params"] = profiled
    return out


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
        cfg = dataclasses.replace(cfg, block_size=bs, routing=routing_spec, eviction=eviction_spec,
                                  extra_routing=[s for s in cfg.extra_routing if s.get("name") != routing_spec["name"]])
        self.cfg = cfg
        self.clock = ManualClock()
        # the router's generator is seeded exactly as the daemon's (``Daemon(seed=...)``), so a
        # recorded log replays through the gRPC server to the same decisions
        self.router = Router(cfg.router_settings(), self.clock, random.Random(seed))
        rng = random.Random(f"kvrouterd-sim-{seed}")
        self._loss_rng = random.Random(rng.getrandbits(64))
        self.keys = _Keys(bs)
        self.slo_ms = settings.slo_ms or cfg.default_ttft_slo_ms
        self.engines: list[SimEngine] = []
        self._by_id: dict[str, int] = {}
        self._seq: list[int] = []
        for i in range(settings.workers):
            wid = f"w{i}"
            self.router.add_worker(WorkerSpec(id=wid, address=f"{wid}.sim:8000", capacity_blocks=settings.engine.capacity_blocks,
                                              mode=settings.cache_mode))
            self.engines.append(SimEngine(wid, settings.engine, eviction_spec, random.Random(rng.getrandbits(64)), bs,
                                          self.keys.block_bytes))
            self._by_id[wid] = i
            self._seq.append(0)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = itertools.count()
        self.records: list[m.RequestRecord | None] = [None] * len(workload.requests)
        self.load_samples: list[float] = []
        self.events_lost = 0
        #: with ``record``: every call into the router, in order, as (op, time, payload, result):
        #: ("route", t, RouteRequest, worker_id), ("events", t, EventBatch, None),
        #: ("complete", t, Completion, None), ("tick", t, None, None),
        #: ("load", t, (worker_id, queued, running, kv_utilization), None); in admission queue
        #: mode also ("arrive", t, RouteRequest, None) when the Route call is made, its "route"
        #: following when the request is admitted
        self.log: list[tuple[str, float, Any, Any]] | None = [] if record else None
        #: the daemon's admission queues (``kvrouterd.admission``, the same pure objects), or None
        self.admission = (AdmissionQueues(settings.admission_max_inflight, on_change=self.router.note_admission_queue)
                          if settings.admission_max_inflight else None)
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
        batch = EventBatch(engine.worker_id, self._seq[i], tuple(engine.outbox))
        engine.outbox.clear()
        self._seq[i] += 1
        s = self.settings
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
        if self.admission is None:
            result = self.router.route(rr, explain=False)
            self._dispatch(n, rr, result, now, (time.perf_counter() - started) * 1e6)
            return
        # admission queue mode, as the daemon's AdmissionGate runs it; the log records the call
        # now and its answer ("route") when the request is admitted, possibly later
        if self.log is not None:
            self.log.append(("arrive", now, rr, None))
        router, queues = self.router, self.admission
        decision, ctx, policy = router.decide(rr, explain=False)
        wid = decision.worker_id
        worker = router.workers.get(wid)
        if not queues.queue(wid) and queues.may_dispatch(worker.inflight_requests):
            result = router.commit(decision, ctx, policy)
            self._dispatch(n, rr, result, now, (time.perf_counter() - started) * 1e6)
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

    def _dispatch(self, n: int, rr: RouteRequest, result: RouteResult, now: float, route_us: float) -> None:
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
        self.engines[i].enqueue(job)
        self._kick(i, now)

    def _step_done(self, i: int, now: float) -> None:
        engine = self.engines[i]
        tpot = self.settings.engine.decode_step_seconds(1)
        batched = self.settings.engine.decode_model == "batched"
        for job in engine.finish_step(now):
            if not batched:
                self._push(now + max(job.req.output_tokens - 1, 0) * tpot, _FINISH, (i, job))
        self._publish(i, now)
        if batched:
            finished, engine.finished = engine.finished, []
            for job in finished:
                self._finish(i, job, now, kick=False)  # free all their room before the next step
        self._kick(i, now)

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
        try:
            self.router.complete(completion)
        except NotFound:
            pass  # expired by the router's in-flight timeout, as the daemon would have
        if self.admission is not None:
            self._admit((self.engines[i].worker_id,), now)
        if kick:
            self._kick(i, now)

    def _report_load(self, now: float) -> None:
        cap = self.settings.engine.capacity_blocks
        for e in self.engines:
            queued = len(e.waiting) + len(e.prefilling)
            report = (e.worker_id, queued, e.running - len(e.prefilling),
                      min(1.0, (e.cached_blocks + e.reserved) / cap) if cap else 0.0)
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
                    ticks += 1
                    if ticks % expire_every == 0:  # as the daemon's maintenance loop does
                        router.expire_inflight()
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
                    self._apply(obj, t)
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
        evict_s = sum(e.rank_seconds for e in self.engines)
        evict_n = sum(e.rank_calls for e in self.engines)
        summary = m.summarize(done, len(self.engines), self.slo_ms, self.load_samples, evict_s, evict_n)
        counters = dict(router.counters, events_lost=self.events_lost, unfinished=len(measured) - len(done),
                        admission_queued=self.queued_requests, migrations=self.migrations)
        for policy_counts in router.policy_counters().values():  # e.g. DualMap's A.7 rule firing
            for key, count in policy_counts.items():
                counters[key] = counters.get(key, 0) + count
        stats = [{"worker": e.worker_id, "cached_blocks": e.cached_blocks, "peak_blocks": e.peak_blocks,
                  "evicted_blocks": e.evicted_blocks, "uncacheable_requests": e.uncacheable,
                  "preempted": e.preempted} for e in self.engines]
        return RunResult(router.default_routing, router.eviction.name, self.workload.name, self.rate, self.seed,
                         self.settings.engine.capacity_blocks, summary, done, wall, counters, stats)


def simulate(cfg: Config, workload: Workload, settings: ClusterSettings, *, routing: str | Mapping[str, Any],
             eviction: str | Mapping[str, Any], seed: int = 0, rate: float = 0.0,
             progress: Callable[[float], None] | None = None) -> RunResult:
    """Run ``workload`` through a fresh router and fleet; see ``Simulation``."""
    return Simulation(cfg, workload, settings, routing=routing, eviction=eviction, seed=seed, rate=rate,
                      progress=progress).run()


# ---- sweeps ---------------------------------------------------------------------------------

class _Progress:
    """A tqdm progress bar on stderr: runs done (fractional within the current run) and its label.
    Off when ``out`` is None or not a terminal, so logs and CI output stay clean."""

    def __init__(self, total: int, out: TextIO | None) -> None:
        from tqdm import tqdm

        self.total, self.done, self.label = total, 0, ""
        self.out = out
        self._bar = tqdm(total=total, unit="run", file=out, disable=out is None or not out.isatty(),
                         bar_format="{l_bar}{bar}| {n:.1f}/{total} runs [{elapsed}<{remaining}]", dynamic_ncols=True)

    def start(self, label: str) -> None:
        self.label = label
        self._bar.set_description_str(label[:60], refresh=False)
        self.update(0.0)

    def update(self, frac: float) -> None:
        self._bar.n = self.done + frac
        if frac == 0.0:
            self._bar.refresh()
        else:
            self._bar.update(0)  # redraws at tqdm's own pace (mininterval)

    def finish_run(self) -> None:
        self.done += 1
        if self.label:
            self._bar.set_description_str(self.label[:60], refresh=False)
        self.update(0.0)
        if self.done == self.total:
            self._bar.close()


def sweep(cfg: Config, workload_for: Callable[[int, float | None], Workload], settings: ClusterSettings,
          routings: Sequence[Mapping[str, Any]], evictions: Sequence[Mapping[str, Any]], rates: Sequence[float | None],
          seeds: Sequence[int], capacity_for: Callable[[Workload], int] | None = None,
          out: TextIO | None = sys.stderr) -> list[RunResult]:
    """Every routing x eviction pair at every rate and seed, one fresh router per run."""
    bar = _Progress(len(routings) * len(evictions) * len(rates) * len(seeds), out)
    results = []
    for rate in rates:
        for seed in seeds:
            wl = workload_for(seed, rate)
            s = settings
            if capacity_for is not None:
                s = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, capacity_blocks=capacity_for(wl)))
            for r_spec in routings:
                for e_spec in evictions:
                    bar.start(f"{r_spec['name']}+{e_spec['name']} rate={rate or 'trace'} seed={seed}")
                    results.append(simulate(cfg, wl, s, routing=r_spec, eviction=e_spec, seed=seed, rate=rate or 0.0,
                                            progress=bar.update))
                    bar.finish_run()
    return results


# ---- command line ---------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    try:
        return m.parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace (implies --workload mooncake)")
    w.add_argument("--workload", choices=["mooncake", *GENERATORS], help="workload (default: mooncake with --trace)")
    w.add_argument("--rate", type=_floats, default=None, metavar="R[,R..]",
                   help="request rates to sweep, req/s, each a number or a grid LO:HI:STEP (e.g. 14:20:0.5) (trace: "
                        "timestamps rescaled; default: as recorded / generator default)")
    w.add_argument("--seeds", type=_ints, default=[0], metavar="S[,S..]", help="seeds (workload, router, engines)")
    w.add_argument("--limit", type=int, default=0, help="use the first N requests")
    w.add_argument("--max-input-tokens", type=int, default=0, help="cap trace prompts at N tokens (0 = no cap)")
    w.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE",
                   help="generator parameter (e.g. order=round_robin, prefix_ratio=0.7), repeatable")
    p = parser.add_argument_group("policies")
    p.add_argument("--config", type=Path, help="the daemon's YAML config (policy parameters, tick interval, SLO)")
    p.add_argument("--routing", default="", metavar="NAME[,NAME..]", help="routing policies (default: the config's)")
    p.add_argument("--eviction", default="", metavar="NAME[,NAME..]", help="eviction policies (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="POLICY.FIELD=VALUE",
                   help="override one policy parameter (JSON value), repeatable")
    c = parser.add_argument_group("cluster")
    c.add_argument("--workers", type=int, default=8, help="simulated engine workers (default 8)")
    cap = c.add_mutually_exclusive_group()
    cap.add_argument("--capacity-blocks", type=int, default=None, help="KV cache per worker, blocks (0 = unbounded)")
    cap.add_argument("--capacity-fraction", type=float, default=None,
                     help="cluster KV cache as a share of the workload's distinct prompt blocks, split over workers")
    c.add_argument("--cache-mode", choices=["events", "approximate"], default="events",
                   help="how the router learns the caches: engine KV events, or its own prediction (default events)")
    c.add_argument("--event-delay-ms", type=float, default=0.0, help="delay before an engine's KV events reach the router, ms")
    c.add_argument("--event-loss", type=float, default=0.0, help="probability an event batch is lost")
    c.add_argument("--slo-ms", type=float, default=0.0, help="TTFT SLO (default: the config's default_ttft_slo_ms)")
    c.add_argument("--warmup", type=int, default=0, help="leading requests excluded from metrics")
    c.add_argument("--session-end", action="store_true",
                   help="the last request of each session completes with session_ended (end-aware eviction)")
    c.add_argument("--load-report-ms", type=float, default=0.0,
                   help="engines send ReportLoad (queue, running, KV use) this often; 0 = never")
    c.add_argument("--admission-max-inflight", type=int, default=0, metavar="N",
                   help="the daemon's admission queue mode: at most N routed, uncompleted requests per worker, "
                        "the rest wait in the router (DualMap migrates them, A.1.2); 0 = off")
    e = parser.add_argument_group("engines")
    d = EngineParams()
    e.add_argument("--prefill-model", choices=["linear", "power_law"], default=d.prefill_model,
                   help=f"engine step-time model, which policies that estimate time also use unless their spec "
                        f"sets it (default {d.prefill_model}: UniCache's H100 fit, a*batch^b*(L/batch)^c)")
    e.add_argument("--prefill-ms-per-1k", type=float, default=d.prefill_ms_per_1k_tokens,
                   help=f"linear model: prefill ms per 1,000 uncached tokens (default {d.prefill_ms_per_1k_tokens})")
    e.add_argument("--tpot-ms", type=float, default=d.tpot_ms, help=f"decode time per output token, ms (default {d.tpot_ms})")
    e.add_argument("--decode-model", choices=["constant", "batched"], default=d.decode_model,
                   help=f"batched: decoding runs in the engine's steps beside prefill chunks (interference); constant: "
                        f"tpot per token beside the engine (default {d.decode_model})")
    e.add_argument("--decode-batch-slope", type=float, default=d.decode_batch_slope,
                   help=f"batched: a decode step of D requests lasts tpot * (1 + slope * (D - 1)) (default "
                        f"{d.decode_batch_slope}: KV reads at an 8k context, see sim.engine)")
    e.add_argument("--decode-kv", action=argparse.BooleanOptionalAction, default=d.decode_kv,
                   help="batched: generated tokens take KV blocks; when none is free, evict, else preempt the newest "
                        "decoding request (vLLM's recompute) instead of waiting (default on)")
    e.add_argument("--attention-context-tokens", type=float, default=d.attention_context_tokens,
                   help=f"prefill chunks also pay attention to the context before them, costing a token's linear "
                        f"layers per this many context tokens (default {d.attention_context_tokens:.0f}, "
                        f"Llama-3.1-8B's FLOP ratio; 0 = chunks priced alone)")
    e.add_argument("--hardware-speed", type=float, default=d.hardware_speed,
                   help="divides every compute time, prefill and decode (2 = a GPU twice as fast; default 1)")
    e.add_argument("--cache-decode", action="store_true",
                   help="engines cache the blocks a request's generated tokens fill, marked decode (vLLM's behaviour)")
    e.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help=f"prefill tokens per engine step, the chunked-prefill budget (default {d.max_batch_tokens})")
    e.add_argument("--max-running", type=int, default=d.max_running,
                   help=f"requests an engine runs at once (default {d.max_running}, vLLM's max_num_seqs)")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print every number as JSON")
    o.add_argument("--out", type=Path, help="write report.md, results.json and PNG plots here")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def _kv(items: Sequence[str], flag: str) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.append((key.strip(), value))
    return out


@dataclass
class ClusterPlan:
    """What a ``sim cluster`` command line asks for, ready to run (``sweep``) or to split into
    single runs (``sim reproduce``): one workload per (seed, rate), the policies, the fleet."""

    cfg: Config
    workload_name: str
    workload_for: Callable[[int, float | None], Workload]
    settings: ClusterSettings
    routings: list[dict[str, Any]]
    evictions: list[dict[str, Any]]
    rates: list[float | None]
    seeds: list[int]
    capacity_for: Callable[[Workload], int] | None
    meta: dict[str, Any]

    def settings_for(self, wl: Workload) -> ClusterSettings:
        """The fleet for one workload (``--capacity-fraction`` sizes caches from the workload)."""
        if self.capacity_for is None:
            return self.settings
        engine = dataclasses.replace(self.settings.engine, capacity_blocks=self.capacity_for(wl))
        return dataclasses.replace(self.settings, engine=engine)


def plan(args: argparse.Namespace) -> ClusterPlan:
    """Validate parsed ``sim cluster`` arguments into a plan; raises ConfigError/ValueError."""
    cfg = load_config(args.config, environ={})
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in _kv(args.set, "--set"):
        policy, dot, fname = key.partition(".")
        if not dot:
            raise ConfigError(f"--set expects POLICY.FIELD=VALUE, got {key!r}")
        overrides.setdefault(policy, {})[fname] = value
    routing_names = [n for n in args.routing.split(",") if n] or [cfg.routing["name"]]
    eviction_names = [n for n in args.eviction.split(",") if n] or [cfg.eviction["name"]]
    unused = sorted(set(overrides) - set(routing_names) - set(eviction_names))
    if unused:
        raise ConfigError(f"--set names policy {unused[0]!r}, which is not in --routing or --eviction")
    routings = [policy_spec(cfg, "routing", n, overrides) for n in routing_names]
    evictions = [policy_spec(cfg, "eviction", n, overrides) for n in eviction_names]
    if not args.workload and not args.trace:
        raise ConfigError("give --trace FILE or --workload NAME")
    name: str = args.workload or "mooncake"
    wparams = dict(_kv(args.workload_param, "--workload-param"))
    engine = EngineParams(capacity_blocks=args.capacity_blocks or 0, max_batch_tokens=args.max_batch_tokens,
                          max_running=args.max_running, prefill_model=args.prefill_model,
                          prefill_ms_per_1k_tokens=args.prefill_ms_per_1k, tpot_ms=args.tpot_ms,
                          cache_decode=args.cache_decode, decode_model=args.decode_model,
                          decode_batch_slope=args.decode_batch_slope, decode_kv=args.decode_kv,
                          attention_context_tokens=args.attention_context_tokens, hardware_speed=args.hardware_speed)
    settings = ClusterSettings(
        workers=args.workers, engine=engine,
        cache_mode=CacheMode.EVENTS if args.cache_mode == "events" else CacheMode.APPROXIMATE,
        event_delay_s=args.event_delay_ms / 1000.0, event_loss=args.event_loss, slo_ms=args.slo_ms,
        warmup=args.warmup, load_report_interval_s=args.load_report_ms / 1000.0,
        signal_session_end=args.session_end, admission_max_inflight=args.admission_max_inflight)
    settings.validate()
    capacity_for = None
    if args.capacity_fraction is not None:
        frac = args.capacity_fraction
        if not 0 < frac:
            raise ConfigError(f"--capacity-fraction must be > 0, got {frac}")
        workers = args.workers
        capacity_for = lambda wl: max(1, int(frac * wl.unique_blocks() / workers))  # noqa: E731

    def workload_for(seed: int, rate: float | None) -> Workload:
        return build_workload(name, seed, rate, trace=args.trace, limit=args.limit,
                              max_input_tokens=args.max_input_tokens, **dict(wparams))

    meta = {"workload": name, "workers": args.workers, "cache_mode": args.cache_mode,
            "event_delay_ms": args.event_delay_ms, "event_loss": args.event_loss, "engine": dataclasses.asdict(engine),
            "capacity_fraction": args.capacity_fraction}
    return ClusterPlan(cfg, name, workload_for, settings, routings, evictions, list(args.rate or [None]),
                       list(args.seeds), capacity_for, meta)


def run(args: argparse.Namespace) -> int:
    from . import report

    try:
        p = plan(args)
        results = sweep(p.cfg, p.workload_for, p.settings, p.routings, p.evictions, p.rates, p.seeds,
                        p.capacity_for, out=None if args.quiet else sys.stderr)
    except (KVRouterError, ValueError, OSError) as exc:
        print(f"kvrouterd sim cluster: {exc}", file=sys.stderr)
        return 2
    meta = dict(p.meta, command="kvrouterd sim cluster " + " ".join(sys.argv[3:]))
    doc = report.build(results, meta)
    if args.out:
        report.write(doc, results, args.out)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(report.table(doc))
    return 0
