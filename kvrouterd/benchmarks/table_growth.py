"""The slowest single call while the native tables grow (issue #16 item 1: no call may hold the
event loop more than a few milliseconds).

``store_stall``: blocks stored through ``Router.apply`` in batches of one ``blocks_per_call``-block
Stored event each (engine hashes mapped, so the global BlockTable and the worker's U64Map both
grow), the slowest single ``apply``. ``u64map_stall``: entries set into one ``U64Map`` ``part`` at
a time, the slowest part. Each reports the slowest by wall clock and by the thread's CPU time
(user and kernel: page faults included, time the process was not scheduled not: on a shared
2-core machine the wall clock's worst is often another process's). Both report, never assert;
run each in a fresh process (``python -m kvrouterd.benchmarks.table_growth``) for a clean heap.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from array import array

from ..clock import ManualClock
from ..index import native
from ..index.workers import WorkerSpec
from ..protocols import CacheMode, EventBatch, Stored
from ..router import Router, RouterSettings
from .workload import BLOCK_SIZE


def store_stall(total_blocks: int = 1_000_000, blocks_per_call: int = 512) -> dict[str, float]:
    """Slowest ``Router.apply`` of one ``blocks_per_call``-block Stored event, storing
    ``total_blocks`` new blocks into an empty index; the events are built ahead, untimed."""
    router = Router(RouterSettings(block_size=BLOCK_SIZE), ManualClock())
    router.add_worker(WorkerSpec("w0", "h:1", mode=CacheMode.EVENTS))
    tokens = array("I", range(blocks_per_call * BLOCK_SIZE))
    durations: list[float] = []
    cpu: list[float] = []
    made = 0
    seq = 0
    gc.collect()
    gc.disable()  # a full collection's pause is not the tables' growth
    try:
        while made < total_blocks:
            n = min(blocks_per_call, total_blocks - made)
            # distinct chains: the first token names the chain, so every block is new
            tokens[0] = seq
            stored = Stored(tokens[: n * BLOCK_SIZE].tobytes(), tuple(range(made + 1, made + n + 1)))
            batch = EventBatch("w0", seq, (stored,))
            c0, t0 = time.thread_time(), time.perf_counter()
            router.apply(batch)
            durations.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            made += n
            seq += 1
    finally:
        gc.enable()
    ordered = sorted(durations)
    return {
        "blocks": len(router.index),
        "calls": len(durations),
        "slowest_ms": ordered[-1] * 1e3,
        "second_ms": ordered[-2] * 1e3 if len(ordered) > 1 else 0.0,
        "median_ms": ordered[len(ordered) // 2] * 1e3,
        "slowest_cpu_ms": max(cpu) * 1e3,
        "total_s": sum(durations),
        "total_cpu_s": sum(cpu),
    }


def u64map_stall(entries: int = 350_000, part: int = 512) -> dict[str, float]:
    """Slowest part of ``part`` single-entry sets filling a fresh ``u64_map()`` to ``entries``."""
    m = native.u64_map()
    worst = worst_cpu = 0.0
    clock, cpu = time.perf_counter, time.thread_time
    mult = 2654435761
    for start in range(0, entries, part):
        c0, t0 = cpu(), clock()
        for k in range(start, min(start + part, entries)):
            m[k * mult % (1 << 64)] = k
        worst = max(worst, clock() - t0)
        worst_cpu = max(worst_cpu, cpu() - c0)
    return {"entries": len(m), "part": part, "slowest_part_ms": worst * 1e3, "slowest_part_cpu_ms": worst_cpu * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=("store", "u64map"))
    parser.add_argument("--n", type=int, default=1_000_000, help="blocks (store) or entries (u64map)")
    parser.add_argument("--part", type=int, default=512, help="blocks per Stored event, entries per timed part")
    args = parser.parse_args()
    result = store_stall(args.n, args.part) if args.what == "store" else u64map_stall(args.n, args.part)
    result["native"] = native.module is not None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
