"""The fuzz tests' hostile calls: hypothesis strategies for every RPC, and how to make them.

Shared by the sequential fuzz test (``test_fuzz_grpc.py``) and the concurrent swarm
(``fuzz_swarm.py``): the strategies, the daemon's configuration they attack, ``invoke`` (one
call, its status and RouteStream item codes) and ``Prober`` (``fuzz_probe.py``'s process).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
from hypothesis import strategies as st

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.index.keys import tokens_to_bytes

from ..wire import length_delimited, varint

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


# ---- calling the daemon, and probing it ------------------------------------------------------

#: small limits, so budgets are reached within a run; every policy a request may name. Routed
#: requests never expire: a run longer than the default inflight_timeout_s (300 s) would have the
#: daemon's sweep drop them between a call's before and after snapshots, no change of that call's
DAEMON_CONFIG: dict[str, Any] = {
    "limits": {"max_inflight_bytes": 1 << 20, "approximate_capacity_blocks": 64, "max_evict_blocks": 64,
               "inflight_timeout_s": 86400.0},
    "extra_routing": [{"name": p} for p in ("dualmap", "lbgr", "min_ttft", "kv_cost", "preble", "round_robin", "compose")],
    "events": {"allowed_endpoints": ["@worker", "127.0.0.0/8"]},
}



async def invoke(channel: grpc.aio.Channel, method: str, message: Any) -> tuple[grpc.StatusCode, list[int]]:
    """Call one RPC on ``channel``; its status and, for RouteStream, the code of each answer on
    the stream (0 = answered without error; a batch's items one by one)."""
    stub = router_pb2_grpc.KVRouterStub(channel)
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
