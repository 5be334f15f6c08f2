"""Hostile calls from hypothesis against the real grpc.aio daemon on loopback (issue #16).

Every RPC is called with hostile inputs: huge and odd ids, bad endpoints and addresses, NaN and
infinite floats, extreme integers, unknown enum values, sequences of events in and out of
order, streams mixing messages, and raw bytes that are no protobuf at all. After each call:

* the status is never UNKNOWN, INTERNAL or DEADLINE_EXCEEDED (a crash, or a hang past 10 s),
  and a RouteStream message's error code is never UNKNOWN/INTERNAL either;
* the index and load invariants hold (``tests/invariants.py``);
* a rejected call changed nothing (the router's workers, index, load and counters compared
  before and after), and ListWorkers and GetStats still answer.

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
import signal
import subprocess
import sys
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
from kvrouterd.index.keys import tokens_to_bytes
from kvrouterd.router import request_bytes
from kvrouterd.server.app import Daemon

from ..invariants import check_router_invariants
from ..wire import length_delimited, varint

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "50"))
# a long run asked for by name takes as long as it takes (minutes); CI's bounded one keeps the
# suite's per-test timeout, so a hang still fails with its traceback
if "KVROUTER_FUZZ_EXAMPLES" in os.environ:
    pytestmark = pytest.mark.timeout(0)
REPORT = os.environ.get("KVROUTER_FUZZ_REPORT", "")
DAEMON_MODE = os.environ.get("KVROUTER_FUZZ_DAEMON", "thread")
BS = 16
CALL_TIMEOUT_S = 10.0
#: the prober's worker (long runs only); the fuzzer's ids never name it
PROBE = "probe-worker"
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
#: a RouteStream error's numeric code -> its name, for the report
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}

# ---- strategies -------------------------------------------------------------------------------

WORKER_IDS = ["w0", "w1", "w2", "w3"]
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
#: every float, the ones that broke the daemon drawn often (issue #28 item 1: ttft_ms=1e308)
EXTREME_FLOATS = [1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324, -0.0, 4294967295.0, 86_400_000.0, 86_400_001.0]
ANY_FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64), st.sampled_from(EXTREME_FLOATS))
#: the policies with an online fit a client's Complete feeds
LATENCY_POLICIES = ["min_ttft", "preble", "dualmap", "lbgr"]
huge = st.sampled_from([257, 1025, 5_000, 100_000, 1_000_000]).map(lambda n: "x" * n)
odd_text = st.text(st.characters(codec="utf-8"), max_size=40)
ident = st.one_of(st.sampled_from(WORKER_IDS), st.just(""), odd_text, huge)
request_id = st.one_of(st.sampled_from(["r0", "r1", "r2"]), st.just(""), odd_text, huge)
address = st.one_of(
    st.sampled_from(["10.0.0.5:8000", "[fd00::1]:80", "h:1", "h:0", "h:65536", "h", ":80", "a b:1", "[::1:80",
                     "127.0.0.1:8000", "engine-0.ns.svc:8000"]),
    odd_text, huge,
)
endpoint = st.one_of(
    st.sampled_from([
        "", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:5558", "tcp://127.0.0.1:5557",
        "tcp://169.254.169.254:80", "ipc:///etc/passwd", "inproc://x", "tcp://127.0.0.1?dp_rank=1",
        "tcp://127.0.0.1:65535?dp_rank=9", "tcp://*:5557", "http://x:1", "tcp://eth0;127.0.0.1:5557",
        "tcp://10.0.0.5:5557?dp_rank=-1", "tcp://10.0.0.5:5557?bogus=1", "tcp://10.0.0.5:5557?model=" + "m" * 300,
    ]),
    odd_text, huge.map(lambda s: "tcp://" + s + ":1"),
)
tokens = st.one_of(st.lists(U32, max_size=80), st.just(list(range(4 * BS))), st.just(list(range(8 * BS))))
# token_ids_le32 as the SDK packs it, or any bytes (a length that is not a multiple of 4 included)
packed = st.one_of(tokens.map(tokens_to_bytes), st.binary(max_size=70))


@st.composite
def worker(draw: Any) -> pb.Worker:
    labels = draw(st.one_of(st.dictionaries(odd_text, odd_text, max_size=3),
                            st.just({"k": "v" * 20_000}), st.just({f"k{i}": "v" for i in range(2000)})))
    return pb.Worker(id=draw(ident), address=draw(address), capacity_blocks=draw(st.sampled_from([0, 1, 50, 2**64 - 1])),
                     block_size=draw(st.sampled_from([0, 1, 16, 32, 4096, 65537, 2**32 - 1])), labels=labels,
                     mode=draw(st.sampled_from([0, 1, 2, 3, 99])), kv_events_endpoint=draw(endpoint))


@st.composite
def route(draw: Any) -> pb.RouteRequest:
    msg = pb.RouteRequest(request_id=draw(request_id), model=draw(st.one_of(st.just(""), odd_text, huge)),
                          lora=draw(st.one_of(st.just(""), odd_text)), session_id=draw(st.one_of(st.just(""), ident)),
                          task=draw(st.sampled_from([0, 1, 2, 5, 99, -1])), ttft_slo_ms=draw(ANY_FLOAT),
                          expected_output_tokens=draw(U32), policy=draw(st.sampled_from(
                              ["", "cache_aware", "dualmap", "lbgr", "min_ttft", "kv_cost", "preble", "round_robin",
                               "compose", "nope", "x" * 300])),
                          candidate_workers=draw(st.lists(ident, max_size=3)), cache_salt=draw(st.one_of(st.just(""), odd_text)))
    form = draw(st.sampled_from(["tokens", "keys", "packed", "both", "packed+tokens", "packed+keys", "none"]))
    if form in ("tokens", "both", "packed+tokens"):
        msg.token_ids.extend(draw(tokens))
    if form.startswith("packed"):
        msg.token_ids_le32 = draw(packed)
    if form in ("keys", "both", "packed+keys"):
        msg.block_keys.extend(draw(st.lists(U64, max_size=20)))
        msg.prompt_tokens = draw(st.one_of(st.just(0), U32))
    return msg


complete = st.builds(pb.CompleteRequest, request_id=request_id, ttft_ms=ANY_FLOAT, e2e_ms=ANY_FLOAT, cached_tokens=I64,
                     output_tokens=U32, success=st.booleans(), session_ended=st.booleans())


def attack(tag: int, n: int, policy: str, field: str, value: float, batched: bool) -> list[tuple[str, Any]]:
    """Issue #28 item 1's attack: ``n`` Routes to ``policy``, a Complete of each reporting
    ``field=value`` (the other numbers sane), then a Route to every latency policy; as unary
    calls, or all in one RouteStream batch (where a failing item used to end the stream)."""
    prompt = list(range(tag % 1000, tag % 1000 + 4 * BS))
    routes = [pb.RouteRequest(request_id=f"poison-{tag}-{i}", token_ids=prompt, policy=policy) for i in range(n)]
    completes = [pb.CompleteRequest(request_id=r.request_id, **{"ttft_ms": 50.0, "e2e_ms": 900.0, field: value},
                                    success=True) for r in routes]
    victims = [pb.RouteRequest(token_ids=prompt, policy=p) for p in LATENCY_POLICIES]
    if not batched:
        return [*(("Route", r) for r in routes), *(("Complete", c) for c in completes), *(("Route", v) for v in victims)]
    items = [*(pb.RouteStreamRequest(id=i, route=r) for i, r in enumerate(routes)),
             *(pb.RouteStreamRequest(id=100 + i, complete=c) for i, c in enumerate(completes)),
             *(pb.RouteStreamRequest(id=200 + i, route=v) for i, v in enumerate(victims))]
    return [("RouteStream", pb.RouteStreamRequest(id=9, batch=pb.RouteStreamRequestBatch(items=items)))]


#: one hostile value in one field of every Complete of an attack
hostile_report = st.one_of(
    st.tuples(st.sampled_from(["ttft_ms", "e2e_ms"]), ANY_FLOAT),
    st.tuples(st.just("output_tokens"), st.sampled_from([4294967295, 2**24 + 1])),
    st.tuples(st.just("cached_tokens"), st.sampled_from([-2, 2**63 - 1, -(2**63)])))
# fresh ids (a refused Complete leaves its Route in flight), enough Completes to calibrate a fit
poisoning = st.builds(lambda tag, n, policy, report, batched: attack(tag, n, policy, *report, batched),
                      st.integers(0, 2**48), st.integers(8, 10), st.sampled_from(LATENCY_POLICIES), hostile_report,
                      st.booleans())


@st.composite
def cache_event(draw: Any) -> pb.CacheEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "empty"]))
    if kind == "stored":
        n = draw(st.integers(0, 6))
        page = draw(st.sampled_from([0, 1, 16, 32, 7, 2**32 - 1]))
        toks = draw(st.one_of(st.just(list(range(n * BS))), st.lists(U32, max_size=100)))
        ev = pb.StoredBlocks(engine_hashes=draw(st.lists(U64, min_size=0, max_size=n + 1)), block_size=page,
                             model=draw(st.one_of(st.just(""), odd_text)), lora=draw(st.one_of(st.just(""), odd_text)))
        form = draw(st.sampled_from(["tokens", "packed", "both"]))
        if form != "packed":
            ev.token_ids.extend(toks)
        if form != "tokens":
            ev.token_ids_le32 = draw(st.one_of(st.just(tokens_to_bytes(toks)), packed))
        if draw(st.booleans()):
            ev.parent_engine_hash = draw(U64)
        return pb.CacheEvent(stored=ev)
    if kind == "removed":
        return pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=draw(st.lists(U64, max_size=5))))
    if kind == "cleared":
        return pb.CacheEvent(cleared=pb.AllBlocksCleared())
    return pb.CacheEvent()


event_batch = st.builds(pb.EventBatch, worker_id=ident, sequence=st.one_of(st.integers(0, 5), U64),
                        events=st.lists(cache_event(), max_size=4), timestamp=ANY_FLOAT)

evict = st.builds(pb.EvictHintRequest, worker_id=ident, blocks=U32, tokens=U32, pinned_engine_hashes=st.lists(U64, max_size=3),
                  pinned_keys=st.lists(U64, max_size=3), policy=st.sampled_from(["", "lru", "unicache", "tlru", "nope"]))
report = st.builds(pb.ReportLoadRequest, worker_id=ident, queued_requests=U32, running_requests=U32, kv_utilization=ANY_FLOAT)
single_stream_message = st.one_of(
    st.builds(lambda r, t: pb.RouteStreamRequest(id=1, route=r, timeout_ms=t), route(), ANY_FLOAT),
    st.builds(lambda c: pb.RouteStreamRequest(id=2, complete=c), complete),
    st.just(pb.RouteStreamRequest(id=3)),
)
# a batch of any of those (or none), possibly inside another batch
stream_message = st.recursive(
    single_stream_message,
    lambda inner: st.builds(lambda items: pb.RouteStreamRequest(id=4, batch=pb.RouteStreamRequestBatch(items=items)),
                            st.lists(inner, max_size=4)),
    max_leaves=6,
)


def _unpacked_ids(n: int) -> bytes:
    """``n`` token ids as RouteRequest.token_ids, unpacked: a field (tag 0x10) each."""
    return b"".join(b"\x10" + varint(t) for t in range(n))


#: messages of limits.off_loop_prompt_bytes (256 KiB) or more in encodings the split does not read,
#: each refused with INVALID_ARGUMENT (a RouteStream one answered on the stream): unpacked ids,
#: a complete of 100k fields, a group before a huge prompt
ODD_HUGE = [
    ("raw:Route", _unpacked_ids(100_000)),
    ("raw:RouteStream", b"\x08\x07" + length_delimited(2, _unpacked_ids(100_000))),
    ("raw:RouteStream", b"\x08\x08" + length_delimited(3, b"\x0a\x00" * 150_000)),
    ("raw:Route", b"\xfb\x01\xfc\x01" + length_delimited(14, bytes(300_000))),
]
RAW_METHODS = ["Route", "Complete", "RouteStream", "EvictHint", "RegisterWorker", "DeregisterWorker", "ListWorkers",
               "ReportLoad", "PublishEvents", "GetStats", "ExportIndex"]

hostile_call = st.one_of(
    st.tuples(st.just("Route"), route()),
    st.tuples(st.just("Complete"), complete),
    st.tuples(st.just("RouteStream"), stream_message),
    st.tuples(st.just("RegisterWorker"), worker().map(lambda w: pb.RegisterWorkerRequest(worker=w))),
    st.tuples(st.just("DeregisterWorker"), ident.map(lambda i: pb.DeregisterWorkerRequest(worker_id=i))),
    st.tuples(st.just("PublishEvents"), event_batch),
    st.tuples(st.just("EvictHint"), evict),
    st.tuples(st.just("ReportLoad"), report),
    st.tuples(st.just("ExportIndex"), st.builds(pb.ExportIndexRequest, worker_ids=st.lists(ident, max_size=3),
                                                max_blocks_per_chunk=st.sampled_from([0, 1, 2**32 - 1]))),
    st.tuples(st.just("ListWorkers"), st.just(pb.ListWorkersRequest())),
    st.tuples(st.sampled_from(RAW_METHODS).map(lambda m: "raw:" + m), st.binary(max_size=64)),
    st.sampled_from(ODD_HUGE),
)


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


async def invoke(running: Fuzzed, method: str, message: Any) -> tuple[grpc.StatusCode, list[int]]:
    """Call one RPC; its status and, for RouteStream, the code of each answer on the stream
    (0 = answered without error; a batch's items one by one)."""
    stub, channel = running.stub, running.channel
    try:
        if method.startswith("raw:"):
            name = method[4:]
            path = f"/kvrouter.v1.KVRouter/{name}"
            if name == "RouteStream":
                async for _ in channel.stream_stream(path)(iter([message]), timeout=CALL_TIMEOUT_S):
                    pass
            elif name == "PublishEvents":
                await channel.stream_unary(path)(iter([message]), timeout=CALL_TIMEOUT_S)
            elif name == "ExportIndex":
                async for _ in channel.unary_stream(path)(message, timeout=CALL_TIMEOUT_S):
                    pass
            else:
                await channel.unary_unary(path)(message, timeout=CALL_TIMEOUT_S)
        elif method == "RouteStream":
            codes = [item.error.code async for r in stub.RouteStream(iter([message]), timeout=CALL_TIMEOUT_S)
                     for item in (r.batch.items if r.WhichOneof("kind") == "batch" else [r])]
            return grpc.StatusCode.OK, codes
        elif method == "PublishEvents":
            await stub.PublishEvents(iter([message]), timeout=CALL_TIMEOUT_S)
        elif method == "ExportIndex":
            async for _ in stub.ExportIndex(message, timeout=CALL_TIMEOUT_S):
                pass
        else:
            await getattr(stub, method)(message, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), []
    return grpc.StatusCode.OK, []


def describe(method: str, message: Any) -> str:
    """A short label of a call for the report: the method and the size of its message."""
    size = len(message) if isinstance(message, bytes) else message.ByteSize()
    return f"{method} ({size // 1000} kB)" if size >= 1000 else f"{method} (<1 kB)"


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


class Prober:
    """``fuzz_probe.py`` in a process of its own: Route + Complete against the prober's worker
    in a loop, timing each Route (how long routing stalls while the hostile calls run)."""

    def __init__(self, port: int, out: Path) -> None:
        self.out = out
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.fuzz_probe", "--port", str(port), "--worker", PROBE,
             "--out", str(out), "--policies", ",".join(["", *LATENCY_POLICIES])], cwd=root, stdout=subprocess.PIPE,
            text=True)
        assert self.proc.stdout is not None
        # a SIGTERM before its handler is installed would kill it without a report
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the prober did not start")

    def stop(self) -> tuple[list[tuple[float, float]], dict[str, int]]:
        """The probe Routes' (started, seconds), and how many ended with each status."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        found = json.loads(self.out.read_text())
        return [tuple(t) for t in found["timings"]], found["statuses"]  # type: ignore[misc]


class Fuzzed:
    def __init__(self, daemon: ThreadedDaemon | ProcessDaemon, channel: grpc.aio.Channel) -> None:
        self.daemon = daemon
        self.channel = channel
        self.stub = router_pb2_grpc.KVRouterStub(channel)


#: small limits, so budgets are reached within a run; every policy a request may name. Routed
#: requests never expire: a run longer than the default inflight_timeout_s (300 s) would have the
#: daemon's sweep drop them between a call's before and after snapshots, no change of that call's
DAEMON_CONFIG = {
    "limits": {"max_inflight_bytes": 1 << 20, "approximate_capacity_blocks": 64, "max_evict_blocks": 64,
               "inflight_timeout_s": 86400.0},
    "extra_routing": [{"name": p} for p in ("dualmap", "lbgr", "min_ttft", "kv_cost", "preble", "round_robin", "compose")],
    "events": {"allowed_endpoints": ["@worker", "127.0.0.0/8"]},
}


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
        code, stream_codes = await invoke(fuzzed, method, message)
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
