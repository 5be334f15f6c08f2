"""Deadline admission (kvrouterd.deadline): shed what cannot meet its SLO anywhere, leave the rest."""

from __future__ import annotations

import math
import random

import pytest

from kvrouterd.admission import AdmissionQueues, Waiting
from kvrouterd.clock import ManualClock
from kvrouterd.bounds import MAX_LATENCY_MS
from kvrouterd.deadline import MIN_RETRY_AFTER_MS, DeadlineGuard, admit_priced
from kvrouterd.errors import ConfigError, Overloaded, SloUnreachable
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.latency import LatencyParams
from kvrouterd.protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings
from kvrouterd.router.ledger import request_bytes

BS = 16
SLO = 5_000.0
#: 1 ms per prefill token, fixed: predictions are token counts
MS_PER_TOKEN = LatencyParams(prefill_ms_per_1k_tokens=1000.0, calibrate=False)


def admit_by_deadline(*args, **kwargs):  # type: ignore[no-untyped-def]
    """``admit_priced``'s decision alone: what these tests check."""
    return admit_priced(*args, **kwargs)[0]


def fleet(*workers: str) -> tuple[Router, DeadlineGuard, ManualClock]:
    clock = ManualClock()
    router = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"}), clock, random.Random(0))
    for wid in workers:
        router.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", mode=CacheMode.EVENTS))
    return router, DeadlineGuard("shed", MS_PER_TOKEN), clock


def request(rid: str, tokens: int, slo: float = SLO) -> RouteRequest:
    return RouteRequest(rid, list(range(1, tokens // BS + 1)), tokens, ttft_slo_ms=slo)


def load(router: Router, guard: DeadlineGuard, worker: str, tokens: int, rid: str) -> None:
    """Commit ``tokens`` of prefill to ``worker`` (as the host does: route, then tell the guard)."""
    req = request(rid, tokens)
    req.candidate_workers = (worker,)
    result = router.route(req, explain=False)
    guard.on_dispatch(result.worker, rid, tokens, router.clock.now())


def test_a_request_predicted_to_miss_its_slo_everywhere_is_shed_with_a_retry_hint() -> None:
    router, guard, _ = fleet("a", "b")
    load(router, guard, "a", 4_000, "busy-a")
    load(router, guard, "b", 6_000, "busy-b")
    req = request("late", 2_000)
    with pytest.raises(SloUnreachable) as err:
        admit_by_deadline(guard, router, req, router.decide(req), SLO)
    # best worker a: 4,000 pending + 2,000 own = 6,000 ms against 5,000
    assert isinstance(err.value, Overloaded)
    assert err.value.predicted_ms == pytest.approx(6_000) and err.value.slo_ms == SLO
    assert err.value.retry_after_ms == pytest.approx(1_000)
    assert "predicted TTFT 6,000 ms" in str(err.value) and "5,000 ms SLO" in str(err.value)
    assert guard.shed == 1 and router.request("late") is None  # nothing was committed


def test_admitted_requests_keep_their_decision() -> None:
    router, guard, _ = fleet("a", "b")
    load(router, guard, "a", 1_000, "busy-a")
    req = request("fits", 2_000)
    decided = router.decide(req)
    assert admit_by_deadline(guard, router, req, decided, SLO) is decided
    assert guard.shed == guard.rerouted == 0 and req.candidate_workers == ()


def test_a_worker_that_would_miss_is_traded_for_one_that_meets_the_slo() -> None:
    router, guard, _ = fleet("a", "b")
    load(router, guard, "b", 4_500, "busy-b")
    req = request("moved", 2_000)
    req.candidate_workers = ("a", "b")
    decision, ctx, _ = router.decide(req)
    verdict = guard.check(ctx, "b", SLO)  # as if the policy had chosen the busy one
    assert verdict.meets == ("a",) and verdict.predicted_ms == pytest.approx(6_500)


def test_router_queues_count_in_the_prediction() -> None:
    router, guard, _ = fleet("a")
    req = request("queued", 2_000)
    decision, ctx, _ = router.decide(req)
    assert guard.check(ctx, "a", SLO, lambda w: (3, 3_500)).shed
    assert not guard.check(ctx, "a", SLO, lambda w: (1, 2_500)).shed


def test_a_prompt_no_idle_worker_could_serve_in_time_is_held_to_its_own_prefill_time() -> None:
    router, guard, _ = fleet("a", "b")
    req = request("huge", 8_000)  # 8 s of prefill against a 5 s SLO, on any worker
    decided = router.decide(req)
    assert admit_by_deadline(guard, router, req, decided, SLO) is decided  # idle: served
    load(router, guard, "a", 6_000, "busy-a")
    req = request("huge", 8_000)
    req.candidate_workers = ("a", "b")
    decision, ctx, _ = router.decide(req)
    assert guard.check(ctx, "a", SLO).meets == ("b",)  # where it starts at once
    load(router, guard, "b", 1_000, "busy-b")
    with pytest.raises(SloUnreachable) as err:
        admit_by_deadline(guard, router, req, router.decide(req), SLO)
    # best: b, 1 s of wait ahead of 8 s of prefill
    assert err.value.retry_after_ms == pytest.approx(1_000) and "8,000 ms its prefill takes" in str(err.value)


def test_observed_ttft_corrects_the_prediction() -> None:
    router, guard, clock = fleet("a")
    for i in range(200):  # the engine takes twice what the model says
        load(router, guard, "a", 1_000, f"r{i}")
        guard.on_complete(f"r{i}", 2_000.0)
        router.complete(Completion(f"r{i}", 2_000.0, 2_000.0))
        clock.advance(100.0)  # the backlog drains
    assert guard.scale == pytest.approx(2.0, rel=0.01)
    load(router, guard, "a", 1_500, "busy")
    req = request("x", 2_000)
    decision, ctx, _ = router.decide(req)
    verdict = guard.check(ctx, "a", SLO)
    assert verdict.shed and verdict.predicted_ms == pytest.approx(7_000, rel=0.01)  # 3.5 s modelled


def test_retry_hint_has_a_floor() -> None:
    router, guard, _ = fleet("a")
    load(router, guard, "a", 3_010, "busy")
    req = request("barely", 2_000)
    with pytest.raises(SloUnreachable) as err:
        admit_by_deadline(guard, router, req, router.decide(req), SLO)
    assert err.value.retry_after_ms == MIN_RETRY_AFTER_MS


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="deadline"):
        DeadlineGuard("sometimes")  # type: ignore[arg-type]


# ---- defer: queued requests dropped the moment they cannot make it ----------------------------
def test_defer_drops_queued_requests_that_can_no_longer_meet_their_slo() -> None:
    q = AdmissionQueues(max_inflight=1)
    q.enqueue(Waiting("first", "w0", "", {"w0": 1_000}, SLO, 0.0))
    q.enqueue(Waiting("second", "w0", "", {"w0": 1_000}, SLO, 0.0))
    q.enqueue(Waiting("third", "w0", "", {"w0": 1_000}, SLO, 0.0))

    def per_token(worker: str, uncached: int, ahead: int, requests: int) -> float:
        return float(ahead + uncached)

    # 2 s waited; 1,500 tokens running: first 2+2.5, second 2+3.5, third 2+4.5 s
    assert [e.request_id for e in q.drop_late({"w0": (1_500, 1)}, per_token, now=2.0)] == ["second", "third"]
    assert [e.request_id for e in q.queue("w0")] == ["first"]
    # the admitted one is unaffected; later, it too expires if it is still waiting
    assert [e.request_id for e in q.drop_late({"w0": (1_500, 1)}, per_token, now=3.0)] == ["first"]
    assert len(q) == 0 and q.queued_tokens("w0") == 0


def test_the_fast_answer_for_the_chosen_worker_agrees_with_the_full_check() -> None:
    """``price_chosen`` answers the common case alone; it must never disagree with ``check``."""
    rng = random.Random(7)
    router, guard, clock = fleet("a", "b", "c")
    for i in range(300):
        wid = rng.choice("abc")
        load(router, guard, wid, rng.randrange(100, 4_000), f"r{i}")
        clock.advance(rng.uniform(0, 2_000))
        req = request(f"q{i}", rng.randrange(100, 8_000))
        decision, ctx, _ = router.decide(req)
        for w in router.workers:
            assert (guard.price_chosen(ctx, w, SLO) is not None) == (w.id in guard.check(ctx, w.id, SLO).meets)


def test_a_request_without_its_own_slo_is_admitted_where_it_would_be_shed() -> None:
    router, guard, _ = fleet("a")
    load(router, guard, "a", 4_000, "busy-a")
    req = request("undeclared", 2_000, slo=0.0)
    decided = router.decide(req)
    assert admit_by_deadline(guard, router, req, decided, SLO, refuse=False) is decided
    assert (guard.shed, guard.spared) == (0, 1)


def test_an_engines_load_report_re_anchors_the_backlog() -> None:
    """Three 1,000 ms prompts routed to ``a``; its engine then reports one still waiting for
    its first token: the backlog is that one's prefill, not what the model drained to."""
    router, guard, clock = fleet("a")
    for i in range(3):
        load(router, guard, "a", 1_000, f"r{i}")
    a = router.workers.get("a")
    assert guard.backlog_ms(a, clock.now()) == pytest.approx(3_000)
    clock.advance(0.1)
    router.report_load("a", 1, 2, 0.5)
    assert guard.backlog_ms(a, clock.now()) == pytest.approx(1_000)
    load(router, guard, "a", 500, "after")  # routed after the report: on top of it
    clock.advance(0.2)
    assert guard.backlog_ms(a, clock.now()) == pytest.approx(1_300)
    router.report_load("a", 0, 4, 0.5)  # nothing waits: only what was routed since counts
    assert guard.backlog_ms(a, clock.now()) == pytest.approx(0.0)


@pytest.mark.parametrize("quantile, low, high", [(0.5, 1.9, 3.1), (0.9, 3.9, 4.1)])
def test_admission_judges_by_the_chosen_quantile_of_observed_over_predicted(quantile, low, high) -> None:
    rng = random.Random(3)
    router, _, clock = fleet("a")
    guard = DeadlineGuard("shed", MS_PER_TOKEN, quantile)
    for i in range(3_000):
        load(router, guard, "a", 1_000, f"r{i}")
        guard.on_complete(f"r{i}", 1_000.0 * rng.choice((1.0, 2.0, 3.0, 4.0)))
        router.complete(Completion(f"r{i}", 1_000.0, 1_000.0))
        clock.advance(2.0)
    assert low <= guard.tail <= high
    assert guard.scale == pytest.approx((1 * 2 * 3 * 4) ** 0.25, rel=0.25)  # the geometric mean
    # 1 s queued and 0.5 s of its own: 1.5 s as modelled, 3-4.6 s at the median, 6 s at p90
    load(router, guard, "a", 1_000, "busy")
    req = request("x", 500)
    decided = router.decide(req)
    if quantile == 0.5:
        assert admit_by_deadline(guard, router, req, decided, SLO) is decided
    else:
        with pytest.raises(SloUnreachable):
            admit_by_deadline(guard, router, req, decided, SLO)


def test_each_load_level_learns_its_own_correction() -> None:
    """Decode steps share the GPU: a worker with 64 requests running takes 3x the model where
    an idle one takes 1x. One correction for both would misjudge both; the busy one's is its own."""
    router, guard, clock = fleet("idle", "busy")
    router.report_load("busy", 0, 64, 0.5)
    for i in range(300):
        for wid, ratio in (("idle", 1.0), ("busy", 3.0)):
            load(router, guard, wid, 1_000, f"{wid}{i}")
            guard.on_complete(f"{wid}{i}", 1_000.0 * ratio)
            router.complete(Completion(f"{wid}{i}", 1_000.0, 1_000.0))
        clock.advance(2.0)
    assert guard.scale == pytest.approx(1.0, rel=0.05)  # idle
    req = request("x", 2_000)
    req.candidate_workers = ("busy",)
    decision, ctx, _ = router.decide(req)
    busy = router.workers.get("busy")
    assert guard.predict_ms(busy, 2_000, 0, clock.now()) == pytest.approx(6_000, rel=0.05)
    load(router, guard, "busy", 1_000, "queued-busy")  # 1 s queued: 9 s there, 3 s on idle
    req = request("y", 2_000)
    decided = router.decide(req)
    decision, _, _ = admit_by_deadline(guard, router, req, decided, SLO)
    assert decision.worker_id == "idle"


@pytest.mark.parametrize("ttft_ms", [5e-324, 1e-310, 1e-9, 3.6e6])
def test_an_absurd_but_valid_ttft_moves_the_correction_a_bounded_step(ttft_ms) -> None:
    """A subnormal TTFT over a 1 s prediction underflowed to 0.0 and raised a math domain
    error inside Complete (the fuzz swarm found it); any accepted TTFT is a bounded step."""
    router, guard, _ = fleet("a")
    load(router, guard, "a", 1_000, "r")
    guard.on_complete("r", ttft_ms)
    assert math.exp(-3 * 0.05) - 1e-9 <= guard.scale <= math.exp(3 * 0.05) + 1e-9


def _admit_and_end(router: Router, guard: DeadlineGuard, clock: ManualClock, rid: str, ttft_ms: float,
                   ends_after_s: float) -> None:
    """Admit ``rid`` (1,000 tokens on an idle worker a), then end it ``ends_after_s`` later."""
    req = request(rid, 1_000)
    decided = admit_by_deadline(guard, router, req, router.decide(req), SLO)
    result = router.commit(*decided)
    guard.on_dispatch(result.worker, rid, 1_000, clock.now())
    clock.advance(ends_after_s)
    guard.on_complete(rid, ttft_ms, clock.now())
    router.complete(Completion(rid, ttft_ms, ttft_ms))


def _fits_with(guard: DeadlineGuard, router: Router, backlog_tokens: int) -> bool:
    """Whether a 1,000-token request behind ``backlog_tokens`` of modelled prefill on a is admitted."""
    load(router, guard, "a", backlog_tokens, "backlog")
    req = request("probe", 1_000)
    try:
        admit_by_deadline(guard, router, req, router.decide(req), SLO)
        return True
    except SloUnreachable:
        return False
    finally:
        router.complete(Completion("backlog", 1.0, 1.0))
        guard.on_complete("backlog", 1.0)


def test_admitted_requests_that_miss_their_slo_make_admission_stricter_until_they_meet_it() -> None:
    router, guard, clock = fleet("a")
    assert _fits_with(guard, router, 3_500)  # 4.5 s predicted against 5 s: admitted
    for i in range(100):  # admitted as meeting the SLO, yet past it, and heard within the SLO
        _admit_and_end(router, guard, clock, f"late{i}", 6_000.0, 1.0)
    assert guard.margin > 1.5
    for i in range(2_000):  # then they meet it again: the margin comes back down to none
        _admit_and_end(router, guard, clock, f"ok{i}", 1_000.0, 1.0)
    assert guard.margin == 1.0 and _fits_with(guard, router, 3_500)


def test_requests_the_client_did_not_name_teach_the_margin_too() -> None:
    """The router names a request without an id (the SDK's default); its outcome must still be
    judged. Named only at commit, after admission, each was admitted under "" and never judged."""
    router, guard, clock = fleet("a")
    for _ in range(100):  # admitted as meeting the SLO, yet past it, and heard within the SLO
        req = request("", 1_000)
        result = router.commit(*admit_by_deadline(guard, router, req, router.decide(req), SLO))
        rid = result.request.request_id
        assert rid
        guard.on_dispatch(result.worker, rid, 1_000, clock.now())
        clock.advance(1.0)
        guard.on_complete(rid, 6_000.0, clock.now())
        router.complete(Completion(rid, 6_000.0, 6_000.0))
    assert guard.margin > 1.5


def test_outcomes_heard_long_after_admission_leave_the_margin_alone() -> None:
    router, guard, clock = fleet("a")
    for i in range(100):  # each missed, but its completion came 30 s later, as a long decode's does
        _admit_and_end(router, guard, clock, f"late{i}", 6_000.0, 30.0)
    assert guard.margin == 1.0


def test_requests_without_their_own_slo_never_move_the_margin() -> None:
    router, guard, clock = fleet("a")
    load(router, guard, "a", 9_000, "busy")
    for i in range(100):  # predicted to miss, admitted because they declared no SLO (spared)
        req = request(f"spared{i}", 1_000)
        decided = admit_by_deadline(guard, router, req, router.decide(req), SLO, refuse=False)
        guard.on_dispatch(router.commit(*decided).worker, f"spared{i}", 1_000, clock.now())
        guard.on_complete(f"spared{i}", 12_000.0, clock.now())
        router.complete(Completion(f"spared{i}", 12_000.0, 12_000.0))
    assert guard.spared == 100 and guard.margin == 1.0


def test_a_first_token_report_teaches_the_ttft_once_and_keeps_the_request_in_the_backlog() -> None:
    router, guard, clock = fleet("a")
    for i in range(200):  # the engine takes twice what the model says, heard at each first token
        load(router, guard, "a", 1_000, f"r{i}")
        guard.on_first_token(f"r{i}", 2_000.0, clock.now())
        clock.advance(100.0)
    assert guard.scale == pytest.approx(2.0, rel=0.01)
    load(router, guard, "a", 1_000, "late")
    guard.on_first_token("late", 2_000.0, clock.now())
    assert guard._flight["a"].get("late") is not None  # still decoding: its Complete ends it
    for i in range(200):  # the Completes that follow are not learned a second time
        guard.on_complete(f"r{i}", 50_000.0, clock.now())
    guard.on_complete("late", 50_000.0, clock.now())
    assert guard.scale == pytest.approx(2.0, rel=0.01) and "late" not in guard._flight["a"]


def _kv_fleet(capacity_blocks: int) -> tuple[Router, DeadlineGuard, ManualClock]:
    clock = ManualClock()
    router = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"}), clock, random.Random(0))
    router.add_worker(WorkerSpec(id="a", address="a:1", mode=CacheMode.EVENTS, capacity_blocks=capacity_blocks))
    return router, DeadlineGuard("shed", MS_PER_TOKEN, block_size=BS), clock


def _learn_holds(guard: DeadlineGuard, holds_ms: list[float]) -> None:
    for i, hold in enumerate(holds_ms):  # Completes of earlier requests: TTFT 100 ms, then their decode
        guard.on_complete(f"old{i}", 100.0, None, 100.0 + hold)


def test_a_full_kv_cache_makes_a_request_wait_for_the_oldest_decodes_when_decodes_take_alike() -> None:
    router, guard, clock = _kv_fleet(capacity_blocks=1_000 // BS * 4)  # room for four 1,000-token prompts
    _learn_holds(guard, [10_000.0] * 50)
    for i in range(4):  # four running requests, their first tokens out at t = 0, 1, 2, 3 s
        load(router, guard, "a", 1_000, f"run{i}")
        guard.on_first_token(f"run{i}", 50.0, clock.now())
        clock.advance(1.0)
    router.report_load("a", 0, 4, 1.0)  # the engine: KV full, nothing waiting
    worker = router.workers.find("a")
    assert worker is not None
    # a new 1,000-token prompt waits for the oldest request to end: first token at 0 s + 10 s
    assert guard.kv_wait_ms(worker, clock.now(), 1_000) == pytest.approx(6_000.0)
    # two more tokens' worth of room than one request frees: the second oldest, 1 s later
    assert guard.kv_wait_ms(worker, clock.now(), 1_500) == pytest.approx(7_000.0)
    # and the request is refused: 6 s of waiting against a 5 s SLO, though no prefill is queued
    req = request("new", 1_000)
    with pytest.raises(SloUnreachable):
        admit_by_deadline(guard, router, req, router.decide(req), SLO)


def test_a_full_kv_cache_turns_over_evenly_when_decode_times_vary_widely() -> None:
    router, guard, clock = _kv_fleet(capacity_blocks=1_000 // BS * 4)
    _learn_holds(guard, [500.0, 500.0, 500.0, 30_000.0] * 50)  # a squared coefficient of variation past 1
    for i in range(4):
        load(router, guard, "a", 1_000, f"run{i}")
        guard.on_first_token(f"run{i}", 50.0, clock.now())
    clock.advance(1.0)
    router.report_load("a", 0, 4, 1.0)
    worker = router.workers.find("a")
    assert worker is not None
    # any running request may end next: 1,000 of ~4,000 tokens in use is a quarter of a mean decode
    assert guard.kv_wait_ms(worker, clock.now(), 1_000) == pytest.approx(guard.hold_ms / 4, rel=0.02)
    router.report_load("a", 0, 4, 0.5)  # half free: room at once
    assert guard.kv_wait_ms(worker, clock.now(), 1_000) == 0.0


@pytest.mark.parametrize(("ttft_ms", "e2e_ms", "kv"), [
    (1e-300, 2e-300, 1.0),  # a decode time whose square underflows to 0
    (100.0, 100.5, 1.0),  # shorter than a millisecond: not a decode time
    (100.0, 10_100.0, 5e-324),  # a subnormal KV use: an infinite turnover
    (100.0, float(MAX_LATENCY_MS), 1e-300),
])
def test_hostile_completes_and_load_reports_leave_the_kv_wait_finite(ttft_ms, e2e_ms, kv) -> None:
    router, guard, clock = _kv_fleet(capacity_blocks=1_000 // BS * 4)
    for i in range(3):
        load(router, guard, "a", 1_000, f"run{i}")
        guard.on_complete(f"old{i}", ttft_ms, clock.now(), e2e_ms)
    clock.advance(1.0)
    router.report_load("a", 3, 3, kv)
    worker = router.workers.find("a")
    assert worker is not None
    assert 0.0 <= guard.kv_wait_ms(worker, clock.now(), 10**9) <= MAX_LATENCY_MS
    req = request("probe", 1_000)
    try:
        admit_by_deadline(guard, router, req, router.decide(req), SLO)
    except SloUnreachable as err:  # refused or not, with a finite retry hint
        assert math.isfinite(err.retry_after_ms)


def test_requests_ending_before_any_load_report_leave_the_kv_wait_defined() -> None:
    # counted as waiting when routed, they end before a report says otherwise (a Complete right
    # after its Route): fewer are tracked than were counted waiting
    router, guard, clock = _kv_fleet(capacity_blocks=1_000 // BS * 4)
    _learn_holds(guard, [10_000.0] * 10)
    load(router, guard, "a", 1_000, "first")
    clock.advance(1.0)
    router.report_load("a", 0, 1, 1.0)  # KV full, the first one running
    for i in range(3):
        load(router, guard, "a", 1_000, f"quick{i}")
    for i in range(3):
        guard.on_complete(f"quick{i}", 50.0, clock.now())
        router.complete(Completion(f"quick{i}", 50.0, 60.0))
    worker = router.workers.find("a")
    assert worker is not None
    assert 0.0 <= guard.kv_wait_ms(worker, clock.now(), 1_000) <= MAX_LATENCY_MS


def _past_the_slo_on_its_prefix(max_inflight_bytes: int) -> tuple[Router, DeadlineGuard, RouteRequest, list[str]]:
    """A Route whose prefix lies on a worker 6 s of prefill behind (past the 5 s SLO), among 200
    idle pods with long names: deadline admission reroutes it by naming the pods."""
    router = Router(RouterSettings(block_size=BS, max_inflight_bytes=max_inflight_bytes), ManualClock(), random.Random(0))
    pods = [f"vllm-decode-{i:03d}-7f9c8d6b5-abcde" for i in range(200)]
    for wid in ("busy", *pods):
        router.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", mode=CacheMode.EVENTS))
    guard = DeadlineGuard("shed", MS_PER_TOKEN)
    tokens = list(range(100, 2_100))
    router.apply(EventBatch("busy", 0, (Stored(tuple(tokens), None),)))
    load(router, guard, "busy", 6_000, "busy-1")
    return router, guard, RouteRequest("moved", router.keys_for_tokens(tokens), len(tokens), ttft_slo_ms=SLO), pods


def test_a_reroute_is_not_refused_for_the_bytes_of_the_names_it_is_narrowed_to() -> None:
    # the names a reroute narrows to are the router's own and never kept (the test below): the
    # request was checked against limits.max_inflight_bytes as its client sent it, and a
    # re-decision among ~900 names at 1,024 workers re-checked them (~40 us) and could refuse it
    router, guard, req, _ = _past_the_slo_on_its_prefix(1 << 30)
    room = router.inflight_bytes + request_bytes(req) + 1_000  # the request fits, its 200 names (18 kB) do not
    router, guard, req, pods = _past_the_slo_on_its_prefix(room)
    (decision, ctx, policy), _ = admit_priced(guard, router, req, router.decide(req), SLO)
    assert guard.rerouted == 1 and decision.worker_id in pods
    router.commit(decision, ctx, policy)
    assert router.inflight_bytes <= room


def test_a_rerouted_request_is_kept_and_charged_with_the_candidates_its_client_sent() -> None:
    # deadline admission narrows a reroute to the workers meeting the SLO by naming them; at
    # fleet scale that is hundreds of names, which the in-flight table must not keep and
    # charge against limits.max_inflight_bytes for every rerouted request
    router, guard, req, pods = _past_the_slo_on_its_prefix(1 << 30)
    decided = router.decide(req)
    assert decided[0].worker_id == "busy"  # the policy follows the prefix
    held = router.inflight_bytes
    (decision, ctx, policy), _ = admit_priced(guard, router, req, decided, SLO)
    assert guard.rerouted == 1 and decision.worker_id in pods and len(ctx.candidates) == len(pods)
    assert req.candidate_workers == ()
    router.commit(decision, ctx, policy)
    assert router.inflight_bytes - held == request_bytes(req)
