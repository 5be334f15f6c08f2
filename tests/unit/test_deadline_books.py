"""Deadline admission's books, one Route at a time: the native passes keep them as the reference.

Every Route that deadline admission admits is priced on its worker and recorded as admitted
(``admit_chosen``, or ``price_chosen`` and ``on_admitted``), then dispatched there
(``on_dispatch``), and every Complete leaves the books (``on_complete``). Where the extension is
built those are ``deadline_admit``, ``deadline_price``, ``deadline_dispatch`` and
``deadline_complete`` (``index/_native.c``), and ``_admit_py``, ``_price_py``, ``_dispatch_py``
and ``_complete_py`` are their references. Two guards over one random fleet's life, one driven
through each, must answer alike and keep equal books (backlogs, flights in order, predictions,
judged requests, learned corrections, margin, decode time) after every step: Routes priced before
their commit as the admission gate does, with admission's pricing handed on, stale or absent;
first tokens, Completes that teach and ones that do not, load reports that re-anchor, expiries,
and the tracked requests overflowing. Also what the native passes decline, and what they raise.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest

from kvrouterd import deadline
from kvrouterd.bounds import MAX_LATENCY_MS
from kvrouterd.deadline import DeadlineGuard, nothing_queued
from kvrouterd.index import native
from kvrouterd.policies.base import NONE_CLAIMED, RoutingContext
from kvrouterd.policies.latency import LatencyParams
from kvrouterd.protocols import Completion, RouteRequest

from .policies.fleets import BS, deadline_fleet

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

WORKERS = 12
PROMPT_BLOCKS = 40


def books(guard: DeadlineGuard) -> tuple[Any, ...]:
    """Everything the guard keeps between calls, orders included."""
    return (dict(guard._backlog), list(guard._predicted.items()), list(guard._judged.items()),
            {wid: list(flight.items()) for wid, flight in guard._flight.items()}, list(guard._where.items()),
            dict(guard._waiting_tokens), dict(guard._waiting_count), dict(guard._anchored), list(guard._levels),
            list(guard._scales), list(guard._tails), list(guard._samples), guard._log_margin, guard._margin,
            guard.hold_ms, guard._hold_sq_ms, guard._last_prefill)


class _Twins:
    """A router and two deadline guards watching it: ``native`` moved by the native passes,
    ``python`` by their references, one random step at a time."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.router, self.clock = deadline_fleet(seed, WORKERS, self.rng)
        params = LatencyParams(prefill_ms_per_1k_tokens=300.0, calibrate=False)
        self.native = DeadlineGuard("shed", params, 0.9, BS)
        self.python = DeadlineGuard("shed", params, 0.9, BS)
        self.in_flight: list[str] = []
        self.keys = list(range(1, PROMPT_BLOCKS + 1))
        self.seen = {"admit": 0, "priced": 0, "shed": 0, "handed_on": 0, "stale": 0, "kv": 0, "learned": 0, "margin": 0,
                     "anchored": 0, "complete": 0}

    def step(self, n: int) -> None:
        rng, router = self.rng, self.router
        self.clock.advance(rng.choice((0.0, 0.0005, 0.003, 0.02, 0.2)))
        now = self.clock.now()
        roll = rng.random()
        if roll < 0.45 or not self.in_flight:
            self._route(f"r{n}", now)
        elif roll < 0.55:
            rid, ttft = rng.choice(self.in_flight), rng.uniform(1.0, 3_000.0)
            for guard in (self.native, self.python):
                guard.on_first_token(rid, ttft, now)
        elif roll < 0.8:
            self._complete(now)
        elif roll < 0.9:
            worker = router.workers.get(f"w{rng.randrange(WORKERS)}")
            anchoring = worker.inflight_requests > 0
            router.report_load(worker.id, rng.randrange(0, 4), rng.choice((0, 1, 3, 9, 40, 200)),
                               rng.choice((0.0, 0.5, 0.97, 1.0)))
            self.seen["anchored"] += anchoring
        elif roll < 0.95 and self.in_flight:
            rid = self.in_flight.pop(rng.randrange(len(self.in_flight)))
            router.complete(Completion(rid))
            for guard in (self.native, self.python):
                guard.on_expired(rid)
        else:
            worker = router.workers.get(f"w{rng.randrange(WORKERS)}")
            router.index.store(worker.slot, None, self.keys[:rng.randrange(1, PROMPT_BLOCKS)], now)

    def _route(self, rid: str, now: float) -> None:
        """Priced before its commit and dispatched after it, as the admission gate runs a Route."""
        rng, router = self.rng, self.router
        tokens = rng.randrange(1, PROMPT_BLOCKS) * BS
        req = RouteRequest(rid, self.keys[:tokens // BS], tokens)
        decision, ctx, policy = router.decide(req, explain=False)
        worker = router.workers.get(decision.worker_id)
        uncached, cached = ctx.uncached_tokens(worker), ctx.overlap(worker) * BS
        slo_ms = rng.choice((20.0, 300.0, 3_000.0))
        if rng.random() < 0.5:  # priced and recorded as admitted in one pass (admit_chosen)
            admitted = ctx
            if rng.random() < 0.3:  # some of its prompt claimed there by speculative blocks
                admitted = RoutingContext(req, ctx.candidates, ctx.match, BS, now, ctx.index, False,
                                          {worker.slot: rng.randrange(0, 3), 99: 1}, ctx.candidate_slots)
            name = rng.choice((rid, ""))  # an unnamed request is priced, not recorded
            priced = native.module.deadline_admit(self.native, admitted, worker, name, slo_ms, NONE_CLAIMED)
            assert priced == self.python._admit_py(admitted, worker, name, slo_ms)
            self.seen["admit"] += 1
        else:
            priced = native.module.deadline_price(self.native, worker, uncached, cached, now, slo_ms)
            assert priced == self.python._price_py(worker, uncached, cached, now, slo_ms, nothing_queued)
            if priced is not None and rng.random() < 0.7:
                for guard in (self.native, self.python):
                    guard.on_admitted(rid, slo_ms, now)
        self.seen["priced" if priced is not None else "shed"] += 1
        self.seen["kv"] += self.native.hold_ms > 0 and worker.inflight_requests > 0
        router.commit(decision, ctx, policy)
        handed = rng.random()
        if handed < 0.6:  # what admission priced, as the gate hands it on
            self.seen["handed_on"] += priced is not None and worker.inflight_requests > 1
        elif handed < 0.8 and priced is not None:  # priced in another step: not what is dispatched now
            priced = (priced[0], priced[1] - 1.0, *priced[2:])
            self.seen["stale"] += 1
        else:
            priced = None
        assert native.module.deadline_dispatch(self.native, worker, rid, uncached, now, cached, priced) is None
        self.python._dispatch_py(worker, rid, uncached, now, cached, priced)
        self.in_flight.append(rid)

    def _complete(self, now: float) -> None:
        rng = self.rng
        rid = self.in_flight.pop(rng.randrange(len(self.in_flight))) if rng.random() < 0.95 else "never-routed"
        ttft = rng.choice((0.0, rng.uniform(1.0, 5_000.0), rng.uniform(1.0, 5_000.0), MAX_LATENCY_MS * 2))
        e2e = rng.choice((0.0, ttft + rng.uniform(0.0, 20_000.0), ttft + 0.5))
        heard_at: float | None = now if rng.random() < 0.9 else None
        if rid != "never-routed":
            self.router.complete(Completion(rid))  # the guard hears its times (out of range too)
        samples, margin = sum(self.python._samples), self.python._log_margin
        assert native.module.deadline_complete(self.native, rid, ttft, heard_at, e2e) is None
        self.python._complete_py(rid, ttft, heard_at, e2e)
        self.seen["complete"] += 1
        self.seen["learned"] += sum(self.python._samples) > samples
        self.seen["margin"] += self.python._log_margin != margin


@pytest.mark.parametrize("seed", range(4))
def test_native_books_are_the_references(seed: int) -> None:
    twins = _Twins(seed)
    for n in range(1_500):
        twins.step(n)
        assert books(twins.native) == books(twins.python), f"step {n}"
    seen = twins.seen
    # the life reached every branch the passes take
    assert seen["admit"] > 200 and seen["priced"] > 100 and seen["shed"] > 10 and seen["handed_on"] > 50 and seen["stale"] > 20
    assert seen["kv"] > 50 and seen["learned"] > 10 and seen["margin"] > 10 and seen["anchored"] > 20


@pytest.fixture
def few_tracked(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Both sides forget the oldest tracked requests past 5 of them."""
    limit, tracked = 5, deadline._MAX_TRACKED

    def hand_over(max_tracked: int) -> None:
        native.module.deadline_constants(deadline._SCALE_WEIGHT, deadline._LOG_SCALE_RANGE, deadline._TAIL_STEP,
                                         deadline._MARGIN_STEP, deadline._HOLD_WEIGHT, deadline._MIN_SAMPLE_MS,
                                         MAX_LATENCY_MS, max_tracked, deadline._LOAD_LEVELS)

    monkeypatch.setattr(deadline, "_MAX_TRACKED", limit)
    hand_over(limit)
    try:
        yield limit
    finally:
        hand_over(tracked)


def test_native_books_forget_the_oldest_as_the_reference_does(few_tracked: int) -> None:
    twins = _Twins(21)
    for n in range(60):
        twins._route(f"r{n}", twins.clock.now())
        assert books(twins.native) == books(twins.python)
    assert len(twins.native._predicted) == few_tracked and len(twins.native._where) == few_tracked
    assert list(twins.native._predicted) == [f"r{n}" for n in range(55, 60)]


def test_guard_methods_take_the_reference_where_the_native_passes_decline() -> None:
    twins = _Twins(5)
    for n in range(300):
        twins.step(n)
    worker = twins.router.workers.get("w0")
    for guard in (twins.native, twins.python):
        guard._predicted = dict(guard._predicted)  # not the OrderedDict the passes keep
    before = books(twins.native)
    assert native.module.deadline_dispatch(twins.native, worker, "x", 32, twins.clock.now(), 0, None) is NotImplemented
    assert native.module.deadline_complete(twins.native, twins.in_flight[0], 100.0, twins.clock.now(),
                                           200.0) is NotImplemented
    assert books(twins.native) == before  # a decline writes nothing
    # through the guard's own methods (the reference, then) both stay alike
    twins.native.on_dispatch(worker, "x", 32, twins.clock.now(), 0)
    twins.python._dispatch_py(worker, "x", 32, twins.clock.now(), 0, None)
    twins.native.on_complete(twins.in_flight[0], 100.0, twins.clock.now(), 200.0)
    twins.python._complete_py(twins.in_flight[0], 100.0, twins.clock.now(), 200.0)
    assert books(twins.native) == books(twins.python)
    # a load level that is an int but not exactly one
    worker.reported_running = True
    assert native.module.deadline_price(twins.native, worker, 32, 0, twins.clock.now(), 300.0) is NotImplemented
    worker.reported_running = 1
    assert native.module.deadline_price(twins.native, worker, 32, 0, "now", 300.0) is NotImplemented
    # claims in a mapping that is not a dict, and judged requests not in an OrderedDict
    req = RouteRequest("y", twins.keys[:8], 8 * BS)
    _, ctx, _ = twins.router.decide(req, explain=False)
    claimed = RoutingContext(req, ctx.candidates, ctx.match, BS, ctx.now, ctx.index, False,
                             MappingProxyType({worker.slot: 1}), ctx.candidate_slots)
    before = books(twins.native)
    assert native.module.deadline_admit(twins.native, claimed, worker, "y", 300.0, NONE_CLAIMED) is NotImplemented
    twins.native._judged = dict(twins.native._judged)
    assert native.module.deadline_admit(twins.native, ctx, worker, "y", 300.0, NONE_CLAIMED) is NotImplemented
    assert books(twins.native) == before
    assert twins.native.admit_chosen(ctx, worker, "y", 300.0) == twins.python._admit_py(ctx, worker, "y", 300.0)
    assert books(twins.native) == books(twins.python)


def test_native_dispatch_raises_what_pricing_raises_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    twins = _Twins(9)
    for n in range(200):
        twins.step(n)
    guard = twins.native
    worker = twins.router.workers.get("w3")

    def broken(self: DeadlineGuard, uncached: int, cached: int = 0) -> float:
        raise RuntimeError("latency model unreadable")

    monkeypatch.setattr(DeadlineGuard, "prefill_ms", broken)  # a guard keeps no attribute of its own
    before = books(guard)
    with pytest.raises(RuntimeError, match="latency model unreadable"):
        native.module.deadline_dispatch(guard, worker, "y", 12_345, twins.clock.now(), 7, None)
    assert books(guard) == before


class ObservedGuard(DeadlineGuard):
    """A guard whose margin is a property: the native passes find no member for it in this class
    and must read it the generic way, while they read the base class's from its member."""

    __slots__ = ("_kept_margin", "margin_reads")

    @property  # type: ignore[override]
    def _margin(self) -> float:
        self.margin_reads += 1
        return self._kept_margin

    @_margin.setter
    def _margin(self, value: float) -> None:
        self._kept_margin = value


def test_each_class_is_read_where_it_keeps_its_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    twins = _Twins(13)
    for n in range(300):
        twins.step(n)
    observed = ObservedGuard("shed", twins.native.latency.params, 0.9, BS)
    observed.margin_reads = 0
    for name in DeadlineGuard.__slots__:
        setattr(observed, name, copy.deepcopy(getattr(twins.python, name)))
    DeadlineGuard._margin.__set__(observed, 99.0)  # the base class's member, hidden by the property: never read
    busy = [w for w in twins.router.workers if w.inflight_requests > 1]
    assert busy
    now, sheds = twins.clock.now(), 0
    for i in range(60):  # the two classes alternate through the passes' cache of where attributes are
        worker = busy[i % len(busy)]
        uncached, slo_ms = 64 * (1 + i % 5), 20.0 * 3.0 ** (i % 7)
        want = twins.python._price_py(worker, uncached, 0, now, slo_ms, nothing_queued)
        assert native.module.deadline_price(twins.native, worker, uncached, 0, now, slo_ms) == want
        assert native.module.deadline_price(observed, worker, uncached, 0, now, slo_ms) == want
        sheds += want is None
        if i == 20:  # a class changed since it was read has its places found again
            monkeypatch.setattr(DeadlineGuard, "_unused_marker", 1, raising=False)
    assert observed.margin_reads > 0 and sheds
    assert books(twins.native) == books(twins.python) == books(observed)
