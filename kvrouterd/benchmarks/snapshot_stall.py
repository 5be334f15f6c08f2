"""Route latency while a replica writes its bus snapshot (docs/deploy.md, "NATS").

    python -m kvrouterd.benchmarks.snapshot_stall --blocks 1000000

Builds a router holding ``--blocks`` blocks (4 event-mode workers, engine hashes as vLLM sends
them), then routes a 4,000-token prompt every ``--interval-ms`` on the event loop while a
snapshot is encoded, once in place (``encode_snapshot``, the loop blocked for the whole encode)
and once aside (``encode_snapshot_aside``, a forked child encodes). A Route's latency is counted
from when it was due, so a loop stall shows in full (no coordinated omission). Reports, never
asserts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable

from ..clock import SystemClock
from ..index.workers import WorkerSpec
from ..protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored
from ..router import Router, RouterSettings
from ..server.snapshot import encode_snapshot, encode_snapshot_aside
from . import harness
from .stats import p99

BLOCK_SIZE = 16


def build(blocks: int, workers: int = 4, chain: int = 64, seed: int = 1) -> Router:
    """A router whose ``workers`` event-mode workers hold ``blocks`` blocks in chains of ``chain``."""
    router = Router(RouterSettings(block_size=BLOCK_SIZE, routing={"name": "cache_aware"}), SystemClock(),
                    random.Random(seed))
    rng = random.Random(seed)
    for w in range(workers):
        router.add_worker(WorkerSpec(id=f"gpu-{w}", address=f"gpu-{w}:8000", mode=CacheMode.EVENTS))
    engine_hash = 1
    for w in range(workers):
        for seq in range(blocks // workers // chain):
            hashes = tuple(range(engine_hash, engine_hash + chain))
            engine_hash += chain
            # tokens are little-endian uint32 bytes; any 4 bytes are a token id to the router
            stored = Stored(token_ids=rng.randbytes(chain * BLOCK_SIZE * 4), engine_hashes=hashes)
            router.apply(EventBatch(f"gpu-{w}", seq, (stored,)))
    return router


async def route_during(router: Router, snapshot: Callable[[], Awaitable[bytes]], interval_s: float) -> dict[str, float]:
    """Route every ``interval_s`` until ``snapshot()`` is done; latency from each Route's due time."""
    loop = asyncio.get_running_loop()
    prompt = random.Random(7).randbytes(4000 * 4)
    keys = router.keys_for_tokens(prompt)
    latencies: list[float] = []
    done = asyncio.Event()

    async def client() -> None:
        due = loop.time()
        n = 0
        while not done.is_set():
            await asyncio.sleep(max(0.0, due - loop.time()))
            result = router.route(RouteRequest(f"s{n}", keys, 4000), explain=False)
            router.complete(Completion(result.request.request_id))
            latencies.append(loop.time() - due)
            n += 1
            # open loop: after a stall the Routes due meanwhile run back to back, each late
            due += interval_s

    task = asyncio.create_task(client())
    await asyncio.sleep(0.2)  # the client runs before the snapshot starts
    before = len(latencies)
    started = time.perf_counter()
    data = await snapshot()
    took = time.perf_counter() - started
    await asyncio.sleep(interval_s * 3)
    done.set()
    await task
    during = latencies[before:] or [0.0]
    return {
        "snapshot_s": round(took, 3),
        "snapshot_bytes": len(data),
        "routes": len(during),
        "route_latency_ms_median": round(statistics.median(during) * 1e3, 3),
        "route_latency_ms_p99": round(p99(during) * 1e3, 3),
        "route_latency_ms_max": round(max(during) * 1e3, 3),
    }


def fork_pause_ms(runs: int) -> list[float]:
    """What ``encode_snapshot_aside`` stalls the loop for: ``fork()`` of this process as it is."""
    pauses = []
    for _ in range(runs):
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(0)
        pauses.append(round((time.perf_counter() - started) * 1e3, 2))
        os.waitpid(pid, 0)
    return pauses


async def measure(blocks: int, interval_ms: float, runs: int) -> dict[str, object]:
    router = build(blocks)
    cpu: list[float] = []

    async def in_place() -> bytes:
        started = time.process_time()
        data = encode_snapshot(router, 0)
        cpu.append(round(time.process_time() - started, 3))  # the stall on an idle machine
        return data

    async def aside() -> bytes:
        return await encode_snapshot_aside(router, 0)

    report: dict[str, object] = {"indexed_blocks": len(router.index)}
    for name, snapshot in (("in_place", in_place), ("aside", aside)):
        report[name] = [await route_during(router, snapshot, interval_ms / 1000) for _ in range(runs)]
    report["in_place_encode_cpu_s"] = cpu
    report["fork_pause_ms"] = fork_pause_ms(5)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--interval-ms", type=float, default=2.0, help="one Route every this many ms")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.blocks, args.interval_ms, args.runs)), indent=2))


if __name__ == "__main__":
    main()
