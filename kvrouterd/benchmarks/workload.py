"""Synthetic fleets and prompts shared by the benchmarks.

A fleet of W workers holding ~N blocks in total: conversations of ``blocks_per_prompt``
blocks that share a system prompt per "tenant", spread over the workers round-robin, so
the benchmark prompt matches a long prefix on some workers and a short one on others (the
match walk does real work instead of stopping at block 0).
"""

from __future__ import annotations

import random

from ..clock import SystemClock
from ..config import Config
from ..index.workers import WorkerSpec
from ..protocols import CacheMode, EventBatch, Stored
from ..router import Router

BLOCK_SIZE = 16
PROMPT_TOKENS = 4000
SYSTEM_PROMPT_BLOCKS = 64


def build_router(workers: int, total_blocks: int, policy: str = "cache_aware", seed: int = 7) -> tuple[Router, list[int]]:
    """A router whose index holds ~``total_blocks`` blocks over ``workers`` event-driven workers.

    The router is the daemon's: its default configuration (limits, eviction) with ``policy``
    routing, on the system clock, so a decision measured here runs the checks a Route runs.
    Returns the router and the benchmark prompt's tokens (4,000 tokens, 250 blocks), whose first
    blocks are cached on several workers to different depths.
    """
    settings = Config(block_size=BLOCK_SIZE, routing={"name": policy}).router_settings()
    router = Router(settings, SystemClock(), random.Random(seed))
    return router, populate(router, workers, total_blocks, seed)


def populate(router: Router, workers: int, total_blocks: int, seed: int = 7) -> list[int]:
    """Register ``workers`` event-driven workers and store blocks until the index holds ``total_blocks``."""
    rng = random.Random(seed)
    for i in range(workers):
        router.add_worker(WorkerSpec(f"w{i}", f"10.0.{i // 250}.{i % 250}:8000", capacity_blocks=0, mode=CacheMode.EVENTS))
    system = [rng.randrange(32000) for _ in range(SYSTEM_PROMPT_BLOCKS * BLOCK_SIZE)]
    prompt = system + [rng.randrange(32000) for _ in range(PROMPT_TOKENS - len(system))]
    seq = [0] * workers
    per_prompt = PROMPT_TOKENS // BLOCK_SIZE
    i = 0
    while len(router.index) < total_blocks:
        w = i % workers
        if i < workers:
            # every worker caches a different-length prefix of the benchmark prompt
            depth = max(1, (per_prompt * (i + 1)) // (workers + 1))
            tokens = prompt[: depth * BLOCK_SIZE]
        else:
            tokens = system + [rng.randrange(32000) for _ in range((per_prompt - SYSTEM_PROMPT_BLOCKS) * BLOCK_SIZE)]
        router.apply(EventBatch(f"w{w}", seq[w], (Stored(tuple(tokens), None),)))
        seq[w] += 1
        i += 1
    return prompt
