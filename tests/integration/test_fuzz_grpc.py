"""Hostile calls from hypothesis against the real grpc.aio daemon on loopback (issue #16).

Every RPC is called with hostile inputs: huge and odd ids, bad endpoints and addresses, NaN and
infinite floats, extreme integers, unknown enum values, sequences of events in and out of
order, streams mixing messages, and raw bytes that are no protobuf at all. After each call:

* the status is never UNKNOWN, INTERNAL or DEADLINE_EXCEEDED (a crash, or a hang past 10 s),
  and a RouteStream message's error code is never UNKNOWN/INTERNAL either;
* the index and load invariants hold (``tests/invariants.py``);
* a rejected call changed nothing (the router's workers, index, load and counters compared
  before and after), and ListWorkers and GetStats still answer.

One call at a time: what only concurrency finds (16 clients, membership changes racing routes
and exports, 10^6 calls) is ``fuzz_swarm.py``'s, which draws from the same strategies
(``fuzz_calls.py``).

CI runs a bounded number of examples (a few seconds). A longer run, with a prober measuring
how long concurrent Routes stall while the hostile calls run::

    KVROUTER_FUZZ_EXAMPLES=8000 KVROUTER_FUZZ_REPORT=/tmp/fuzz.json [KVROUTER_FUZZ_DAEMON=process] \\
        .venv/bin/python -m pytest -q tests/integration/test_fuzz_grpc.py

writes the inputs tried, the statuses seen, the Route latencies and the daemon's event-loop lag
and gc-pause histograms (scraped from its /metrics) to the report file. The prober runs in its
own process (``fuzz_probe.py``). Where the daemon runs decides what its Route latencies mean:

* ``KVROUTER_FUZZ_DAEMON=thread`` (the default, and CI's): a thread of this process, so the
  checks above can read its state on its loop. The daemon then shares the fuzzer's GIL and its
  garbage collections (hypothesis keeps a large heap: a full collection stops the daemon too),
  and the state checks themselves run on the daemon's loop; the report counts the slow probe
  Routes that overlapped either, so these stalls are not mistaken for the daemon's own.
* ``KVROUTER_FUZZ_DAEMON=process``: ``kvrouterd serve`` in its own process, as in production:
  the latencies are the daemon's. Statuses are still checked; the state checks are not (they
  need the daemon's memory), so this mode measures and the thread mode checks.

(The variables are not ``KVROUTERD_*``: the daemon refuses unknown variables of its own prefix.)
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import json
import math
import os
import re
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.benchmarks.serve_process import ServeProcess
from kvrouterd.config import parse_config
from kvrouterd.router import request_bytes
from kvrouterd.server.app import Daemon

from ..invariants import check_router_invariants
from .fuzz_calls import (
    CALL_TIMEOUT_S, CODE_NAMES, DAEMON_CONFIG, NEVER, PROBE, WORKER_IDS, Prober, attack, describe, hostile_call, invoke,
    poisoning,
)

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "50"))
# a long run asked for by name takes as long as it takes (minutes); CI's bounded one keeps the
# suite's per-test timeout, so a hang still fails with its traceback
if "KVROUTER_FUZZ_EXAMPLES" in os.environ:
    pytestmark = pytest.mark.timeout(0)
REPORT = os.environ.get("KVROUTER_FUZZ_REPORT", "")
DAEMON_MODE = os.environ.get("KVROUTER_FUZZ_DAEMON", "thread")


# ---- the daemon's state, and calling it -------------------------------------------------------

def snapshot(router: Any) -> tuple:
    """What a rejected call must leave exactly as it was (the prober's worker and the decision
    counters it bumps left out, so the long run can route concurrently)."""
    workers = tuple(
        (w.id, w.spec, w.state, w.state_reason, w.slot, router.index.count(w.slot), w.inflight_requests,
         w.pending_prefill_tokens, w.reported_queue, w.reported_running, w.kv_utilization, w.last_sequence, w.gaps,
         w.batches_applied, tuple(sorted(w.events_rejected.items())), frozenset(b.key for b in router.index.blocks_of(w.slot)))
        for w in router.workers if w.id != PROBE
    )
    counters = tuple(sorted((k, v) for k, v in router.counters.items() if k != "decisions"))
    inflight = sorted(rid for rid in router._ledger.requests if router.workers.inflight(rid).worker_id != PROBE)
    own_bytes = sum(request_bytes(router.request(rid)) for rid in inflight)
    return workers, len(router.index), counters, tuple(inflight), own_bytes


class Tally:
    """What the fuzzer tried and saw, for the long run's report. Times are ``time.monotonic()``,
    which the prober's process shares."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_method: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.stream_errors: Counter[str] = Counter()
        self.slowest_call_s = 0.0
        self.slowest_call = ""
        #: (started, ended, label) of every hostile call, in order (one at a time)
        self.call_spans: list[tuple[float, float, str]] = []
        #: (started, ended) of the state checks run on the daemon's loop (thread mode)
        self.check_spans: list[tuple[float, float]] = []
        #: (started, ended) of this process's full (generation 2) garbage collections
        self.gc_spans: list[tuple[float, float]] = []
        self._gc_started = 0.0
        self.started = time.perf_counter()

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._gc_started = time.monotonic()
        else:
            self.gc_spans.append((self._gc_started, time.monotonic()))

    def report(self, probes: list[tuple[float, float]], daemon: dict[str, Any]) -> dict[str, Any]:
        lat = sorted(took for _, took in probes)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else math.nan

        stall_during: dict[str, float] = {}
        slow = [(t0, t0 + took) for t0, took in probes if took >= SLOW_PROBE_S]
        for t0, took in probes:
            for _, _, label in overlapping(self.call_spans, t0, t0 + took):
                stall_during[label] = max(stall_during.get(label, 0.0), took)
        return {"calls": self.calls, "wall_s": round(time.perf_counter() - self.started, 1),
                "daemon": ("its own process (kvrouterd serve)" if DAEMON_MODE == "process" else
                           "a thread of the fuzzer's process (its GIL and garbage collections are shared)"),
                "probe": "its own process (fuzz_probe.py)",
                "by_method": dict(self.by_method.most_common()), "statuses": dict(self.statuses.most_common()),
                "stream_error_codes": dict(self.stream_errors.most_common()),
                "slowest_call_ms": round(self.slowest_call_s * 1000, 1), "slowest_call": self.slowest_call,
                "probe_routes": len(lat), "probe_route_ms": {"p50": pct(0.5), "p99": pct(0.99), "p999": pct(0.999),
                                                             "max": pct(1.0)},
                f"probe_routes_over_{SLOW_PROBE_S * 1000:.0f}ms": {
                    "all": len(slow),
                    "overlapping a full gc of the fuzzer's process": sum(1 for a, b in slow if overlapping(self.gc_spans, a, b)),
                    "overlapping a state check on the daemon's loop": sum(
                        1 for a, b in slow if overlapping(self.check_spans, a, b)),
                    "overlapping neither": sum(1 for a, b in slow if not overlapping(self.gc_spans, a, b)
                                               and not overlapping(self.check_spans, a, b)),
                },
                "fuzzer_full_gcs": {"count": len(self.gc_spans),
                                    "max_ms": round(max((b - a for a, b in self.gc_spans), default=0.0) * 1000, 1)},
                "worst_probe_ms_during": {m: round(v * 1000, 1) for m, v in
                                          sorted(stall_during.items(), key=lambda kv: -kv[1])[:12]},
                "daemon_metrics": daemon}


#: a probe Route slower than this is a stall worth attributing
SLOW_PROBE_S = 0.05


def overlapping(spans: list[Any], t0: float, t1: float) -> list[Any]:
    """The ``(started, ended, ...)`` spans (sorted, disjoint) that overlap [t0, t1]."""
    i = max(0, bisect.bisect_left(spans, (t0,)) - 1)
    out = []
    while i < len(spans) and spans[i][0] <= t1:
        if spans[i][1] >= t0:
            out.append(spans[i])
        i += 1
    return out


def scrape_loop_metrics(port: int) -> dict[str, Any]:
    """The daemon's event-loop lag and gc-pause histograms (from its /metrics), as counts above
    a few thresholds: how many heartbeats ran that late, how many collections took that long."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    series: dict[tuple[str, str], dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r"^(kvrouter_event_loop_lag_seconds|kvrouter_gc_pause_seconds)_(bucket|count|sum)(?:\{(.*)\})? (\S+)$",
                     line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            key = labels.get("le", m.group(2))
            series.setdefault((m.group(1), labels.get("generation", "")), {})[key] = float(m.group(4))

    def summary(s: dict[str, float], thresholds: tuple[str, ...]) -> dict[str, float]:
        out = {"count": s.get("count", 0.0), "sum_s": round(s.get("sum", 0.0), 3)}
        out.update({f"over {t} s": s.get("count", 0.0) - s.get(t, 0.0) for t in thresholds})
        return out

    return {"event_loop_lag": summary(series.get(("kvrouter_event_loop_lag_seconds", ""), {}),
                                      ("0.01", "0.05", "0.1", "0.25", "0.5", "1.0")),
            "gc_pauses_by_generation": {gen: summary(s, ("0.01", "0.05", "0.1")) for (name, gen), s in sorted(series.items())
                                        if name == "kvrouter_gc_pause_seconds"}}


TALLY = Tally()


class ThreadedDaemon:
    """The daemon on its own thread and event loop: the test's loop (where hypothesis generates
    inputs) never runs on it. Reads of router state run on the daemon's loop, between its steps;
    it shares this process's GIL and garbage collections (see the module docstring)."""

    def __init__(self, config: dict) -> None:
        self.config = parse_config({"listen": "127.0.0.1:0", **config})
        self.port = 0
        self.metrics_port = 0
        self.daemon: Daemon | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fuzzed-daemon", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the daemon did not start")

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.daemon = Daemon(self.config, seed=1)
        self.port = await self.daemon.start()
        if self.daemon.metrics_endpoint is not None:
            self.metrics_port = self.daemon.metrics_endpoint.port
        self._ready.set()
        await self._stop.wait()
        await self.daemon.stop(grace=0.5)

    def stop(self) -> None:
        assert self.loop is not None and self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def on_loop(self, fn: Any) -> Any:
        """``fn(router)`` run on the daemon's loop (atomic with respect to its calls)."""
        assert self.loop is not None and self.daemon is not None
        router = self.daemon.router

        async def run() -> Any:
            return fn(router)

        started = time.monotonic()
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))
        finally:
            if REPORT:
                TALLY.check_spans.append((started, time.monotonic()))


class ProcessDaemon(ServeProcess):
    """``kvrouterd serve`` in its own process, as in production (``KVROUTER_FUZZ_DAEMON=process``).
    Its state lives in another process: ``on_loop`` is None and the state checks are skipped."""

    on_loop = None

    def __init__(self, config: dict, workdir: Path) -> None:
        config_file = workdir / "fuzzed-daemon.yaml"
        config_file.write_text(yaml.safe_dump({"listen": "127.0.0.1:0", **config}))
        super().__init__(config_file)


class Fuzzed:
    def __init__(self, daemon: ThreadedDaemon | ProcessDaemon, channel: grpc.aio.Channel) -> None:
        self.daemon = daemon
        self.channel = channel
        self.stub = router_pb2_grpc.KVRouterStub(channel)


@pytest.fixture
async def fuzzed(tmp_path: Path) -> Any:
    workdir = tmp_path
    config = {**DAEMON_CONFIG, "metrics": {"listen": "127.0.0.1:0"}} if REPORT else DAEMON_CONFIG
    daemon: ThreadedDaemon | ProcessDaemon = (
        ProcessDaemon(config, workdir) if DAEMON_MODE == "process" else ThreadedDaemon(config))
    daemon.start()
    prober = None
    try:
        if REPORT:
            gc.callbacks.append(TALLY.on_gc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            f = Fuzzed(daemon, channel)
            for i, wid in enumerate(WORKER_IDS[:2]):
                await f.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                    id=wid, address=f"10.0.0.{i}:8000", capacity_blocks=200, mode=pb.CACHE_STATE_MODE_EVENTS if i else 0)))
            if REPORT:
                await f.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                    id=PROBE, address="10.9.9.9:8000", mode=pb.CACHE_STATE_MODE_EVENTS)))
                prober = Prober(daemon.port, workdir / "probe.json")
            yield f
    finally:
        try:
            probes, probe_statuses = prober.stop() if prober is not None else ([], {})
            metrics = scrape_loop_metrics(daemon.metrics_port) if REPORT else {}
        finally:
            daemon.stop()
        if REPORT:
            gc.callbacks.remove(TALLY.on_gc)
            if isinstance(daemon, ProcessDaemon):
                stalls = [w for w in daemon.warnings if "event loop blocked" in w]
                metrics["stall_warnings"] = {"count": len(stalls), "first": stalls[:10]}
            with open(REPORT, "w") as out:
                json.dump({**TALLY.report(probes, metrics), "probe_route_statuses": probe_statuses}, out, indent=2)
        # the innocent client's Routes, over every latency policy, never failed for the fuzzer's calls
        assert not {c for c in probe_statuses if c in {n.name for n in NEVER}}, probe_statuses


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not REPORT, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(calls=st.lists(st.one_of(hostile_call.map(lambda call: [call]), poisoning), min_size=1, max_size=5).map(
    lambda groups: [call for group in groups for call in group]))
# the attack exactly as the issue reports it, unary and batched, in every run
@example(calls=attack(1, 8, "min_ttft", "ttft_ms", 1e308, batched=False))
@example(calls=attack(2, 8, "preble", "ttft_ms", 1e308, batched=True))
async def test_hostile_calls_get_precise_statuses_keep_invariants_and_rejections_change_nothing(fuzzed, calls):
    on_loop = fuzzed.daemon.on_loop
    for method, message in calls:
        before = await on_loop(snapshot) if on_loop is not None else None
        what = describe(method, message)
        started = time.monotonic()
        code, stream_codes = await invoke(fuzzed.channel, method, message)
        ended = time.monotonic()
        took = ended - started
        TALLY.calls += 1
        if REPORT:
            TALLY.call_spans.append((started, ended, what))
        TALLY.by_method[method] += 1
        TALLY.statuses[code.name] += 1
        TALLY.stream_errors.update(CODE_NAMES.get(c, str(c)) for c in stream_codes if c)
        if took > TALLY.slowest_call_s:
            TALLY.slowest_call_s, TALLY.slowest_call = took, method
        assert code not in NEVER, (method, code, str(message)[:300])
        assert not {c for c in stream_codes if c in (2, 13)}, (method, stream_codes)  # UNKNOWN, INTERNAL
        if on_loop is not None:
            await on_loop(check_router_invariants)
            if code is not grpc.StatusCode.OK or (stream_codes and 0 not in stream_codes):
                assert await on_loop(snapshot) == before, (method, code, str(message)[:300])
    # the fleet views answer for everyone, whatever was registered
    await fuzzed.stub.ListWorkers(pb.ListWorkersRequest(), timeout=CALL_TIMEOUT_S)
    await fuzzed.stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
