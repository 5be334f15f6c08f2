"""gRPC benchmarks: Route (unary and streamed) throughput/latency vs a trivial handler, and
PublishEvents ingest.

The server runs in a child process (``python -m kvrouterd.benchmarks.grpc_bench serve ...``)
and the load generator in this one, so the two do not share a GIL. Both servers use the same
generated servicer base and message types; the trivial one answers every Route, unary or
streamed, with a fixed response, so a throughput ratio isolates what kvrouterd adds per call
(hash, match, policy, bookkeeping, telemetry). Like is compared with like: the same prompt
(4,000 tokens packed in ``token_ids_le32``, as the SDK sends them) to both servers, the same
pre-serialised client loads, streamed daemon against streamed trivial as well as against the
trivial unary handler (the issue's headline ratio, which also counts what streaming saves).
Streamed loads run twice: coalesced, as the SDK's RouterClient sends to a router that takes
batches (the calls ready together in one stream message), and one message per call.

Every routed request is completed, as the SDK's RouterClient does: unary loads send a
``Complete`` call after each ``Route``, streamed loads a complete message on the same stream.
Without them requests pile up in flight, the spread of load across workers marks the fleet
imbalanced and the policy takes its cheap least-loaded path for nearly every decision instead
of the prefix match real traffic gets. So a rate is routed requests per second *with their
Completes sent*, and server CPU per call is a Route plus its Complete; the trivial server
answers Complete too, so its ratios still compare like with like. Each daemon load also
counts the policy's reasons from the answers (``reasons``).

Deadline admission runs, as it does by default, but its TTFT model is told how fast this
fleet is (``BENCH_PREFILL_MS_PER_1K``). The bench's engines complete every request the moment
it is routed and report neither load nor TTFTs. With the default model (a GPU prefilling
1,000 tokens in 40 ms) the guard saw the worker with the longest match take 3,000-7,000
Routes/s, 8-18x what the model says it can prefill, and predicted its backlog past the 5 s
SLO within a second; from then on the Routes sent there priced all 64 workers and were
re-decided elsewhere (a third to a half of a streamed load's: 2-3x its CPU per call). No real
fleet shows that: in a closed loop of 64 requests the Completes come no faster than the
engines prefill, so a backlog stays under 64 prefills (~0.2 s), and engines faster than their
model correct it through TTFTs and load reports. At 1 ms per 1,000 tokens that worker is
loaded but within capacity: most streamed Routes find a backlog there and price it, as Routes
to a busy, healthy fleet do, and none is re-decided.

On a 2-core machine the client shares the CPU with the server (and with anything else
running): a rate is bounded by whichever process runs out of CPU first, so rates and their
ratios swing with load. Each load therefore also reports the server's CPU per call (from
/proc), which load disturbs much less; the CPU ratios compare the servers alone.

The gateway's side: ``sdk_64`` is the SDK's own ``RouterClient`` (its default four RouteStream
calls, batching as it does) driven by 64 gateway tasks, each a closed loop of ``route()`` with
the prompt as a list of ints (what tokenizers return) then ``complete()``; it reports the CPU
this process spent per Route + Complete (``client_cpu_us_per_call``: every thread, gRPC's
included). ``sdk_64_packed`` is the same with the prompt already an ``array('I')``, so the
packing a list needs is left out; ``sdk_64_keys`` the list prompt with ``send_block_keys=True``:
the gateway hashes it into block keys, which the daemon then neither splits nor hashes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from .. import grpc_runtime
from .._generated.kvrouter.v1 import router_pb2 as pb
from .._generated.kvrouter.v1 import router_pb2_grpc
from ..index.workers import routing_mask
from ..server.service import STREAM_BATCH_METADATA
from .harness import complete_message
from .stats import p99
from .workload import BLOCK_SIZE

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
#: the daemon's TTFT model for deadline admission (``admission.latency``): engines 40x faster
#: than the default GPU's 40 ms per 1,000 tokens, because these "engines" answer at once (see
#: the module docstring)
BENCH_PREFILL_MS_PER_1K = 1.0
#: what a gateway that measured its request reports in Complete: its TTFT and end-to-end time,
#: and the prompt tokens its engine found cached (usage.prompt_tokens_details.cached_tokens)
REPORTED_COMPLETE = pb.CompleteRequest(ttft_ms=120.0, e2e_ms=900.0, cached_tokens=3200)


class TrivialService(router_pb2_grpc.KVRouterServicer):
    """Answers Route with a constant: the floor any gRPC Route server pays."""

    # a request id as long as the daemon's, so the loads' Complete messages are the same size
    _reply = pb.RouteResponse(request_id="kvr-1-0123abcd", worker_id="w0", worker_address="10.0.0.1:8000", policy="trivial")
    _completed = pb.CompleteResponse()

    async def Route(self, request, context):  # type: ignore[no-untyped-def]
        return self._reply

    async def Complete(self, request, context):  # type: ignore[no-untyped-def]
        return self._completed

    async def RouteStream(self, request_iterator, context):  # type: ignore[no-untyped-def]
        # read, write and advertise batches as the daemon's RouteStream does, so only the work
        # per message differs
        await context.send_initial_metadata(((STREAM_BATCH_METADATA, str(64 << 20)),))
        write = context.write
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "batch":
                reply = pb.RouteStreamResponse()
                answers = reply.batch.items
                for item in msg.batch.items:
                    self._answer(item, answers.add(id=item.id))
                await write(reply)
            else:
                await write(self._answer(msg, pb.RouteStreamResponse(id=msg.id)))

    def _answer(self, msg: pb.RouteStreamRequest, reply: pb.RouteStreamResponse) -> pb.RouteStreamResponse:
        if msg.WhichOneof("kind") == "complete":
            reply.complete.CopyFrom(self._completed)
        else:
            reply.route.CopyFrom(self._reply)
        return reply


class FloorService(router_pb2_grpc.KVRouterServicer):
    """The floor of any router written in Python on this gRPC server: per streamed Route only
    what no router can skip (read the prompt, hash it into block keys and walk the index, both
    native; pick the longest match, else the least loaded, with the native candidate scan;
    answer; count the request in flight), per Complete a dict pop. The daemon's own index,
    populated as for ``daemon``, and the same load: the gap between the two is what validation,
    deadline admission, the in-flight ledger, the eviction model and metrics cost."""

    def __init__(self, router: Any) -> None:
        from ..index import native
        from ..policies._scan import scan_candidates

        self._scan = scan_candidates
        self._router = router
        self._workers = sorted(router.workers, key=lambda w: w.slot)
        self._mask = routing_mask(self._workers)
        self._slots = native.module.CandidateSlots(self._workers) if native.module is not None else None
        self._inflight: dict[str, Any] = {}
        self._routed = 0

    async def RouteStream(self, request_iterator, context):  # type: ignore[no-untyped-def]
        await context.send_initial_metadata(((STREAM_BATCH_METADATA, str(64 << 20)),))
        write = context.write
        async for msg in request_iterator:  # the bench's loads send batches only
            reply = pb.RouteStreamResponse()
            answers = reply.batch.items
            for item in msg.batch.items:
                answer = answers.add(id=item.id)
                if item.WhichOneof("kind") == "route":
                    self._route(item.route, answer.route)
                else:
                    worker = self._inflight.pop(item.complete.request_id, None)
                    if worker is not None:
                        worker.inflight_requests -= 1
                    answer.complete.SetInParent()
            await write(reply)

    def _route(self, request: pb.RouteRequest, out: pb.RouteResponse) -> None:
        router, workers = self._router, self._workers
        keys = router.keys_for_tokens(request.token_ids_le32, request.model, request.lora, request.cache_salt)
        match = router.index.match(keys, self._mask)
        best, depth, least, _, _ = self._scan(workers, match.overlaps, "inflight_requests", self._slots)
        worker = workers[best if depth else least]
        self._routed += 1
        request_id = f"floor-{self._routed}"
        worker.inflight_requests += 1
        self._inflight[request_id] = worker
        out.request_id = request_id
        out.worker_id = worker.id
        out.worker_address = worker.address
        out.matched_blocks = depth
        out.prompt_blocks = len(keys)
        out.policy = "floor"
        out.reason = "prefix_match" if depth else "no_overlap"


def daemon_settings(mode: str) -> dict[str, Any]:
    """The benchmark daemon's config for ``mode`` ("daemon", "observed", "deadline_off", "floor",
    "ingest"): deadline admission (on by default) modelling engines as fast as these; "observed":
    Prometheus /metrics on, as the Helm chart deploys it, so every Route and Complete is recorded;
    "deadline_off": what deadline admission costs a Route + Complete, by difference."""
    settings: dict[str, Any] = {"listen": "127.0.0.1:0", "limits": {"max_message_bytes": 64 << 20},
                                "admission": {"latency": {"prefill_ms_per_1k_tokens": BENCH_PREFILL_MS_PER_1K}}}
    if mode == "observed":
        settings["metrics"] = {"listen": "127.0.0.1:0"}
    elif mode == "deadline_off":
        settings["admission"] = {**settings["admission"], "deadline": "off"}
    return settings


def stream_items(request: pb.RouteRequest, reported: bool = False) -> tuple[Callable[[int], bytes],
                                                                             Callable[[int, str], bytes]]:
    """``(route_item, complete_item)``: a serialised RouteStreamRequest carrying ``request`` under
    an id, and one completing a routed request (with ``reported``, carrying what a gateway that
    measured its request sends: ``REPORTED_COMPLETE``). The route's bytes are encoded once: a
    RouteStreamRequest is its id (field 1, varint) then the route (field 2), and only the id changes."""
    route_field = pb.RouteStreamRequest(route=request).SerializeToString()

    def route_item(n: int) -> bytes:
        return pb.RouteStreamRequest(id=n).SerializeToString() + route_field

    def complete_item(n: int, request_id: str) -> bytes:
        complete = complete_message(request_id)
        if reported:
            complete.MergeFrom(REPORTED_COMPLETE)
        return pb.RouteStreamRequest(id=n, complete=complete).SerializeToString()

    return route_item, complete_item


async def _serve(mode: str, workers: int, blocks: int, port_file: str) -> None:
    if mode == "trivial":
        service: router_pb2_grpc.KVRouterServicer | None = TrivialService()
    else:
        from ..config import parse_config
        from ..server.app import Daemon
        from .workload import populate

        daemon = Daemon(parse_config(daemon_settings(mode)))
        if mode == "ingest":  # one empty event-driven worker
            from ..index.workers import WorkerSpec
            from ..protocols import CacheMode

            daemon.router.add_worker(WorkerSpec("w0", "10.0.0.1:8000", mode=CacheMode.EVENTS))
        else:
            populate(daemon.router, workers, blocks)
        # "floor": the daemon is built for its populated index only; its own server never starts
        service = FloorService(daemon.router) if mode == "floor" else None
    if service is not None:
        server = grpc.aio.server(options=_OPTIONS)
        router_pb2_grpc.add_KVRouterServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = server.stop
    else:
        port = await daemon.start()
        stop = daemon.stop
    Path(port_file).write_text(str(port))
    try:
        await asyncio.Event().wait()
    finally:
        await stop(0)


def server_grpc_experiments() -> str:
    """The ``GRPC_EXPERIMENTS`` the benchmark's servers run with: the daemon's own at start-up
    (``kvrouterd serve`` sets it), added to this process's."""
    return grpc_runtime.server_experiments(os.environ.get(grpc_runtime.ENV, ""))


#: the directory this ``kvrouterd`` package is in: a server started with ``python -m`` from there
#: imports this package (``-m`` puts the working directory first on ``sys.path``, before
#: ``PYTHONPATH`` and site-packages), not whichever ``kvrouterd`` the caller's directory holds
_PACKAGE_HOME = Path(__file__).resolve().parents[2]


class ServerProcess:
    """A benchmark server in a child process, running the code this process runs (started from
    ``_PACKAGE_HOME``); ``port`` is known once it is listening."""

    def __init__(self, mode: str, workers: int = 0, blocks: int = 0) -> None:
        self._tmp = tempfile.NamedTemporaryFile(suffix=".port", delete=False)
        self._tmp.close()
        os.unlink(self._tmp.name)
        env = {**os.environ, grpc_runtime.ENV: server_grpc_experiments()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrouterd.benchmarks.grpc_bench", "serve", mode, str(workers), str(blocks), self._tmp.name],
            env=env, cwd=_PACKAGE_HOME,
        )
        deadline = time.time() + 300
        while not os.path.exists(self._tmp.name) or not Path(self._tmp.name).read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"benchmark server ({mode}) failed to start")
            time.sleep(0.05)
        self.port = int(Path(self._tmp.name).read_text())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        if os.path.exists(self._tmp.name):
            os.unlink(self._tmp.name)


def _summary(latencies: list[float], elapsed: float, reasons: Counter[str]) -> dict[str, Any]:
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,  # routed requests/s, each with its Complete sent
        "p50_us": statistics.median(latencies) * 1e6,  # Route latency (its Complete not included)
        "p99_us": p99(latencies) * 1e6,
        "calls": len(latencies),
        "reasons": dict(reasons),  # the policy's reason for each recorded route
    }


async def _load(port: int, request: pb.RouteRequest, inflight: int, seconds: float) -> dict[str, Any]:
    """``inflight`` clients, each a closed loop of Route then Complete (unary calls)."""
    payload = request.SerializeToString()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
        # pre-serialised, as for the streams below: encoding 4,000 token ids costs the client
        # ~100 us a call, CPU the server would otherwise lose on a shared machine
        route = channel.unary_unary(
            "/kvrouter.v1.KVRouter/Route", request_serializer=lambda b: b, response_deserializer=pb.RouteResponse.FromString
        )
        complete = channel.unary_unary(
            "/kvrouter.v1.KVRouter/Complete",
            request_serializer=pb.CompleteRequest.SerializeToString,
            response_deserializer=pb.CompleteResponse.FromString,
        )
        for _ in range(50):  # warm up the connection and the server's caches
            await complete(complete_message((await route(payload)).request_id))
        latencies: list[float] = []
        reasons: Counter[str] = Counter()
        end = time.perf_counter() + seconds

        async def client() -> None:
            clock = time.perf_counter
            while True:
                t0 = clock()
                if t0 >= end:
                    return
                routed = await route(payload)
                latencies.append(clock() - t0)
                reasons[routed.reason] += 1
                await complete(complete_message(routed.request_id))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(inflight)))
        elapsed = time.perf_counter() - t0
    return _summary(latencies, elapsed, reasons)


async def _stream_load(
    port: int, request: pb.RouteRequest, streams: int, per_stream: int, seconds: float, coalesce: bool = True,
    reported: bool = False,
) -> dict[str, Any]:
    """RouteStream with ``per_stream`` requests kept in flight on each of ``streams`` streams.

    Each stream is a closed loop: a route's answer sends its complete message, as the SDK
    does, and the next route. The route's bytes are serialised once up front, so the client
    spends its share of the CPU on gRPC alone. With ``coalesce`` the load sends what the SDK
    sends to a router that advertises batches: whatever is ready to go when it writes (here:
    everything one answer message asked for) goes in one batch message, with no waiting for
    more; without it, one stream message per Route and per Complete, as to an older router.
    ``batch_items_sent`` / ``_received`` are the mean items per stream message each way.
    The batches are cut and framed by the SDK's own functions. With ``reported`` each complete
    message carries what a gateway that measured its request sends (``REPORTED_COMPLETE``)."""
    from kvrouter_client._streams import advertised_limit, answers, wire_messages

    message, complete_item = stream_items(request, reported)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
        open_stream = channel.stream_stream(
            "/kvrouter.v1.KVRouter/RouteStream",
            request_serializer=lambda b: b,
            response_deserializer=pb.RouteStreamResponse.FromString,
        )
        latencies: list[float] = []
        reasons: Counter[str] = Counter()
        errors = 0
        counts = Counter[str]()  # messages and items, each way, of the recorded streams

        async def one_stream(end: float, record: bool) -> None:
            nonlocal errors
            call = open_stream()
            limit = advertised_limit(await call.initial_metadata()) if coalesce else 0
            if coalesce and not limit:
                raise RuntimeError("the server does not advertise RouteStream batches")
            clock = time.perf_counter
            sent_at: dict[int, float] = {}  # routes awaiting their answer
            completing: set[int] = set()  # completes awaiting theirs

            async def send(out: list[bytes]) -> None:
                for wire, n in wire_messages(out, limit):
                    await call.write(wire)
                    if record:
                        counts["messages_sent"] += 1
                        counts["items_sent"] += n

            out = []
            for next_id in range(per_stream):
                sent_at[next_id] = clock()
                out.append(message(next_id))
            next_id = per_stream
            await send(out)
            while sent_at or completing:
                reply = await call.read()
                now = clock()
                items = answers(reply)
                if record:
                    counts["messages_received"] += 1
                    counts["items_received"] += len(items)
                out = []
                for item in items:
                    kind = item.WhichOneof("kind")
                    if item.id in completing:
                        completing.discard(item.id)
                        errors += kind != "complete"
                        continue
                    t0 = sent_at.pop(item.id)
                    if kind != "route":
                        errors += 1
                        continue
                    if record:
                        latencies.append(now - t0)
                        reasons[item.route.reason] += 1
                    completing.add(next_id)
                    out.append(complete_item(next_id, item.route.request_id))
                    next_id += 1
                    if now < end:
                        sent_at[next_id] = now
                        out.append(message(next_id))
                        next_id += 1
                if out:
                    await send(out)
            await call.done_writing()
            await call.read()  # the server's end of stream

        await one_stream(time.perf_counter() + 0.2, record=False)  # warm up
        t0 = time.perf_counter()
        await asyncio.gather(*(one_stream(t0 + seconds, record=True) for _ in range(streams)))
        elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{errors} streamed Route or Complete messages were answered with an error")
    result = _summary(latencies, elapsed, reasons)
    result["batch_items_sent"] = counts["items_sent"] / max(1, counts["messages_sent"])
    result["batch_items_received"] = counts["items_received"] / max(1, counts["messages_received"])
    return result


async def _sdk_load(port: int, prompt: list[int] | array, inflight: int, seconds: float,
                    send_block_keys: bool = False) -> dict[str, Any]:
    """``inflight`` gateway tasks sharing one ``RouterClient``, each a closed loop of ``route()``
    then ``complete()``, and this process's CPU per Route + Complete (``client_cpu_us_per_call``)."""
    from kvrouter_client import RouterClient

    # a deadline well past any stall of a shared machine: a deadline missed would end the load
    async with RouterClient(f"127.0.0.1:{port}", timeout=10.0, send_block_keys=send_block_keys) as client:
        for _ in range(50):  # open the streams and read the router's batch advertisement
            await client.complete(await client.route(prompt))
        latencies: list[float] = []
        reasons: Counter[str] = Counter()
        end = time.perf_counter() + seconds

        async def gateway() -> None:
            clock = time.perf_counter
            while True:
                t0 = clock()
                if t0 >= end:
                    return
                routed = await client.route(prompt)
                latencies.append(clock() - t0)
                reasons[routed.reason] += 1
                await client.complete(routed)

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(gateway() for _ in range(inflight)))
        cpu, elapsed = time.process_time() - cpu0, time.perf_counter() - t0
    result = _summary(latencies, elapsed, reasons)
    result["client_cpu_us_per_call"] = cpu / max(1, len(latencies)) * 1e6
    return result


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a process has used so far; None where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measured(server: ServerProcess, load) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Run one load against ``server`` and add the server's CPU microseconds per call (a Route
    and its Complete): on a shared machine rates swing with other jobs, CPU per call much less."""
    import uvloop

    before = _cpu_seconds(server.proc.pid)
    result = uvloop.run(load)
    after = _cpu_seconds(server.proc.pid)
    if before is not None and after is not None and result["calls"]:
        result["server_cpu_us_per_call"] = (after - before) / result["calls"] * 1e6
    return result


def route_throughput(workers: int, blocks: int, seconds: float, prompt: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """Route rps and latency at 1 and 64 in flight and RouteStream (64 in flight over 8 streams;
    ``stream_8x8`` coalesced as the SDK sends, ``stream_8x8_single`` one message per call), for
    the daemon and the trivial server, every route completed. The prompt goes packed, as the
    SDK sends it. Against the daemon also the SDK's RouterClient, 64 in flight (``sdk_64``: the
    prompt a list; ``sdk_64_packed``: an array; ``sdk_64_keys``: a list sent as block keys), with
    this process's CPU per call. Then ``stream_8x8`` alone against the daemon as deployed
    (``observed``: /metrics on, Completes reporting latencies and cached tokens), without
    deadline admission (``deadline_off``) and against ``floor`` (``FloorService``)."""
    request = pb.RouteRequest(token_ids_le32=array("I", prompt).tobytes())
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in ("trivial", "daemon"):
        server = ServerProcess(mode, workers, blocks)
        try:
            out[mode] = {f"inflight_{n}": _measured(server, _load(server.port, request, n, seconds)) for n in (1, 64)}
            # as the SDK does against this router (batches), and one message per Route and Complete
            out[mode]["stream_8x8"] = _measured(server, _stream_load(server.port, request, 8, 8, seconds))
            out[mode]["stream_8x8_single"] = _measured(
                server, _stream_load(server.port, request, 8, 8, seconds, coalesce=False)
            )
            if mode == "daemon":  # the gateway's own CPU through the SDK
                out[mode]["sdk_64"] = _measured(server, _sdk_load(server.port, list(prompt), 64, seconds))
                out[mode]["sdk_64_packed"] = _measured(server, _sdk_load(server.port, array("I", prompt), 64, seconds))
                out[mode]["sdk_64_keys"] = _measured(server, _sdk_load(server.port, list(prompt), 64, seconds, True))
        finally:
            server.close()
    # the streamed load against the daemon as the Helm chart runs it (/metrics on) with Completes
    # that carry what gateways report, without deadline admission (what it costs, by difference),
    # and against the floor of a Python router (FloorService)
    for mode in ("observed", "deadline_off", "floor"):
        server = ServerProcess(mode, workers, blocks)
        try:
            out[mode] = {"stream_8x8": _measured(
                server, _stream_load(server.port, request, 8, 8, seconds, reported=mode == "observed"))}
        finally:
            server.close()
    return out


async def _ingest(port: int, total_blocks: int, blocks_per_event: int, events_per_batch: int, packed: bool) -> float:
    batches: list[pb.EventBatch] = []
    made, eh, seq, tok = 0, 1, 0, 0
    while made < total_blocks:
        events = []
        for _ in range(events_per_batch):
            n = min(blocks_per_event, total_blocks - made)
            if n <= 0:
                break
            tokens = array("I", range(tok, tok + n * BLOCK_SIZE))
            if packed:  # as the SDK sends them (a little-endian host's array is the wire layout)
                st = pb.StoredBlocks(engine_hashes=range(eh, eh + n), token_ids_le32=tokens.tobytes())
            else:  # as older clients send them
                st = pb.StoredBlocks(engine_hashes=range(eh, eh + n), token_ids=tokens)
            events.append(pb.CacheEvent(stored=st))
            eh, tok, made = eh + n, tok + n * BLOCK_SIZE, made + n
        batches.append(pb.EventBatch(worker_id="w0", sequence=seq, events=events))
        seq += 1
    payloads = [b.SerializeToString() for b in batches]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
        # pre-serialised messages: the client's cost stays out of the server's measurement
        publish = channel.stream_unary(
            "/kvrouter.v1.KVRouter/PublishEvents",
            request_serializer=lambda b: b,
            response_deserializer=pb.PublishEventsResponse.FromString,
        )

        async def gen():  # type: ignore[no-untyped-def]
            for p in payloads:
                yield p

        t0 = time.perf_counter()
        summary = await publish(gen())
        elapsed = time.perf_counter() - t0
    assert summary.blocks_stored == total_blocks, summary
    return total_blocks / elapsed


def ingest_throughput(total_blocks: int, blocks_per_event: int = 32, events_per_batch: int = 16, packed: bool = True) -> float:
    """Stored block events/s through PublishEvents into a fresh daemon; ``packed``: tokens in
    ``token_ids_le32`` (the SDK's form) rather than the repeated ``token_ids``."""
    import uvloop

    server = ServerProcess("ingest")
    try:
        return uvloop.run(_ingest(server.port, total_blocks, blocks_per_event, events_per_batch, packed))
    finally:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["serve"])
    parser.add_argument("mode", choices=["trivial", "floor", "daemon", "observed", "deadline_off", "ingest"])
    parser.add_argument("workers", type=int)
    parser.add_argument("blocks", type=int)
    parser.add_argument("port_file")
    a = parser.parse_args()
    import uvloop

    uvloop.run(_serve(a.mode, a.workers, a.blocks, a.port_file))
