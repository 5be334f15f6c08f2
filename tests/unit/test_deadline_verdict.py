"""Deadline admission's price of every eligible worker: the native pass answers as its reference.

Past capacity every Route's chosen worker misses its SLO, so ``DeadlineGuard.check`` prices
every eligible worker. Where the extension is built that pass is ``deadline_verdict``
(``index/_native.c``); ``DeadlineGuard._verdict_py`` is its reference. They are held to
identical answers over a random fleet's life: real Workers of a Router (their loads kept by
slot), cached prefixes from a real match walk and as a dict, speculative claims, router queues,
load reports that re-anchor backlogs in the middle of a pass, and the KV turnover wait once
Completes have taught the decode time. Also what the native pass declines, and what it raises.
"""

from __future__ import annotations

import random
from types import MappingProxyType
from typing import Any

import pytest

from kvrouterd.deadline import DeadlineGuard, nothing_queued
from kvrouterd.index import native
from kvrouterd.policies.base import RoutingContext
from kvrouterd.policies.latency import LatencyParams
from kvrouterd.protocols import Completion, RouteRequest

from .policies.fleets import BS, deadline_fleet

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

WORKERS = 24
PROMPT_BLOCKS = 40


class _Fleet:
    """A router, its deadline guard, and the requests in flight, moved one random step at a time."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.router, self.clock = deadline_fleet(seed, WORKERS, self.rng)
        self.guard = DeadlineGuard("shed", LatencyParams(prefill_ms_per_1k_tokens=40.0, calibrate=False), 0.9, BS)
        self.in_flight: list[str] = []
        self.keys = list(range(1, PROMPT_BLOCKS + 1))
        self.anchored_in_a_pass = 0

    @classmethod
    def after(cls, seed: int, steps: int) -> _Fleet:
        """A fleet ``steps`` random steps into its life."""
        fleet = cls(seed)
        for n in range(steps):
            fleet.step(n)
        return fleet

    def step(self, n: int) -> None:
        rng, router, guard = self.rng, self.router, self.guard
        self.clock.advance(rng.choice((0.0, 0.0005, 0.003, 0.02)))
        now = self.clock.now()
        roll = rng.random()
        if roll < 0.45 or not self.in_flight:
            tokens = rng.randrange(1, PROMPT_BLOCKS) * BS
            rid = f"r{n}"
            req = RouteRequest(rid, self.keys[:tokens // BS], tokens)
            req.candidate_workers = (f"w{rng.randrange(WORKERS)}",)
            decision, ctx, policy = router.decide(req, explain=False)
            worker = router.workers.get(decision.worker_id)
            router.commit(decision, ctx, policy)
            guard.on_dispatch(worker, rid, ctx.uncached_tokens(worker), now, ctx.overlap(worker) * BS)
            self.in_flight.append(rid)
        elif roll < 0.55:
            guard.on_first_token(rng.choice(self.in_flight), rng.uniform(1.0, 3_000.0), now)
        elif roll < 0.8:
            rid = self.in_flight.pop(rng.randrange(len(self.in_flight)))
            ttft = rng.uniform(1.0, 5_000.0)
            e2e = ttft + rng.uniform(1.0, 20_000.0)
            router.complete(Completion(rid, ttft_ms=ttft, e2e_ms=e2e))
            guard.on_complete(rid, ttft, now, e2e)  # teaches the decode time: the KV wait is modelled
        elif roll < 0.9:
            router.report_load(f"w{rng.randrange(WORKERS)}", rng.randrange(0, 4), rng.choice((0, 1, 3, 9, 40, 200)),
                               rng.choice((0.0, 0.5, 0.97, 1.0)))
        else:  # a worker caches a prefix of the prompt (what the match walk then finds)
            worker = router.workers.get(f"w{rng.randrange(WORKERS)}")
            router.index.store(worker.slot, None, self.keys[:rng.randrange(1, PROMPT_BLOCKS)], now)

    def probe(self) -> tuple[RoutingContext, dict[str, tuple[int, int]]]:
        """A Route's context over every worker (the walk's Overlaps), with or without speculative
        claims, and a router queue per worker."""
        rng = self.rng
        tokens = rng.randrange(1, PROMPT_BLOCKS) * BS
        req = RouteRequest("probe", self.keys[:tokens // BS], tokens)
        candidates = sorted(self.router.workers, key=lambda w: w.slot)
        match = self.router.index.match(req.keys, sum(w.bit for w in candidates))
        claimed = ({slot: rng.randrange(0, n + 1) for slot, n in match.overlaps.items() if rng.random() < 0.3}
                   if rng.random() < 0.5 else {})
        ctx = RoutingContext(req, candidates, match, BS, self.clock.now(), self.router.index, False, claimed)
        waiting = {w.id: (rng.randrange(0, 3), rng.choice((0, 0, 200, 3_000))) for w in candidates}
        return ctx, waiting

    def anchors_pending(self) -> int:
        """Workers whose books a pass would re-anchor (a load report came since they were)."""
        return sum(1 for w in self.router.workers
                   if w.inflight_requests and w.reported_at > self.guard._anchored.get(w.id, 0.0))


@pytest.mark.parametrize("seed", range(3))
def test_native_verdict_answers_as_the_reference(seed: int) -> None:
    fleet = _Fleet(seed)
    guard = fleet.guard
    compared = kv_modelled = anchored = split = 0
    for n in range(1_200):
        fleet.step(n)
        if n % 6:
            continue
        ctx, waiting = fleet.probe()
        for queued in (nothing_queued, waiting.__getitem__):
            for slo_ms in (50.0, 500.0, 5_000.0):
                chosen = fleet.rng.choice(ctx.candidates).id
                pending = fleet.anchors_pending()
                # which goes first alternates: the first re-anchors what a load report moved
                # (mid-pass, before that worker's backlog is read), the second finds it anchored
                native_first = fleet.rng.random() < 0.5
                answers: dict[str, Any] = {}
                for which in (("native", "python") if native_first else ("python", "native")):
                    args = guard._verdict_args(ctx, chosen, slo_ms, queued)
                    answers[which] = (native.module.deadline_verdict(*args) if which == "native"
                                      else guard._verdict_py(*args))
                assert answers["native"] == answers["python"]
                # the walk's Overlaps, and the same prefixes as a dict
                args = guard._verdict_args(ctx, chosen, slo_ms, queued)
                as_dict = (args[0], dict(args[1].items()), *args[2:])
                assert native.module.deadline_verdict(*as_dict) == guard._verdict_py(*args)
                compared += 1
                kv_modelled += guard.hold_ms > 0
                anchored += pending > 0
                meets = answers["native"][3]
                split += 0 < len(meets) < len(ctx.candidates)
    # the life reached what the pass reads: the KV model, re-anchoring, workers on both sides of the SLO
    assert compared > 1_000 and kv_modelled > compared // 2 and anchored > 20 and split > 50


class _Viewed:
    """A Worker seen through properties: the native pass reads each through the generic lookup,
    where it reads a Worker's members in place."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker

    def __getattr__(self, name: str) -> Any:  # what the guard's anchoring reads besides
        return getattr(self._worker, name)

    id = property(lambda self: self._worker.id)
    slot = property(lambda self: self._worker.slot)
    reported_running = property(lambda self: self._worker.reported_running)
    reported_at = property(lambda self: self._worker.reported_at)
    inflight_requests = property(lambda self: self._worker.inflight_requests)
    kv_utilization = property(lambda self: self._worker.kv_utilization)
    spec = property(lambda self: self._worker.spec)


def test_native_verdict_reads_other_classes_as_the_reference_does() -> None:
    """Candidates of two classes in turn (Workers, and Workers behind properties): each class's
    attributes are found again where the class changes."""
    fleet = _Fleet(11)
    guard = fleet.guard
    compared = 0
    for n in range(900):
        fleet.step(n)
        if n % 9:
            continue
        ctx, waiting = fleet.probe()
        mixed = [_Viewed(w) if i % 3 else w for i, w in enumerate(ctx.candidates)]
        viewed = RoutingContext(ctx.request, mixed, ctx.match, BS, ctx.now, ctx.index, False, ctx.claimed)
        for queued in (nothing_queued, waiting.__getitem__):
            chosen = fleet.rng.choice(ctx.candidates).id
            native_answer = native.module.deadline_verdict(*guard._verdict_args(viewed, chosen, 500.0, queued))
            assert native_answer == guard._verdict_py(*guard._verdict_args(ctx, chosen, 500.0, queued))
            compared += 1
    assert compared > 150 and guard.hold_ms > 0


def _assert_check_is_the_reference(guard: DeadlineGuard, ctx: RoutingContext, chosen: str, queued: Any) -> None:
    verdict = guard.check(ctx, chosen, 500.0, queued)
    want = guard._verdict_py(*guard._verdict_args(ctx, chosen, 500.0, queued))
    assert (verdict.predicted_ms, verdict.best_ms, verdict.budget_ms, list(verdict.meets)) == want


def test_check_takes_the_reference_where_the_native_pass_declines() -> None:
    fleet = _Fleet.after(7, 400)
    guard = fleet.guard
    ctx, waiting = fleet.probe()
    chosen = ctx.candidates[0].id
    # a load level that is an int but not exactly one (the native pass reads exact ints only)
    ctx.candidates[3].reported_running = True
    args = guard._verdict_args(ctx, chosen, 500.0, waiting.__getitem__)
    assert native.module.deadline_verdict(*args) is NotImplemented
    _assert_check_is_the_reference(guard, ctx, chosen, waiting.__getitem__)
    # a load level with no magnitude in 64 bits (Python reads its bit length, 64)
    ctx.candidates[3].reported_running = -(2**63)
    args = guard._verdict_args(ctx, chosen, 500.0, waiting.__getitem__)
    assert native.module.deadline_verdict(*args) is NotImplemented
    _assert_check_is_the_reference(guard, ctx, chosen, waiting.__getitem__)
    ctx.candidates[3].reported_running = 1
    # speculative claims in a mapping that is not a dict
    slot = ctx.candidates[1].slot
    claimed = RoutingContext(ctx.request, ctx.candidates, ctx.match, BS, ctx.now, ctx.index, False,
                             MappingProxyType({slot: 1}))
    args = guard._verdict_args(claimed, chosen, 500.0, nothing_queued)
    assert native.module.deadline_verdict(*args) is NotImplemented
    _assert_check_is_the_reference(guard, claimed, chosen, nothing_queued)


def test_native_verdict_raises_what_its_callbacks_raise_and_survives_a_shrinking_list() -> None:
    fleet = _Fleet.after(3, 300)
    guard = fleet.guard
    ctx, _ = fleet.probe()

    def full_queue(worker_id: str) -> tuple[int, int]:
        raise RuntimeError(f"queue of {worker_id} unreadable")

    args = list(guard._verdict_args(ctx, ctx.candidates[0].id, 500.0, full_queue))
    with pytest.raises(RuntimeError, match="queue of w"):
        native.module.deadline_verdict(*args)
    # a callback that empties the candidate list ends the pass where a Python loop would end it
    for which in ("native", "python"):
        candidates = list(ctx.candidates)
        emptied = RoutingContext(ctx.request, candidates, ctx.match, BS, ctx.now, ctx.index, False, ctx.claimed)

        def emptying_queue(worker_id: str, candidates: list[Any] = candidates) -> tuple[int, int]:
            del candidates[:]
            return (0, 0)

        args = list(guard._verdict_args(emptied, ctx.candidates[0].id, 500.0, emptying_queue))
        got = native.module.deadline_verdict(*args) if which == "native" else guard._verdict_py(*args)
        assert len(got[3]) <= 1 and not candidates
