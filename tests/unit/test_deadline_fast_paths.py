"""Deadline admission's per-Route shortcuts give what the full computations give.

The guard keeps its per-load-level corrections and its margin worked out ahead,
``on_dispatch`` / ``ahead_ms`` read a worker's books once per call, and ``on_dispatch`` takes
what admission priced before the commit (``price_chosen``) rather than pricing it again. A
random fleet's life (dispatches, first tokens, completions that teach the corrections and the
margin, load reports that re-anchor backlogs, KV caches filling) is checked step by step
against the definitions: any divergence, however small, fails here.
"""

from __future__ import annotations

import math
import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.deadline import _LOAD_LEVELS, DeadlineGuard, Verdict, _load_level, nothing_queued
from kvrouterd.index._walk import MatchResult
from kvrouterd.index.workers import Worker, WorkerSpec
from kvrouterd.policies.base import RoutingContext
from kvrouterd.policies.latency import LatencyParams
from kvrouterd.protocols import CacheMode, Completion, RouteRequest
from kvrouterd.router import Router, RouterSettings

BS = 16
WORKERS = ("a", "b", "c", "d")


def _scale(guard: DeadlineGuard, worker: Worker) -> float:
    """The scale for ``worker`` by its definition: the level's, or the nearest quieter seen one's."""
    return guard._level_value(guard._scales, _load_level(worker))


def _check_corrections(guard: DeadlineGuard, router: Router) -> None:
    for level in range(_LOAD_LEVELS):
        assert guard._levels[level] == (guard._level_value(guard._scales, level), guard._level_value(guard._tails, level))
    for worker in router.workers:
        assert guard._corrections(worker) == (_scale(guard, worker), guard._level_value(guard._tails, _load_level(worker)))
    assert guard.margin == math.exp(guard._log_margin)


def _ahead_by_definition(guard: DeadlineGuard, worker: Worker, now: float, tokens: int) -> float:
    if not worker.inflight_requests:
        return 0.0
    return max(guard.backlog_ms(worker, now), guard.kv_wait_ms(worker, now, tokens) / _scale(guard, worker))


def _verdict_by_definition(guard: DeadlineGuard, ctx: RoutingContext, chosen_id: str, slo_ms: float,
                           queued) -> Verdict:  # type: ignore[no-untyped-def]
    """``check``'s rule worker by worker, through the guard's per-worker functions."""
    predicted = best = math.inf
    budget = slo_ms
    meets = []
    for w in ctx.candidates:
        uncached, cached = ctx.uncached_tokens(w), ctx.overlap(w) * ctx.block_size
        own = guard.prefill_ms(uncached, cached)
        ahead = guard.ahead_ms(w, ctx.now, uncached, queued(w.id))
        scale, tail = guard._corrections(w)
        tail *= guard.margin
        t = (ahead + own) * tail
        allowed = max(slo_ms, own * tail)
        if w.id == chosen_id:
            predicted = (ahead + own) * scale
        if t - allowed < best - budget:
            best, budget = t, allowed
        if t <= allowed:
            meets.append(w.id)
    return Verdict(slo_ms, predicted, best, budget, tuple(meets))


def _check_verdicts(guard: DeadlineGuard, router: Router, rng: random.Random, now: float) -> None:
    """``check``, whose loop has ``ahead_ms`` and the rest written out, against its definition:
    cached and speculative prefixes, router queues or none, several SLOs."""
    tokens = rng.randrange(1, 60) * BS
    req = RouteRequest("probe", list(range(1, tokens // BS + 1)), tokens)
    candidates = sorted(router.workers, key=lambda w: w.slot)
    overlaps = {w.slot: rng.randrange(0, tokens // BS + 1) for w in candidates if rng.random() < 0.7}
    # speculative blocks in half the probes (a worker holding none of the prompt then takes the short way)
    claimed = {slot: rng.randrange(0, n + 1) for slot, n in overlaps.items() if rng.random() < 0.3} if rng.random() < 0.5 else {}
    ctx = RoutingContext(req, candidates, MatchResult({k: v for k, v in overlaps.items() if v}, []), BS, now,
                         router.index, False, claimed)
    waiting = {w.id: (rng.randrange(0, 3), rng.choice((0, 0, 200, 3_000))) for w in candidates}
    for queued in (nothing_queued, waiting.__getitem__):
        for slo_ms in (50.0, 500.0, 5_000.0):
            chosen = rng.choice(candidates).id
            assert guard.check(ctx, chosen, slo_ms, queued) == _verdict_by_definition(guard, ctx, chosen, slo_ms, queued)


@pytest.mark.parametrize("seed", range(4))
def test_dispatch_predictions_backlogs_and_corrections_match_their_definitions(seed: int) -> None:
    rng = random.Random(seed)
    clock = ManualClock()
    router = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"}), clock, random.Random(seed))
    for wid in WORKERS:
        router.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", mode=CacheMode.EVENTS, capacity_blocks=400))
    guard = DeadlineGuard("shed", LatencyParams(prefill_ms_per_1k_tokens=40.0, calibrate=False), 0.9, BS)
    in_flight: list[str] = []
    learned = 0
    for step in range(1_500):
        clock.advance(rng.choice((0.0, 0.0005, 0.003, 0.02)))
        now = clock.now()
        roll = rng.random()
        if roll < 0.45 or not in_flight:
            tokens = rng.randrange(1, 60) * BS
            rid = f"r{step}"
            req = RouteRequest(rid, list(range(1, tokens // BS + 1)), tokens)
            req.candidate_workers = (rng.choice(WORKERS),)
            decision, ctx, policy = router.decide(req, explain=False)
            worker = router.workers.get(decision.worker_id)
            # half the dispatches take what admission priced before the commit, as the daemon's do
            priced = guard.price_chosen(ctx, worker, math.inf) if rng.random() < 0.5 else None
            router.commit(decision, ctx, policy)
            if priced is not None:
                uncached, cached = ctx.uncached_tokens(worker), ctx.overlap(worker) * BS
            else:
                uncached, cached = tokens - BS, BS
            if worker.inflight_requests <= 1:
                predicted = backlog = guard.prefill_ms(uncached, cached)
            else:
                own = guard.prefill_ms(uncached, cached)
                predicted = _ahead_by_definition(guard, worker, now, uncached) + own
                backlog = guard.backlog_ms(worker, now) + own
            assert guard.ahead_ms(worker, now, uncached) == _ahead_by_definition(guard, worker, now, uncached)
            guard.on_dispatch(worker, rid, uncached, now, cached, priced)
            assert guard._predicted[rid][0] == predicted
            assert guard._backlog[worker.id] == (backlog, now)
            guard.on_admitted(rid, rng.choice((200.0, 2_000.0)), now)
            in_flight.append(rid)
        elif roll < 0.6:
            guard.on_first_token(rng.choice(in_flight), rng.uniform(1.0, 3_000.0), now)
        elif roll < 0.85:
            rid = in_flight.pop(rng.randrange(len(in_flight)))
            ttft = rng.uniform(1.0, 5_000.0)
            router.complete(Completion(rid, ttft_ms=ttft, e2e_ms=ttft + rng.uniform(1.0, 20_000.0)))
            before = guard._samples[:]
            guard.on_complete(rid, ttft, now, ttft + rng.uniform(1.0, 20_000.0))
            learned += guard._samples != before
        else:
            wid = rng.choice(WORKERS)
            router.report_load(wid, rng.randrange(0, 4), rng.choice((0, 1, 3, 9, 40, 200)), rng.choice((0.0, 0.5, 0.97, 1.0)))
        _check_corrections(guard, router)
        if step % 5 == 0:
            _check_verdicts(guard, router, rng, now)
    # the run did exercise what the shortcuts cache: samples at several levels, a moving margin
    assert learned > 50 and sum(1 for n in guard._samples if n) >= 3 and guard._log_margin > 0.0
