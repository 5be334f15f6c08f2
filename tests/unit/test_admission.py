"""Admission queues and DualMap's single-round hotspot migration (A.1.2, A.7)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.admission import AdmissionQueues, Migration, Waiting
from kvrouterd.errors import Conflict, InvalidRequest


def per_token(worker: str, uncached: int, ahead: int, requests: int) -> float:
    """1 ms per prefill token ahead of and including the request."""
    return float(ahead + uncached)


def entry(rid: str, worker: str, alt: str, here: int, there: int, slo: float = 10_000.0,
          at: float = 0.0, deadline: float | None = None) -> Waiting:
    return Waiting(rid, worker, alt, {worker: here, **({alt: there} if alt else {})}, slo, at, deadline)


# ---- admission --------------------------------------------------------------------------
def test_admit_pops_in_fifo_order_up_to_max_inflight() -> None:
    q = AdmissionQueues(max_inflight=3)
    for i in range(5):
        q.enqueue(entry(f"r{i}", "w0", "", 10, 0))
    assert [e.request_id for e in q.admit("w0", inflight=1)] == ["r0", "r1"]
    assert q.admit("w0", inflight=3) == []
    assert [e.request_id for e in q.admit("w0", inflight=0)] == ["r2", "r3", "r4"]
    assert len(q) == 0 and q.admit("w0", 0) == []


def test_cancel_expire_and_drop_worker_remove_waiting_requests() -> None:
    q = AdmissionQueues(max_inflight=1)
    q.enqueue(entry("a", "w0", "", 1, 0, deadline=5.0))
    q.enqueue(entry("b", "w0", "", 1, 0))
    q.enqueue(entry("c", "w1", "", 1, 0, deadline=9.0))
    assert q.cancel("b") is not None and q.cancel("b") is None
    assert [e.request_id for e in q.expire(now=6.0)] == ["a"]
    assert [e.request_id for e in q.drop_worker("w1")] == ["c"]
    assert len(q) == 0


def test_bad_entries_are_refused_without_changing_state() -> None:
    q = AdmissionQueues(max_inflight=2)
    q.enqueue(entry("a", "w0", "", 1, 0))
    with pytest.raises(Conflict):
        q.enqueue(entry("a", "w1", "", 1, 0))
    with pytest.raises(InvalidRequest):
        q.enqueue(Waiting("b", "w0", "w1", {"w0": 1}, 100.0, 0.0))  # no count for the alternative
    with pytest.raises(InvalidRequest):
        AdmissionQueues(max_inflight=0)
    assert len(q) == 1 and q.queue("w1") == ()


# ---- migration --------------------------------------------------------------------------
def _hot_queue(slo: float) -> AdmissionQueues:
    q = AdmissionQueues(max_inflight=1)
    # w0 queue: TTFTs 3000, 6000, 9000, 12000 ms
    q.enqueue(entry("r1", "w0", "w1", 3000, 3000, slo))  # B = 0 on an idle w1: never moved
    q.enqueue(entry("r2", "w0", "w1", 3000, 500, slo))  # B = 5500
    q.enqueue(entry("r3", "w0", "w2", 3000, 3000, slo))  # w2 is busy: 11000 ms there, over the SLO
    q.enqueue(entry("r4", "w0", "w1", 3000, 2000, slo))  # B = 10000
    return q


LOAD = {"w0": (0, 0), "w1": (0, 0), "w2": (8000, 2)}


def test_migration_moves_the_largest_benefit_first_and_stops_once_the_queue_meets_the_slo() -> None:
    q = _hot_queue(slo=10_000)
    plan = q.plan_migration("w0", LOAD, per_token, now=0.0)
    assert plan == [Migration("r4", "w0", "w1", 12_000.0, 2000.0)]
    assert len(q.queue("w0")) == 4  # planning changes nothing

    q = _hot_queue(slo=8000)
    plan = q.plan_migration("w0", LOAD, per_token, now=0.0)
    assert [(m.request_id, m.target) for m in plan] == [("r4", "w1"), ("r2", "w1")]
    # r2 lands behind r4 on w1: 2000 + 500 tokens ahead
    assert plan[1].ttft_target_ms == 2500.0 and plan[1].ttft_source_ms == 6000.0
    moved = q.apply(plan)
    assert [e.request_id for e in q.queue("w0")] == ["r1", "r3"]
    assert [e.request_id for e in q.queue("w1")] == ["r4", "r2"]
    # the pair is kept: the old worker is now the alternative
    assert all(e.worker_id == "w1" and e.alternative_id == "w0" and e.migrations == 1 for e in moved)
    assert q.meets_slo("w0", LOAD, per_token, 0.0)


def test_no_migration_when_the_source_meets_its_slo_or_targets_are_not_allowed() -> None:
    q = _hot_queue(slo=50_000)
    assert q.plan_migration("w0", LOAD, per_token, 0.0) == []
    q = _hot_queue(slo=10_000)
    assert q.plan_migration("w0", LOAD, per_token, 0.0, allowed=lambda w: w != "w1") == []


def test_elapsed_wait_counts_towards_the_slo() -> None:
    q = AdmissionQueues(max_inflight=1)
    q.enqueue(entry("old", "w0", "w1", 100, 100, slo=1000, at=0.0))
    assert q.plan_migration("w0", {"w0": (300, 1)}, per_token, now=0.5) == []  # 500 + 400 ms
    # waited 0.95 s: 1350 ms here, 1050 ms there, both over the SLO: nowhere better to go
    assert q.plan_migration("w0", {"w0": (300, 1)}, per_token, now=0.95) == []
    assert q.plan_migration("w0", {"w0": (300, 1)}, per_token, now=0.8) == [
        Migration("old", "w0", "w1", 1200.0, 900.0)]


def test_stale_plans_are_refused() -> None:
    q = _hot_queue(slo=10_000)
    plan = q.plan_migration("w0", LOAD, per_token, 0.0)
    q.cancel("r4")
    with pytest.raises(Conflict):
        q.apply(plan)
    assert len(q.queue("w0")) == 3


def test_rebalance_over_both_candidates_moves_nothing_twice() -> None:
    q = AdmissionQueues(max_inflight=1)
    for i in range(6):
        q.enqueue(entry(f"a{i}", "wa", "wb", 2000, 1000, slo=5000))
        q.enqueue(entry(f"b{i}", "wb", "wa", 2000, 1000, slo=5000))
    q.enqueue(entry("c", "wa", "wc", 2000, 10, slo=5000))
    load = {"wa": (0, 0), "wb": (0, 0), "wc": (0, 0)}
    plan = q.plan_rebalance(["wa", "wb"], load, per_token, 0.0)
    ids = [m.request_id for m in plan]
    assert len(ids) == len(set(ids)) and "c" in ids
    before = {e.request_id: e.worker_id for w in ("wa", "wb", "wc") for e in q.queue(w)}
    q.apply(plan)
    for m in plan:
        assert before[m.request_id] == m.source and m.benefit_ms > 0 and m.ttft_target_ms < 5000


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 4000), st.sampled_from(["w1", "w2", ""])),
             min_size=1, max_size=12),
    st.integers(0, 6000), st.integers(0, 6000), st.integers(1000, 20_000),
)
def test_migrations_only_move_positive_benefit_requests_under_the_slo(
    reqs: list[tuple[int, int, str]], load1: int, load2: int, slo: int
) -> None:
    q = AdmissionQueues(max_inflight=1)
    for i, (here, there, alt) in enumerate(reqs):
        q.enqueue(entry(f"r{i}", "w0", alt, here, there, slo=slo))
    load = {"w0": (500, 1), "w1": (load1, 1), "w2": (load2, 1)}
    plan = q.plan_migration("w0", load, per_token, now=0.0)
    alts = {f"r{i}": alt for i, (_, _, alt) in enumerate(reqs)}
    assert len({m.request_id for m in plan}) == len(plan)
    for m in plan:
        assert m.source == "w0" and m.target == alts[m.request_id]
        assert m.benefit_ms > 0 and m.ttft_target_ms < slo
    if plan:
        # it stopped as soon as the source met the SLO, not later
        trial = AdmissionQueues(max_inflight=1)
        for i, (here, there, alt) in enumerate(reqs):
            trial.enqueue(entry(f"r{i}", "w0", alt, here, there, slo=slo))
        trial.apply(plan[:-1])
        assert not trial.meets_slo("w0", load, per_token, 0.0)
        # and each target's queue, re-estimated after the moves, keeps the moved requests under the SLO
        q.apply(plan)
        for w in ("w1", "w2"):
            for e, t in q.queue_ttfts(w, load, per_token, 0.0):
                assert t < slo and t == pytest.approx(next(m.ttft_target_ms for m in plan if m.request_id == e.request_id))


def test_a_decode_bottlenecked_worker_sheds_its_queue_to_the_alternatives() -> None:
    from kvrouterd.policies.routing.dualmap import DualMapPolicy

    from .policies.routing.helpers import make_router, prompt, request

    router, clock = make_router({"name": "dualmap", "segment_tokens": 64}, ["a", "b"])
    policy = router.routing_policy()
    assert isinstance(policy, DualMapPolicy)
    home = router.route(request(prompt(1, 128, 0))).worker.id
    other = "b" if home == "a" else "a"
    q = AdmissionQueues(max_inflight=1)

    def fill() -> None:
        for i in range(3):
            q.cancel(f"q{i}")
            q.enqueue(Waiting(f"q{i}", home, other, {home: 64, other: 192}, 3000.0, clock.now()))

    def estimator(w: str, uncached: int, ahead: int, requests: int) -> float:
        return policy.queued_ttft_ms(router.workers.get(w), uncached, ahead, requests, clock.now())

    def load() -> dict[str, tuple[int, int]]:
        return {w.id: (w.pending_prefill_tokens, w.inflight_requests) for w in router.workers}

    fill()
    assert q.plan_migration(home, load(), estimator, clock.now()) == []  # a fast worker meets the SLO
    clock.advance(3.5)  # no prefill completes on home: A.7 adds the 3.5 s stall to its estimates
    fill()  # requests that just arrived
    plan = q.plan_migration(home, load(), estimator, clock.now())
    assert [m.target for m in plan] == [other] * 3
    assert all(m.ttft_source_ms > 3500 and m.ttft_target_ms < 100 for m in plan)


# ---- what the policies see of the queues ------------------------------------------------
def test_queued_tokens_follow_every_change_and_reach_the_host() -> None:
    seen: dict[str, tuple[int, int]] = {}
    q = AdmissionQueues(max_inflight=1, on_change=lambda w, n, t: seen.__setitem__(w, (n, t)))
    q.enqueue(entry("a", "w0", "w1", 100, 40))
    q.enqueue(entry("b", "w0", "w1", 200, 70))
    q.enqueue(entry("c", "w1", "", 5, 0))
    assert seen == {"w0": (2, 300), "w1": (1, 5)} and q.queued_tokens("w0") == 300
    q.apply([Migration("b", "w0", "w1", 9.0, 1.0)])  # counted at the target with its own cost there
    assert seen == {"w0": (1, 100), "w1": (2, 75)}
    assert [e.request_id for e in q.admit("w1", inflight=0)] == ["c"]
    assert seen["w1"] == (1, 70)
    q.cancel("a")
    assert seen["w0"] == (0, 0)
    q.drop_worker("w1")
    assert seen["w1"] == (0, 0) and q.queued_tokens("w1") == 0
    # planning works on a scratch copy: the host hears nothing
    q.enqueue(entry("d", "w0", "w1", 9_000, 10, slo=5_000))
    before = dict(seen)
    q.plan_rebalance(["w0"], {}, per_token, 0.0)
    assert seen == before
