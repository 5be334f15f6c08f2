"""The router core's side of replica sync: remote dispatches and completions by request id."""

from __future__ import annotations

import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.errors import NotFound
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Completion, Dispatch, RouteRequest
from kvrouterd.router import RouteResult, Router, RouterSettings

BS = 4


def replica(clock: ManualClock, mode: CacheMode = CacheMode.EVENTS, capacity: int = 0) -> tuple[Router, list]:
    router = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"}, inflight_timeout_s=10.0),
                    clock, random.Random(1))
    for w in ("w0", "w1"):
        router.add_worker(WorkerSpec(id=w, address=f"{w}:1", mode=mode, capacity_blocks=capacity))
    published: list = []
    router.on_committed = published.append
    router.on_completed = published.append
    return router, published


def as_dispatch(result: RouteResult, router: Router, age: float = 0.0) -> Dispatch:
    entry = router.workers.inflight(result.request.request_id)
    approx = result.worker.mode is CacheMode.APPROXIMATE
    return Dispatch(result.request.request_id, result.worker.id, entry.prefill_tokens if entry else 0,
                    result.request.prompt_tokens, result.decision.overlap_blocks, result.decision.policy,
                    keys=list(result.request.keys) if approx else (), evicted=list(result.evicted) if approx else (),
                    age_s=age)


def route(router: Router, rid: str, tokens: list[int]) -> RouteResult:
    return router.route(RouteRequest(rid, router.keys_for_tokens(tokens), len(tokens)))


def test_remote_dispatch_charges_load_until_a_completion_from_anywhere() -> None:
    clock = ManualClock()
    a, out_a = replica(clock)
    b, out_b = replica(clock)
    result = route(a, "r1", list(range(3 * BS)))
    b.apply_dispatch(as_dispatch(out_a[0], a))
    wb = b.workers.get(result.worker.id)
    assert wb.inflight_requests == 1 and wb.pending_prefill_tokens == 3 * BS
    # the same Dispatch read twice (a resubscribed consumer) charges once
    assert not b.apply_dispatch(as_dispatch(out_a[0], a))
    assert wb.inflight_requests == 1
    # the Complete reaches B: B releases and publishes; A applies B's completion
    entry = b.complete_anywhere(Completion("r1", ttft_ms=5.0))
    assert entry is not None and entry.worker_id == result.worker.id and wb.inflight_requests == 0
    assert out_b == [Completion("r1", ttft_ms=5.0)]
    released = a.apply_completion(out_b[0])
    assert released is not None and a.workers.get(result.worker.id).inflight_requests == 0
    assert len(out_a) == 1  # a completion applied from the bus is not published again
    with pytest.raises(NotFound, match="already completed"):
        a.complete_anywhere(Completion("r1"))


def test_a_dispatch_behind_its_completion_charges_nothing_and_the_id_may_be_routed_again() -> None:
    clock = ManualClock()
    a, out_a = replica(clock)
    b, out_b = replica(clock)
    route(a, "r1", list(range(2 * BS)))
    assert b.complete_anywhere(Completion("r1")) is None  # not known on B yet: accepted, published
    assert out_b == [Completion("r1")]
    assert not b.apply_dispatch(as_dispatch(out_a[0], a))
    assert b.workers.inflight_count == 0 and b.counters["remote_late_dispatches"] == 1
    route(b, "r1", list(range(2 * BS)))  # a caller reusing the id later is charged as usual
    assert b.workers.inflight_count == 1


def test_remote_requests_expire_from_when_they_were_routed() -> None:
    clock = ManualClock(100.0)
    a, out_a = replica(clock)
    b, _ = replica(clock)
    route(a, "old", list(range(BS)))
    b.apply_dispatch(as_dispatch(out_a[0], a, age=8.0))  # read 8 s after it was routed
    clock.advance(2.5)
    assert [e.request_id for e in b.expire_inflight()] == ["old"]
    assert a.expire_inflight() == []
    # remembered completions go after the timeout too
    b.complete_anywhere(Completion("ghost"))
    clock.advance(11.0)
    b.expire_inflight()
    assert b.complete_anywhere(Completion("ghost")) is None


def test_own_dispatches_are_not_charged_twice_and_unknown_workers_are_counted() -> None:
    clock = ManualClock()
    a, out_a = replica(clock)
    route(a, "r1", list(range(BS)))
    assert not a.apply_dispatch(as_dispatch(out_a[0], a), own=True)
    assert a.workers.inflight_count == 1
    assert a.apply_completion(Completion("r1"), own=True) is None and a.workers.inflight_count == 1
    assert not a.apply_dispatch(Dispatch("r2", "gone", 4, 4))
    assert a.counters["remote_unknown_workers"] == 1


def blocks(router: Router) -> dict[str, set[int]]:
    return {w.id: {k for k, _, _ in router.export_blocks(w.id)} for w in router.workers}


def converge(seed: int) -> tuple[Router, Router]:
    """Two replicas route random prompts (few tokens: many shared prefixes, so one replica
    evicts blocks the other just routed to) and read the deltas back in one stream order,
    delivered in random bursts."""
    clock = ManualClock()
    a, out_a = replica(clock, CacheMode.APPROXIMATE, capacity=6)
    b, out_b = replica(clock, CacheMode.APPROXIMATE, capacity=6)
    rng = random.Random(seed)
    stream: list[tuple[str, RouteResult, Router]] = []

    def deliver(count: int) -> None:
        for src, result, router in stream[:count]:
            d = as_dispatch(result, router)
            a.apply_dispatch(d, own=src == "a")
            b.apply_dispatch(d, own=src == "b")
        del stream[:count]

    for i in range(40):
        clock.advance(1.0)
        origin, out, name = (a, out_a, "a") if rng.random() < 0.5 else (b, out_b, "b")
        route(origin, f"q{i}", [rng.randrange(6) for _ in range(rng.randint(1, 4) * BS)])
        stream.append((name, out[-1], origin))
        if rng.random() < 0.3:
            deliver(rng.randint(0, len(stream)))
    deliver(len(stream))
    return a, b


def test_approximate_models_end_on_the_stream_order_of_stores_and_evictions() -> None:
    # without re-applying its own deltas in stream order, a replica that evicted a block the
    # other had just routed to keeps a different view (2 of these 100 runs diverged)
    for seed in range(100):
        a, b = converge(seed)
        assert blocks(a) == blocks(b), seed
    assert a.counters["approx_evicted"] and b.counters["approx_evicted"]


def test_completions_ahead_of_their_dispatch_are_remembered_newest_first_for_the_in_flight_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Complete that overtook its Dispatch keeps that Dispatch from charging, while it is one
    of the newest ``MAX_COMPLETED_IDS`` and younger than ``inflight_timeout_s``; an id past either
    bound charges again, as a new request would."""
    from kvrouterd.router import ledger

    monkeypatch.setattr(ledger, "MAX_COMPLETED_IDS", 3)
    clock = ManualClock()
    router, _ = replica(clock)
    for i in range(5):
        assert router.complete_anywhere(Completion(f"c{i}")) is None  # not in flight here: remembered
        clock.advance(1.0)

    def dispatch(rid: str) -> Dispatch:
        return Dispatch(rid, "w0", BS, BS, 0, "least_loaded")

    assert router.apply_dispatch(dispatch("c0")) and router.apply_dispatch(dispatch("c1"))  # the oldest: gone
    assert not router.apply_dispatch(dispatch("c3")) and not router.apply_dispatch(dispatch("c4"))
    clock.advance(8.5)  # 13.5 s: c2 and c3 completed over inflight_timeout_s (10 s) ago, c4 did not
    router.expire_inflight()
    assert router.apply_dispatch(dispatch("c2")) and router.apply_dispatch(dispatch("c3"))
    assert not router.apply_dispatch(dispatch("c4"))
