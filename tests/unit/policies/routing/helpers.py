"""Shared builders for routing-policy tests: a Router on a manual clock, prompts, requests."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from kvrouterd.clock import ManualClock
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Completion, RouteRequest
from kvrouterd.router import Router, RouterSettings

BLOCK = 16


def make_router(routing: Mapping[str, Any], workers: int | Sequence[str] = 4, capacity: int = 0,
                clock: ManualClock | None = None) -> tuple[Router, ManualClock]:
    clock = clock or ManualClock(1000.0)
    router = Router(RouterSettings(block_size=BLOCK, routing=dict(routing)), clock, random.Random(7))
    ids = [f"w{i}" for i in range(workers)] if isinstance(workers, int) else list(workers)
    for wid in ids:
        router.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", capacity_blocks=capacity, mode=CacheMode.APPROXIMATE))
    return router, clock


def prompt(prefix: int, prefix_tokens: int, suffix: int, suffix_tokens: int = 64) -> list[int]:
    """Tokens of a prompt: a shared prefix ``prefix`` followed by a suffix unique to ``suffix``."""
    return [prefix * 100_003 + i for i in range(prefix_tokens)] + [7_000_000 + suffix * 1_009 + i for i in range(suffix_tokens)]


_counter = 0


def request(tokens: Sequence[int], slo_ms: float = 0.0, rid: str = "") -> RouteRequest:
    global _counter
    _counter += 1
    return RouteRequest(
        request_id=rid or f"r{_counter}",
        keys=block_keys(list(tokens), BLOCK),
        prompt_tokens=len(tokens),
        ttft_slo_ms=slo_ms,
    )


def complete(router: Router, request_id: str, ttft_ms: float = 50.0, e2e_ms: float = 100.0) -> None:
    router.complete(Completion(request_id=request_id, ttft_ms=ttft_ms, e2e_ms=e2e_ms))
