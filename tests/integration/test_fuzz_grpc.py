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

    KVROUTER_FUZZ_EXAMPLES=3000 KVROUTER_FUZZ_REPORT=/tmp/fuzz.json \\
        .venv/bin/python -m pytest -q tests/integration/test_fuzz_grpc.py

writes the inputs tried, the statuses seen and the Route latencies to the report file.
(The variables are not ``KVROUTERD_*``: the daemon refuses unknown variables of its own prefix.)
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections import Counter
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.router import request_bytes
from kvrouterd.server.app import Daemon

from ..invariants import check_router_invariants

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "50"))
REPORT = os.environ.get("KVROUTER_FUZZ_REPORT", "")
BS = 16
CALL_TIMEOUT_S = 10.0
#: the prober's worker (long runs only); the fuzzer's ids never name it
PROBE = "probe-worker"
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}

# ---- strategies -------------------------------------------------------------------------------

WORKER_IDS = ["w0", "w1", "w2", "w3"]
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)
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
    form = draw(st.sampled_from(["tokens", "keys", "both", "none"]))
    if form in ("tokens", "both"):
        msg.token_ids.extend(draw(tokens))
    if form in ("keys", "both"):
        msg.block_keys.extend(draw(st.lists(U64, max_size=20)))
        msg.prompt_tokens = draw(st.one_of(st.just(0), U32))
    return msg


complete = st.builds(pb.CompleteRequest, request_id=request_id, ttft_ms=ANY_FLOAT, e2e_ms=ANY_FLOAT, cached_tokens=I64,
                     output_tokens=U32, success=st.booleans(), session_ended=st.booleans())


@st.composite
def cache_event(draw: Any) -> pb.CacheEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "empty"]))
    if kind == "stored":
        n = draw(st.integers(0, 6))
        page = draw(st.sampled_from([0, 1, 16, 32, 7, 2**32 - 1]))
        toks = draw(st.one_of(st.just(list(range(n * BS))), st.lists(U32, max_size=100)))
        ev = pb.StoredBlocks(engine_hashes=draw(st.lists(U64, min_size=0, max_size=n + 1)), token_ids=toks, block_size=page,
                             model=draw(st.one_of(st.just(""), odd_text)), lora=draw(st.one_of(st.just(""), odd_text)))
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
stream_message = st.one_of(
    st.builds(lambda r, t: pb.RouteStreamRequest(id=1, route=r, timeout_ms=t), route(), ANY_FLOAT),
    st.builds(lambda c: pb.RouteStreamRequest(id=2, complete=c), complete),
    st.just(pb.RouteStreamRequest(id=3)),
)
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
    inflight = sorted(rid for rid in router._requests if router.workers.inflight(rid).worker_id != PROBE)
    own_bytes = sum(request_bytes(router._requests[rid]) for rid in inflight)
    return workers, len(router.index), counters, tuple(inflight), own_bytes


async def invoke(running: Fuzzed, method: str, message: Any) -> tuple[grpc.StatusCode, list[int]]:
    """Call one RPC; its status and, for RouteStream, the codes of its in-stream errors."""
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
            codes = [r.error.code async for r in stub.RouteStream(iter([message]), timeout=CALL_TIMEOUT_S)
                     if r.WhichOneof("kind") == "error"]
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
    """What the fuzzer tried and saw, for the long run's report."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_method: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.stream_errors: Counter[str] = Counter()
        self.slowest_call_s = 0.0
        self.slowest_call = ""
        self.probe_latencies: list[float] = []
        #: the hostile calls running while a probe Route was in flight -> its worst latency
        self.stall_during: dict[str, float] = {}
        self.running: set[str] = set()
        self.started = time.perf_counter()

    def report(self) -> dict[str, Any]:
        lat = sorted(self.probe_latencies)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else math.nan

        return {"calls": self.calls, "wall_s": round(time.perf_counter() - self.started, 1),
                "by_method": dict(self.by_method.most_common()), "statuses": dict(self.statuses.most_common()),
                "stream_error_codes": dict(self.stream_errors.most_common()),
                "slowest_call_ms": round(self.slowest_call_s * 1000, 1), "slowest_call": self.slowest_call,
                "probe_routes": len(lat), "probe_route_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
                "worst_probe_ms_during": {m: round(v * 1000, 1) for m, v in
                                          sorted(self.stall_during.items(), key=lambda kv: -kv[1])[:12]}}


TALLY = Tally()


class ThreadedDaemon:
    """The daemon on its own thread and event loop, as in production: the test's loop (where
    hypothesis generates inputs) and the prober's never run on it, so a Route's latency is the
    daemon's. Reads of router state run on the daemon's loop, between its steps."""

    def __init__(self, config: dict) -> None:
        self.config = parse_config({"listen": "127.0.0.1:0", **config})
        self.port = 0
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

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))


class Prober:
    """Route + Complete against the prober's worker in a loop, from its own thread and channel,
    timing each Route: how long routing stalls while the hostile calls run."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _main(self) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = router_pb2_grpc.KVRouterStub(channel)
            prompt = list(range(100_000, 100_000 + 8 * BS))
            n = 0
            while not self._stop.is_set():
                n += 1
                started = time.perf_counter()
                overlapping = set(TALLY.running)
                await stub.Route(pb.RouteRequest(token_ids=prompt, request_id=f"probe-{n}", candidate_workers=[PROBE]))
                took = time.perf_counter() - started
                TALLY.probe_latencies.append(took)
                for what in overlapping | set(TALLY.running):
                    TALLY.stall_during[what] = max(TALLY.stall_during.get(what, 0.0), took)
                await stub.Complete(pb.CompleteRequest(request_id=f"probe-{n}"))
                await asyncio.sleep(0.002)


class Fuzzed:
    def __init__(self, daemon: ThreadedDaemon, channel: grpc.aio.Channel) -> None:
        self.daemon = daemon
        self.channel = channel
        self.stub = router_pb2_grpc.KVRouterStub(channel)


#: small limits, so budgets are reached within a run; every policy a request may name
DAEMON_CONFIG = {
    "limits": {"max_inflight_bytes": 1 << 20, "approximate_capacity_blocks": 64, "max_evict_blocks": 64},
    "extra_routing": [{"name": p} for p in ("dualmap", "lbgr", "min_ttft", "kv_cost", "preble", "round_robin", "compose")],
    "events": {"allowed_endpoints": ["@worker", "127.0.0.0/8"]},
}


@pytest.fixture
async def fuzzed() -> Any:
    daemon = ThreadedDaemon(DAEMON_CONFIG)
    daemon.start()
    prober = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            f = Fuzzed(daemon, channel)
            for i, wid in enumerate(WORKER_IDS[:2]):
                await f.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                    id=wid, address=f"10.0.0.{i}:8000", capacity_blocks=200, mode=pb.CACHE_STATE_MODE_EVENTS if i else 0)))
            if REPORT:
                await f.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                    id=PROBE, address="10.9.9.9:8000", mode=pb.CACHE_STATE_MODE_EVENTS)))
                prober = Prober(daemon.port)
                prober.start()
            yield f
    finally:
        if prober is not None:
            prober.stop()
        daemon.stop()
        if REPORT:
            with open(REPORT, "w") as out:
                json.dump(TALLY.report(), out, indent=2)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not REPORT, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(calls=st.lists(hostile_call, min_size=1, max_size=5))
async def test_hostile_calls_get_precise_statuses_keep_invariants_and_rejections_change_nothing(fuzzed, calls):
    on_loop = fuzzed.daemon.on_loop
    for method, message in calls:
        before = await on_loop(snapshot)
        started = time.perf_counter()
        what = describe(method, message)
        TALLY.running.add(what)
        try:
            code, stream_codes = await invoke(fuzzed, method, message)
        finally:
            TALLY.running.discard(what)
        took = time.perf_counter() - started
        TALLY.calls += 1
        TALLY.by_method[method] += 1
        TALLY.statuses[code.name] += 1
        TALLY.stream_errors.update(grpc.StatusCode.INVALID_ARGUMENT.name if c == 3 else str(c) for c in stream_codes)
        if took > TALLY.slowest_call_s:
            TALLY.slowest_call_s, TALLY.slowest_call = took, method
        assert code not in NEVER, (method, code, str(message)[:300])
        assert not {c for c in stream_codes if c in (2, 13)}, (method, stream_codes)  # UNKNOWN, INTERNAL
        await on_loop(check_router_invariants)
        if code is not grpc.StatusCode.OK or stream_codes:
            assert await on_loop(snapshot) == before, (method, code, str(message)[:300])
    # the fleet views answer for everyone, whatever was registered
    await fuzzed.stub.ListWorkers(pb.ListWorkersRequest(), timeout=CALL_TIMEOUT_S)
    await fuzzed.stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
