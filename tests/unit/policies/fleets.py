"""A fleet for a policy's tests (a router of event-driven workers on a manual clock), and the
check the native passes' tests share: a decision made unexplained is the explained one."""

from __future__ import annotations

import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Decision, RouteRequest
from kvrouterd.router import Router, RouterSettings

#: the block size of these fleets, and a prompt of 8 full blocks
BS = 16
TOKENS = list(range(8 * BS))

needs_native = pytest.mark.skipif(native.module is None, reason=native.status)


def policy_fleet(routing: dict, size: int, block_size: int = BS) -> tuple[Router, ManualClock]:
    """``size`` workers w0, w1, ... in slot order, routed by ``routing`` (a policy's config)."""
    clock = ManualClock()
    router = Router(RouterSettings(block_size=block_size, routing=routing), clock, random.Random(0))
    for i in range(size):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=CacheMode.EVENTS))
    return router, clock


def deadline_fleet(seed: int, size: int, rng: random.Random) -> tuple[Router, ManualClock]:
    """What deadline admission's tests price: ``size`` least-loaded workers w0, w1, ... whose KV
    capacity (none, small, large) and own block size (the router's, or none given) ``rng`` draws."""
    clock = ManualClock()
    router = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"}), clock, random.Random(seed))
    for i in range(size):
        router.add_worker(WorkerSpec(id=f"w{i}", address=f"w{i}:1", mode=CacheMode.EVENTS,
                                     capacity_blocks=rng.choice((0, 60, 400)), block_size=rng.choice((0, BS))))
    return router, clock


def decided_alike(router: Router, req: RouteRequest) -> Decision:
    """``req``'s unexplained decision (where a policy's native pass decides), held to its
    explained one (where the policy's Python pass, the reference, prices every worker): the same
    worker, alternative and reason, the estimate to the bit (the same arithmetic), the same
    attributes."""
    quiet, _, _ = router.decide(req, explain=False)
    explained, _, _ = router.decide(req, explain=True)
    assert (quiet.worker_id, quiet.alternative_worker_id, quiet.reason) == (
        explained.worker_id, explained.alternative_worker_id, explained.reason)
    assert quiet.estimated_ttft_ms == explained.estimated_ttft_ms
    assert quiet.attributes == explained.attributes
    return quiet
