"""In-process costs: one Route decision (hash + match + policy), ingest rate, memory per block."""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from array import array

from ..clock import ManualClock
from ..index.workers import WorkerSpec
from ..protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored
from ..router import Router, RouterSettings
from .stats import p99
from .workload import BLOCK_SIZE, build_router


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def decision_cost(workers: int, total_blocks: int, repeats: int = 2000, policy: str = "cache_aware") -> dict[str, float]:
    """Median microseconds to turn a 4,000-token prompt into a decision, and the full route cycle.

    The prompt is hashed as Route hashes it (``Router.keys_for_tokens``: packed tokens in, an
    ``array('Q')`` of keys out, which the match walk reads in place), untraced (``explain=False``,
    the daemon's default with tracing off), by the daemon's default router (``build_router``)."""
    router, prompt = build_router(workers, total_blocks, policy)
    return decision_timings(router, prompt, repeats)


def decision_timings(router: Router, prompt: list[int], repeats: int = 2000) -> dict[str, float]:
    """``decision_cost``'s measurement on a router already built (``workload.build_router``), so a
    caller can measure the fleet's memory between building and timing (``benchmarks.scaling``)."""
    packed = array("I", prompt).tobytes()
    hash_prompt = router.keys_for_tokens
    decide_s: list[float] = []
    hash_s: list[float] = []
    cycle_s: list[float] = []
    clock = time.perf_counter
    gc.collect()
    for i in range(repeats):
        t0 = clock()
        keys = hash_prompt(packed)
        t1 = clock()
        router.decide(RouteRequest("", keys, len(prompt)), explain=False)
        t2 = clock()
        hash_s.append(t1 - t0)
        decide_s.append(t2 - t0)
        t3 = clock()
        result = router.route(RouteRequest(f"r{i}", hash_prompt(packed), len(prompt)), explain=False)
        router.complete(Completion(result.request.request_id))
        cycle_s.append(clock() - t3)
    return {
        "workers": len(router.workers),
        "indexed_blocks": len(router.index),
        "decision_us_median": _median_us(decide_s),
        "decision_us_p99": p99(decide_s) * 1e6,
        "hash_us_median": _median_us(hash_s),
        "route_complete_us_median": _median_us(cycle_s),
    }


def ingest_rate(total_blocks: int = 500_000, blocks_per_event: int = 32, events_per_batch: int = 16) -> dict[str, float]:
    """Block events/s applied by Router.apply (engine hashes mapped), no network."""
    router = Router(RouterSettings(block_size=BLOCK_SIZE), ManualClock())
    router.add_worker(WorkerSpec("w0", "h:1", mode=CacheMode.EVENTS))
    batches = _stored_batches(total_blocks, blocks_per_event, events_per_batch)
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        router.apply(b)
    elapsed = time.perf_counter() - t0
    return {"blocks": total_blocks, "seconds": elapsed, "blocks_per_s": total_blocks / elapsed}


def _stored_batches(total_blocks: int, blocks_per_event: int, events_per_batch: int) -> list[EventBatch]:
    batches: list[EventBatch] = []
    eh = 1
    seq = 0
    tok = 0
    events: list[Stored] = []
    made = 0
    while made < total_blocks:
        n = min(blocks_per_event, total_blocks - made)
        tokens = array("I", range(tok, tok + n * BLOCK_SIZE)).tobytes()
        tok += n * BLOCK_SIZE
        events.append(Stored(tokens, tuple(range(eh, eh + n))))
        eh += n
        made += n
        if len(events) == events_per_batch or made >= total_blocks:
            batches.append(EventBatch("w0", seq, tuple(events)))
            seq += 1
            events = []
    return batches


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS where glibc can (``malloc_trim``). The buffers
    this benchmark builds and frees (a chunk's token bytes, ~3 MB) otherwise stay resident as
    holes in the heap and count as index memory: ~7 bytes a block at 10^5 blocks."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: RSS as it is
        pass


def _rss_bytes() -> int:
    gc.collect()
    _trim_heap()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def memory_per_block(total_blocks: int = 1_000_000, engine_hashes: bool = True) -> dict[str, float]:
    """RSS growth per block held by one worker, stored through Router.apply.

    With ``engine_hashes`` the engine-hash -> key map is included (vLLM/SGLang); without it
    the publisher uses kvrouterd keys as hashes (our SDK) and no map is kept.
    Run in a fresh process for a clean baseline.
    """
    router = Router(RouterSettings(block_size=BLOCK_SIZE), ManualClock())
    router.add_worker(WorkerSpec("w0", "h:1", mode=CacheMode.EVENTS))
    chunk = 50_000
    gc.collect()
    before = _rss_bytes()
    made = 0
    seq = 0
    eh = 1
    while made < total_blocks:
        n = min(chunk, total_blocks - made)
        # 250-block prompts (4,000 tokens), the shape of a real cache
        events = []
        for start in range(0, n, 250):
            m = min(250, n - start)
            toks = array("I", range((made + start) * BLOCK_SIZE, (made + start + m) * BLOCK_SIZE)).tobytes()
            events.append(Stored(toks, tuple(range(eh, eh + m)) if engine_hashes else None))
            eh += m
        router.apply(EventBatch("w0", seq, tuple(events)))
        seq += 1
        made += n
        del events
    gc.collect()
    after = _rss_bytes()
    return {"blocks": len(router.index), "bytes_per_block": (after - before) / len(router.index)}
