"""A fleet for a policy's tests: a router of event-driven workers on a manual clock."""

from __future__ import annotations

import random

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode
from kvrouterd.router import Router, RouterSettings


def policy_fleet(routing: dict, size: int, block_size: int) -> tuple[Router, ManualClock]:
    """``size`` workers w0, w1, ... in slot order, routed by ``routing`` (a policy's config)."""
    clock = ManualClock()
    router = Router(RouterSettings(block_size=block_size, routing=routing), clock, random.Random(0))
    for i in range(size):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=CacheMode.EVENTS))
    return router, clock
