"""Small-Route latency while a hostile client makes big calls about a huge worker (issue #16 item 1).

    python -m kvrouterd.benchmarks.big_worker_stall                       # 400k blocks, 1 worker
    python -m kvrouterd.benchmarks.big_worker_stall --blocks 1000000 --workers 8

Runs ``kvrouterd serve`` in its own process (as in production) with ``--workers`` event-mode
workers holding ``--blocks`` blocks together, plus an empty one (``spare``, so Routes have
somewhere to go while ``gpu-0`` is deregistered) (chains of ``--chain`` blocks, published through
PublishEvents as an engine would), ``--sessions`` of those chains routed again with a session id
(so T-LRU and UniCache remember conversations), and the daemon's eviction policy set to
``--configured``. Then, per call kind, a probe client sends small Routes (+ Complete) back to
back, ``--probes`` of them, while a hostile client sends the call about the first (largest)
worker ``gpu-0``:

* ``evict_hint/<policy>``: EvictHint ``blocks=4294967295`` for every registered eviction
  policy (the configured one ranks from its hooks' state, the others are built for the call);
* ``export_index``: ExportIndex of the whole index, read to the end;
* ``report_load``: ReportLoad;
* ``cleared``: a PublishEvents batch holding one AllBlocksCleared for ``gpu-0``;
* ``deregister``: DeregisterWorker of ``gpu-0``.

The calls that change nothing are sent back to back for the whole probe run; the two that
empty the worker once per round (the worker is loaded again before the next). Per call kind:
the call's own latency, the probes' p50/p99/max while a call was in flight (a probe counts if
its round trip overlapped one), and the daemon's own view of its event loop: the largest
``kvrouter_event_loop_lag_seconds`` bucket that counted a heartbeat during the run (the
heartbeat wakes every 100 ms, so a shorter stall shows only if one was due inside it) and the
largest stall its watchdog warned about (``--stall-warn-ms``). Medians over ``--rounds``
rounds; the load average before and after. Progress on stderr, a table (or ``--json``) at
the end. Reports, never asserts (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
import urllib.request
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .._generated.kvrouter.v1 import router_pb2 as pb
from .._generated.kvrouter.v1 import router_pb2_grpc
from ..policies import registry
from . import harness
from .cli import _Steps
from .serve_process import ServeProcess
from .stats import latency_summary

BLOCK_SIZE = 16
#: what the hostile client asks for: every block there could be
ALL_BLOCKS = 4294967295
_LAG_BUCKET = re.compile(r'^kvrouter_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)


def config_yaml(configured: str, stall_warn_ms: float) -> str:
    """The daemon's config: metrics served, ``configured`` eviction, the watchdog at ``stall_warn_ms``."""
    return (
        "listen: 127.0.0.1:0\n"
        "metrics: {listen: 127.0.0.1:0}\n"
        f"eviction: {{name: {configured}}}\n"
        f"telemetry: {{loop_stall_warn_ms: {stall_warn_ms:g}}}\n"
        "limits: {max_message_bytes: 67108864}\n"
    )


def _channel(port: int) -> grpc.aio.Channel:
    return harness.channel(port, 256 << 20)  # room for whatever a call about a huge worker sends or answers


class Fleet:
    """The workers' blocks as PublishEvents batches, so a worker can be loaded again after a
    call emptied it, and the prompts of the chains routed again with session ids."""

    def __init__(self, blocks: int, workers: int, chain: int, sessions: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.workers = [f"gpu-{w}" for w in range(workers)]
        self.sequence = dict.fromkeys(self.workers, 0)
        self.batches: dict[str, list[pb.EventBatch]] = {}
        self.prompts: list[tuple[str, bytes]] = []  # (worker, the tokens of one of its chains)
        per_worker = blocks // workers
        engine_hash = 1
        for worker in self.workers:
            events: list[pb.CacheEvent] = []
            for _ in range(per_worker // chain):
                tokens = array("I", (rng.getrandbits(31) for _ in range(chain * BLOCK_SIZE))).tobytes()
                events.append(pb.CacheEvent(stored=pb.StoredBlocks(
                    engine_hashes=range(engine_hash, engine_hash + chain), token_ids_le32=tokens)))
                engine_hash += chain
                self.prompts.append((worker, tokens))
            self.batches[worker] = [events[i:i + 32] for i in range(0, len(events), 32)]
        rng.shuffle(self.prompts)
        self.prompts = self.prompts[:sessions]

    async def load(self, channel: grpc.aio.Channel, worker: str) -> None:
        stub = router_pb2_grpc.KVRouterStub(channel)

        def batches():  # type: ignore[no-untyped-def]
            for events in self.batches[worker]:
                yield pb.EventBatch(worker_id=worker, sequence=self.sequence[worker], events=events)
                self.sequence[worker] += 1

        summary = await stub.PublishEvents(batches())
        assert summary.blocks_stored == sum(len(e.stored.engine_hashes) for b in self.batches[worker] for e in b), summary

    async def clear(self, channel: grpc.aio.Channel, worker: str) -> None:
        stub = router_pb2_grpc.KVRouterStub(channel)
        batch = pb.EventBatch(worker_id=worker, sequence=self.sequence[worker], events=[pb.CacheEvent(cleared=pb.AllBlocksCleared())])
        self.sequence[worker] += 1

        async def one():  # type: ignore[no-untyped-def]
            yield batch

        await stub.PublishEvents(one())

    async def register(self, channel: grpc.aio.Channel, worker: str) -> None:
        await harness.register_worker(channel, worker, f"127.0.0.1:{8000 + int(worker.split('-')[1])}")
        self.sequence[worker] = 0

    async def converse(self, channel: grpc.aio.Channel) -> None:
        """Route each chosen chain again under a session id of its own: T-LRU and UniCache then
        remember that many conversations on the workers that hold them."""
        stub = router_pb2_grpc.KVRouterStub(channel)
        sem = asyncio.Semaphore(16)

        async def one(n: int, tokens: bytes) -> None:
            async with sem:
                reply = await stub.Route(pb.RouteRequest(token_ids_le32=tokens, session_id=f"conversation-{n}"))
                await stub.Complete(harness.complete_message(reply.request_id))

        await asyncio.gather(*(one(n, t) for n, (_, t) in enumerate(self.prompts)))


async def _lag_buckets(metrics_port: int) -> dict[float, float]:
    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    text = await asyncio.to_thread(scrape)
    return {float(le): float(n) for le, n in _LAG_BUCKET.findall(text)}


def _largest_lag_bucket(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the largest lag bucket that counted a heartbeat between the scrapes
    (cumulative buckets: a bucket's own count is its increase minus the one below's)."""
    bounds = sorted(after)
    largest = 0.0
    below = 0.0
    for le in bounds:
        grew = after[le] - before.get(le, 0.0)
        if grew - below > 0:
            largest = le
        below = grew
    return largest


async def _phase(
    daemon: ServeProcess, probes: int, call: Callable[[], Awaitable[Any]], repeat: bool
) -> dict[str, Any]:
    """Probes back to back while ``call`` runs (over and over when ``repeat``, else once after
    the 20th probe), ``probes`` of them and more until the last call answered; the probes whose
    round trip overlapped a call, and the calls' latencies."""
    channel = _channel(daemon.port)
    stub = router_pb2_grpc.KVRouterStub(channel)
    probe_msg = harness.packed_route(256, 7)
    for _ in range(10):  # connection and caches warm
        reply = await stub.Route(probe_msg)
        await stub.Complete(harness.complete_message(reply.request_id))
    spans: list[tuple[float, float]] = []  # the probes' (start, end)
    calls: list[tuple[float, float]] = []
    done = asyncio.Event()
    started_20 = asyncio.Event()

    calls_done = asyncio.Event()

    async def probe() -> None:
        n = 0
        # at least ``probes``, and until the last call has answered, so some overlap each call
        while n < probes or not calls_done.is_set():
            n += 1
            t0 = time.perf_counter()
            reply = await stub.Route(probe_msg)
            spans.append((t0, time.perf_counter()))
            try:
                await stub.Complete(harness.complete_message(reply.request_id))
            except grpc.aio.AioRpcError as exc:  # routed to the worker deregistered meanwhile
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            if n == 20:
                started_20.set()
            if n >= probes:
                done.set()

    async def hostile() -> None:
        await started_20.wait()
        while True:
            t0 = time.perf_counter()
            await call()
            calls.append((t0, time.perf_counter()))
            if not repeat or done.is_set():
                calls_done.set()
                return

    lag_before = await _lag_buckets(daemon.metrics_port)
    warned = len(daemon.warnings)
    await asyncio.gather(probe(), hostile())
    await asyncio.sleep(0.25)  # the heartbeat after a stall reports it
    lag_after = await _lag_buckets(daemon.metrics_port)
    await channel.close()
    stalls = harness.watchdog_stalls(daemon.warnings[warned:])
    during = [e - s for s, e in spans if any(s < ce and e > cs for cs, ce in calls)]
    return {
        "call_ms": [round((e - s) * 1e3, 2) for s, e in calls],
        "probes_during": latency_summary(during, "n"),
        "probes_all": latency_summary([e - s for s, e in spans], "n"),
        "loop_lag_bucket_ms": round(_largest_lag_bucket(lag_before, lag_after) * 1e3, 1),
        "watchdog_blocked_ms": max((float(s["blocked_ms"]) for s in stalls), default=0.0),
    }


async def _round(daemon: ServeProcess, fleet: Fleet, args: argparse.Namespace, step: Callable[[str], None],
                 loaded: bool) -> dict[str, dict[str, Any]]:
    control = _channel(daemon.port)
    stub = router_pb2_grpc.KVRouterStub(control)
    target = fleet.workers[0]
    if not loaded:
        # an empty worker beside the loaded ones, so the probes are routed while gpu-0 is gone
        await harness.register_worker(control, "spare", "127.0.0.1:7999")
        for worker in fleet.workers:
            await fleet.register(control, worker)
        step(f"loading {args.blocks:,} blocks over {len(fleet.workers)} worker(s)")
        for worker in fleet.workers:
            await fleet.load(control, worker)
        step(f"routing {len(fleet.prompts):,} conversations again with session ids")
        await fleet.converse(control)
    out: dict[str, dict[str, Any]] = {}

    hostile = _channel(daemon.port)
    hstub = router_pb2_grpc.KVRouterStub(hostile)

    def evict(policy: str) -> Callable[[], Awaitable[Any]]:
        return lambda: hstub.EvictHint(pb.EvictHintRequest(worker_id=target, blocks=ALL_BLOCKS, policy=policy))

    async def export() -> int:
        return sum([len(c.keys) async for c in hstub.ExportIndex(pb.ExportIndexRequest())])

    async def report_load() -> None:
        await hstub.ReportLoad(pb.ReportLoadRequest(worker_id=target, queued_requests=3, running_requests=5,
                                                    kv_utilization=0.5))

    for policy in registry.names("eviction"):
        step(f"EvictHint blocks={ALL_BLOCKS} policy={policy}")
        out[f"evict_hint/{policy}"] = await _phase(daemon, args.probes, evict(policy), repeat=True)
    step("ExportIndex of the whole index")
    out["export_index"] = await _phase(daemon, args.probes, export, repeat=True)
    step("ReportLoad")
    out["report_load"] = await _phase(daemon, args.probes, report_load, repeat=True)
    step(f"Cleared for {target}")
    out["cleared"] = await _phase(daemon, args.probes, lambda: fleet.clear(hostile, target), repeat=False)
    step(f"loading {target} again")
    await fleet.load(control, target)
    step(f"DeregisterWorker {target}")
    out["deregister"] = await _phase(
        daemon, args.probes, lambda: hstub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id=target)), repeat=False)
    step(f"registering and loading {target} again")
    await fleet.register(control, target)
    await fleet.load(control, target)
    stats = await stub.GetStats(pb.GetStatsRequest())
    assert stats.indexed_blocks >= args.blocks // len(fleet.workers) * len(fleet.workers) // 2, stats.indexed_blocks
    await hostile.close()
    await control.close()
    return out


def _figures(phase: dict[str, Any]) -> dict[str, float]:
    """One round's figures for one call kind, as the table gives their medians."""
    return {
        "call_ms": statistics.median(phase["call_ms"]),
        "call_ms_max": max(phase["call_ms"]),
        "calls": len(phase["call_ms"]),
        "probes_during": phase["probes_during"]["n"],
        "p50_ms": phase["probes_during"]["p50_ms"],
        "p99_ms": phase["probes_during"]["p99_ms"],
        "max_ms": phase["probes_during"]["max_ms"],
        "loop_lag_bucket_ms": phase["loop_lag_bucket_ms"],
        "watchdog_blocked_ms": phase["watchdog_blocked_ms"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    step = _Steps(4 + args.rounds * (len(registry.names("eviction")) + 8))
    step(f"building {args.blocks:,} blocks of events")
    fleet = Fleet(args.blocks, args.workers, args.chain, args.sessions)
    result: dict[str, Any] = {
        "blocks": args.blocks, "workers": args.workers, "chain_blocks": args.chain, "sessions": len(fleet.prompts),
        "configured_eviction": args.configured, "probes_per_call_kind": args.probes, "rounds": args.rounds,
        "loadavg_before": os.getloadavg(),
    }
    rounds: list[dict[str, dict[str, Any]]] = []
    step("starting kvrouterd serve")
    try:
        with harness.daemon(config_yaml(args.configured, args.stall_warn_ms), "big-worker") as daemon:
            for r in range(args.rounds):
                step(f"round {r + 1}/{args.rounds}")
                rounds.append(asyncio.run(_round(daemon, fleet, args, step, loaded=r > 0)))
    finally:
        step.close()
    result["loadavg_after"] = os.getloadavg()
    result["rounds_raw"] = rounds
    result["median"] = {kind: harness.medians([_figures(r[kind]) for r in rounds]) for kind in rounds[0]}
    return result


def table(result: dict[str, Any]) -> str:
    head = ("call", "call ms", "calls", "probes", "probe p50", "p99", "max", "loop lag <=", "watchdog")
    rows = [head]
    for kind, m in result["median"].items():
        rows.append((kind, f"{m['call_ms']:.1f}", f"{m['calls']:.0f}", f"{m['probes_during']:.0f}", f"{m['p50_ms']:.2f}",
                     f"{m['p99_ms']:.2f}", f"{m['max_ms']:.2f}", f"{m['loop_lag_bucket_ms']:g}", f"{m['watchdog_blocked_ms']:g}"))
    lines = [
        f"\nkvrouterd big-worker stall: {result['blocks']:,} blocks over {result['workers']} worker(s) "
        f"(chains of {result['chain_blocks']}), {result['sessions']:,} conversations, eviction "
        f"{result['configured_eviction']!r} configured; medians of {result['rounds']} rounds, ms",
        f"load average before {', '.join(f'{x:.2f}' for x in result['loadavg_before'])}, "
        f"after {', '.join(f'{x:.2f}' for x in result['loadavg_after'])}",
    ]
    lines += harness.table_lines(rows, right_from=1, rule=True)
    lines.append("call ms: the call's median latency; probes: small Routes whose round trip overlapped a call, "
                 "their p50/p99/max; loop lag: the largest lag-histogram bucket counted (10 Hz heartbeat); "
                 "watchdog: the largest stall it warned about (0: none)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--blocks", type=int, default=400_000, help="blocks held by all workers together")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--chain", type=int, default=16, help="blocks per stored chain (a prompt's worth)")
    parser.add_argument("--sessions", type=int, default=4096, help="chains routed again under a session id")
    parser.add_argument("--configured", default="lru", help="the daemon's eviction policy (eviction.name)")
    parser.add_argument("--probes", type=int, default=200, help="small Routes per call kind")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stall-warn-ms", type=float, default=10.0, help="the daemon's telemetry.loop_stall_warn_ms")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else table(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
