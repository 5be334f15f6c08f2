"""DualMap: the properties the paper claims, checked through the Router."""

from __future__ import annotations

import random
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.errors import ConfigError
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import Worker, WorkerSpec
from kvrouterd.policies import registry
from kvrouterd.policies.routing import hash_ring
from kvrouterd.policies.routing.dualmap import DualMapPolicy
from kvrouterd.policies.routing.hash_ring import DualHashRing, _Ring

from .helpers import BLOCK, complete, make_router, prompt, request

# 4-block segments keep prompts small: the base key is 2 segments = 8 blocks = 128 tokens
SMALL = {"name": "dualmap", "segment_tokens": 64}
# the paper's rules (pair placement, switch whenever overloaded, A.7 as written): the
# properties the paper claims are checked on it
PAPER = {"name": "dualmap_paper", "segment_tokens": 64}
PREFIX_TOKENS = 128


def _worker(wid: str, slot: int) -> Worker:
    return Worker(WorkerSpec(id=wid, address="x:1"), slot, 0.0)


def test_two_independent_instances_pick_the_same_pair() -> None:
    ids = [f"gpu-{i}" for i in range(12)]
    a = registry.build("routing", SMALL, random.Random(1))
    b = registry.build("routing", SMALL, random.Random(2))
    for slot, wid in enumerate(ids):
        a.on_worker_added(_worker(wid, slot))
    for slot, wid in enumerate(reversed(ids)):  # another registration order
        b.on_worker_added(_worker(wid, slot))
    for p in range(300):
        req = request(prompt(p, PREFIX_TOKENS, p))
        pair = a.candidate_pair(req, BLOCK)
        assert pair == b.candidate_pair(req, BLOCK)
        assert pair[0] != pair[1]


def test_two_routers_with_the_same_workers_route_to_the_same_pairs() -> None:
    r1, _ = make_router(PAPER, ["a", "b", "c", "d", "e"])
    r2, _ = make_router(PAPER, ["e", "c", "a", "d", "b"])
    for p in range(50):
        tokens = prompt(p, PREFIX_TOKENS, p)
        d1 = r1.route(request(tokens)).decision
        d2 = r2.route(request(tokens)).decision
        assert {d1.attributes["candidate_1"], d1.attributes["candidate_2"]} == {
            d2.attributes["candidate_1"], d2.attributes["candidate_2"]}


@pytest.mark.parametrize("n", [5, 10, 20])
def test_removing_or_adding_one_of_n_workers_remaps_about_one_nth(n: int) -> None:
    ring = DualHashRing(virtual_nodes=128)
    for i in range(n):
        ring.add(f"w{i}")
    keys = [random.Random(k).getrandbits(64) for k in range(4000)]
    before = [(ring.first(k, 0), ring.first(k, 1)) for k in keys]

    ring.remove("w3")
    after = [(ring.first(k, 0), ring.first(k, 1)) for k in keys]
    for r in (0, 1):
        moved = [i for i in range(len(keys)) if before[i][r] != after[i][r]]
        # consistent hashing: only keys owned by the removed worker move
        assert all(before[i][r] == "w3" for i in moved)
        assert abs(len(moved) / len(keys) - 1 / n) < 0.6 / n

    ring.add("w3")
    ring.add("new")
    grown = [(ring.first(k, 0), ring.first(k, 1)) for k in keys]
    for r in (0, 1):
        moved = [i for i in range(len(keys)) if before[i][r] != grown[i][r]]
        assert all(grown[i][r] == "new" for i in moved)
        assert abs(len(moved) / len(keys) - 1 / (n + 1)) < 0.6 / (n + 1)


def test_candidate_pair_is_always_two_distinct_allowed_workers() -> None:
    ring = DualHashRing(virtual_nodes=4)
    for wid in ("a", "b", "c"):
        ring.add(wid)
    for k in range(2000):
        first, second = ring.pair(k * 7919)
        assert first != second and {first, second} <= {"a", "b", "c"}
        first, second = ring.pair(k * 7919, {"a", "c"}.__contains__)
        assert {first, second} == {"a", "c"}


def test_requests_of_a_prefix_stay_within_its_pair_and_miss_at_most_twice() -> None:
    # 20 prefixes, 5% of the traffic each: none is hot for 8 workers (2/n = 25%)
    router, clock = make_router(PAPER, 8)
    policy = router.routing_policy()
    served: dict[int, set[str]] = {}
    misses: Counter[int] = Counter()
    seen: Counter[int] = Counter()
    rng = random.Random(3)
    for i in range(600):
        p = rng.randrange(20)
        req = request(prompt(p, PREFIX_TOKENS, i))
        pair = set(policy.candidate_pair(req, BLOCK))
        res = router.route(req)
        assert res.worker.id in pair  # every request of the prefix lands in its pair
        served.setdefault(p, set()).add(res.worker.id)
        seen[p] += 1
        if res.decision.overlap_blocks < PREFIX_TOKENS // BLOCK:
            misses[p] += 1
        clock.advance(0.01)
        if rng.random() < 0.7:  # keep load moving so both candidates get used
            complete(router, res.request.request_id)
    assert not policy.hotness.extended
    for p, m in seen.items():
        assert len(served[p]) <= 2
        # the paper's cache-affinity guarantee: hit rate >= max(0, 1 - 2/m)
        assert (m - misses[p]) / m >= max(0.0, 1 - 2 / m)


def test_hot_prefix_gets_a_longer_key_and_spreads_then_shrinks_when_cold() -> None:
    router, clock = make_router({**SMALL, "hotness_min_requests": 20, "hotness_window_s": 10}, 8)
    policy = router.routing_policy()
    rng = random.Random(5)
    hot_workers: set[str] = set()
    for i in range(400):
        p = 0 if rng.random() < 0.6 else 1 + rng.randrange(30)  # prefix 0 takes 60% > 2/8
        # the hot prefix's requests differ from the 3rd segment on (different tools/users)
        res = router.route(request(prompt(p, PREFIX_TOKENS + 64, i)))
        if p == 0 and i >= 200:
            hot_workers.add(res.worker.id)
            assert res.decision.attributes["key_blocks"] > PREFIX_TOKENS // BLOCK
            assert res.decision.attributes["key_extended"] == 1
        clock.advance(0.005)
        complete(router, res.request.request_id)
    hot_node = block_keys(prompt(0, PREFIX_TOKENS, 0, 0), BLOCK)[-1]
    assert hot_node in policy.hotness.extended
    assert len(hot_workers) > 2  # spread beyond one pair
    cold = request(prompt(5, PREFIX_TOKENS + 64, 9999))
    assert router.decide(cold)[0].attributes["key_blocks"] == PREFIX_TOKENS // BLOCK

    # the prefix goes cold: other traffic only, for a whole window
    for i in range(200):
        res = router.route(request(prompt(1 + i % 30, PREFIX_TOKENS + 64, 10_000 + i)))
        complete(router, res.request.request_id)
        clock.advance(0.1)
        router.tick()
    assert hot_node not in policy.hotness.extended
    again = router.decide(request(prompt(0, PREFIX_TOKENS + 64, 77)))[0]
    assert again.attributes["key_blocks"] == PREFIX_TOKENS // BLOCK


def test_slo_aware_choice_prefers_reuse_until_the_threshold_then_switches() -> None:
    router, _ = make_router({**PAPER, "slo_threshold_tokens": 500}, ["a", "b"])
    tokens = lambda i: prompt(1, PREFIX_TOKENS, i)  # noqa: E731
    first = router.route(request(tokens(0))).decision
    assert first.attributes["rule"] == "equal_reuse"  # nothing cached anywhere yet
    home = first.worker_id
    rules = []
    for i in range(1, 8):
        d = router.route(request(tokens(i))).decision
        rules.append((d.attributes["rule"], d.worker_id))
        if d.attributes["rule"] == "slo_switch":
            break
    # cache affinity while the home worker's pending tokens stay within the threshold
    assert rules[0] == ("cache_affinity", home)
    assert rules[-1][0] == "slo_switch" and rules[-1][1] != home
    # once both hold the prefix, equal reuse picks the less loaded one
    d = router.route(request(tokens(100))).decision
    assert d.attributes["rule"] == "equal_reuse"
    loads = {c.worker_id: c.pending_prefill_tokens for c in d.candidates}
    assert loads[d.worker_id] == min(loads.values())


def test_static_threshold_is_the_tokens_a_worker_clears_within_the_slo() -> None:
    router, _ = make_router({"name": "dualmap", "prefill_ms_per_1k_tokens": 50.0}, 2)
    d = router.decide(request(prompt(1, 512, 0), slo_ms=2000.0))[0]
    assert d.attributes["threshold_tokens"] == 40_000  # 2000 ms / 50 ms per 1k
    d = router.decide(request(prompt(1, 512, 0)))[0]
    assert d.attributes["slo_ms"] == 5000.0 and d.attributes["threshold_tokens"] == 100_000


def test_decision_carries_both_candidates_and_their_terms() -> None:
    router, _ = make_router(PAPER, 6)
    res = router.route(request(prompt(4, PREFIX_TOKENS, 1)))
    d = res.decision
    a = d.attributes
    assert {a["candidate_1"], a["candidate_2"]} == {d.worker_id, d.alternative_worker_id}
    assert res.alternative is not None and res.alternative.id == d.alternative_worker_id
    for key in ("reuse_1", "reuse_2", "load_1", "load_2", "ttft_1_ms", "ttft_2_ms", "rule", "slo_ms"):
        assert key in a
    assert d.estimated_ttft_ms > 0
    assert len(d.candidates) == 2
    for c in d.candidates:
        assert {"reuse_blocks", "load_tokens", "est_ttft_ms", "overloaded", "candidate"} <= set(c.terms)


def test_decode_bottleneck_marks_a_silent_worker_overloaded_and_corrects_its_ttft() -> None:
    router, clock = make_router({**SMALL, "slo_threshold_tokens": 100_000}, ["a", "b"])
    tokens = lambda i: prompt(2, PREFIX_TOKENS, i)  # noqa: E731
    first = router.route(request(tokens(0)))
    home = first.worker.id
    assert router.route(request(tokens(1))).decision.attributes["rule"] == "cache_affinity"
    clock.advance(2.0)
    router.report_load(home, queued=2, running=2, kv_utilization=0.99)  # the engine has a queue
    assert router.decide(request(tokens(2)))[0].attributes["rule"] == "cache_affinity"  # 2 s < T = 3 s
    router.report_load(home, queued=0, running=2, kv_utilization=0.99)
    clock.advance(2.0)
    # requests in flight but no waiting queue: they may all be decoding, no flag
    assert router.decide(request(tokens(2)))[0].attributes["rule"] == "cache_affinity"
    router.report_load(home, queued=2, running=2, kv_utilization=0.99)
    d = router.decide(request(tokens(2)))[0]
    assert d.attributes["rule"] == "slo_switch" and d.worker_id != home
    terms = {c.worker_id: c.terms for c in d.candidates}
    assert terms[home]["bottleneck_ms"] == pytest.approx(4000.0)
    assert terms[home]["est_ttft_ms"] >= 4000.0
    assert terms[home]["overloaded"] == 1.0
    # a completion whose first token came 10 ms ago shows the worker prefilling again
    complete(router, first.request.request_id, ttft_ms=3990.0, e2e_ms=4000.0)
    assert router.decide(request(tokens(3)))[0].attributes["rule"] == "cache_affinity"


def test_requests_waiting_in_the_admission_queue_count_as_the_workers_pending_load() -> None:
    router, _ = make_router({**SMALL, "slo_threshold_tokens": 5_000}, ["a", "b"])
    tokens = lambda i: prompt(2, PREFIX_TOKENS, i)  # noqa: E731
    home = router.route(request(tokens(0))).worker.id
    d = router.decide(request(tokens(1)))[0]
    assert d.attributes["rule"] == "cache_affinity"
    before = {c.worker_id: c.terms["load_tokens"] for c in d.candidates}
    # the host's admission queue now holds 6,000 tokens of prefill for home: past the threshold
    router.note_admission_queue(home, 3, 6_000)
    d = router.decide(request(tokens(1)))[0]
    terms = {c.worker_id: c.terms for c in d.candidates}
    assert terms[home]["load_tokens"] == before[home] + 6_000
    assert terms[home]["overloaded"] == 1.0 and d.attributes["rule"] == "slo_switch" and d.worker_id != home
    router.note_admission_queue(home, 0, 0)
    assert router.decide(request(tokens(1)))[0].attributes["rule"] == "cache_affinity"


def _calibrate_slow_fleet(router, tokens, ms_per_token: float) -> None:  # type: ignore[no-untyped-def]
    """Route bursts of 1..4 requests and complete them with TTFT = ms_per_token * tokens ahead."""
    n = 0
    for burst in (1, 2, 3, 4, 1, 2, 3, 4):
        sent = []
        for _ in range(burst):
            n += 1
            res = router.route(request(tokens(1000 + n), slo_ms=1000))
            sent.append((res.request.request_id, res.worker.pending_prefill_tokens))
        for rid, ahead in sent:
            complete(router, rid, ttft_ms=ms_per_token * ahead, e2e_ms=ms_per_token * ahead + 50)


@pytest.mark.parametrize("slo_test,switches", [("latency_model", True), ("static_threshold", False)])
def test_latency_model_slo_test_switches_on_the_calibrated_estimate(slo_test: str, switches: bool) -> None:
    router, _ = make_router({**SMALL, "slo_test": slo_test, "calibrate": True}, ["a", "b"])
    tokens = lambda i: prompt(3, PREFIX_TOKENS, i)  # noqa: E731
    _calibrate_slow_fleet(router, tokens, ms_per_token=2.0)  # 2000 ms per 1k, the prior says 40
    policy = router.routing_policy()
    assert isinstance(policy, DualMapPolicy) and policy.latency.calibrated
    assert policy.latency.coefficients()[0] == pytest.approx(2000.0, rel=0.05)
    rules = [router.route(request(tokens(i), slo_ms=1000)).decision.attributes["rule"] for i in range(12)]
    assert ("slo_switch" in rules) is switches


def test_default_load_and_threshold_come_from_the_profiled_model() -> None:
    # the paper derives both from a profiled GPU: completions, however slow, do not move them
    router, clock = make_router(SMALL, ["a", "b"])
    tokens = lambda i: prompt(3, PREFIX_TOKENS, i)  # noqa: E731
    _calibrate_slow_fleet(router, tokens, ms_per_token=2.0)
    policy = router.routing_policy()
    assert isinstance(policy, DualMapPolicy) and not policy.latency.calibrated
    assert policy.latency.coefficients()[0] == pytest.approx(40.0)
    # routed prefill drains at the profiled 25k tokens/s: 20k tokens are gone after 0.8 s
    worker = router.route(request(prompt(9, 20_000, 0, 0))).worker
    assert policy.latency.pending_tokens(worker, clock.now()) == pytest.approx(20_000, abs=1)
    clock.advance(0.4)
    assert policy.latency.pending_tokens(worker, clock.now()) == pytest.approx(10_000, abs=1)
    clock.advance(0.4)
    assert policy.latency.pending_tokens(worker, clock.now()) == 0
    # calibration stays available as an option, and then the same completions move the model
    router2, _ = make_router({**SMALL, "calibrate": True}, ["a", "b"])
    _calibrate_slow_fleet(router2, tokens, ms_per_token=2.0)
    assert router2.routing_policy().latency.coefficients()[0] == pytest.approx(2000.0, rel=0.05)


@pytest.mark.parametrize(
    "field,value",
    [("segment_tokens", 0), ("base_segments", 0), ("max_key_segments", 1), ("hotness_window_s", 0),
     ("slo_test", "fastest"), ("decode_bottleneck_s", -1), ("prefill_ms_per_1k_tokens", 0),
     ("calibration_forgetting", 1.5)],
)
def test_bad_parameters_fail_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        registry.build("routing", {"name": "dualmap", field: value})


def _home_over_threshold(switch_to: str):  # type: ignore[no-untyped-def]
    """A worker holding a 1,024-token prefix, 600 tokens queued for it (past the 500-token
    threshold), and its pair's other worker idle and holding nothing."""
    router, _ = make_router({**PAPER, "slo_threshold_tokens": 500, "switch_to": switch_to}, ["a", "b"])
    tokens = lambda i: prompt(5, 1024, i)  # noqa: E731
    first = router.route(request(tokens(0)))
    complete(router, first.request.request_id)
    home = first.worker.id
    router.note_admission_queue(home, 1, 600)
    return router, router.decide(request(tokens(1)))[0], home


def test_slo_switch_goes_to_the_lower_estimated_ttft_counting_each_candidates_cache() -> None:
    # home: 600 queued + 64 uncached tokens; the other: nothing queued but all 1,088 to prefill
    _, d, home = _home_over_threshold("min_ttft")
    terms = {c.worker_id: c.terms for c in d.candidates}
    assert terms[home]["overloaded"] == 1.0 and d.attributes["rule"] == "slo_switch"
    assert d.worker_id == home  # recomputing the prefix elsewhere would be slower
    assert terms[home]["est_ttft_ms"] < min(t["est_ttft_ms"] for w, t in terms.items() if w != home)
    # section 3.2's "less loaded" reading moves it to the idle worker, which holds none of it
    _, d, home = _home_over_threshold("less_loaded")
    assert d.attributes["rule"] == "slo_switch" and d.worker_id != home


def test_counters_report_how_often_the_decode_bottleneck_rule_fired_and_moved_a_request() -> None:
    router, clock = make_router({**PAPER, "slo_threshold_tokens": 100_000}, ["a", "b"])
    tokens = lambda i: prompt(2, PREFIX_TOKENS, i)  # noqa: E731
    home = router.route(request(tokens(0))).worker.id
    router.route(request(tokens(1)))
    policy = router.routing_policy()
    assert policy.counters() == {"decode_bottleneck_decisions": 0, "decode_bottleneck_moves": 0, "slo_switches": 0,
                                 "slo_holds": 0, "cold_placements": 0, "remembered_placements": 0}
    clock.advance(4.0)
    router.report_load(home, queued=2, running=2, kv_utilization=0.99)
    router.decide(request(tokens(2)))  # a decision the host does not dispatch is not counted
    assert policy.counters()["decode_bottleneck_decisions"] == 0
    d = router.route(request(tokens(3))).decision
    assert d.worker_id != home and d.attributes["decode_bottleneck_moved"] == 1
    assert {k: policy.counters()[k] for k in ("decode_bottleneck_decisions", "decode_bottleneck_moves", "slo_switches")} == {
        "decode_bottleneck_decisions": 1, "decode_bottleneck_moves": 1, "slo_switches": 1}
    assert router.policy_counters() == {"dualmap_paper": policy.counters()}


#: a ring's changes merged into its lists always (0), past its own threshold, or sorted whole always
_MERGES = st.sampled_from([0, hash_ring._WHOLE_SORT, 10**9])


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=40),
       keys=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20), whole_sort=_MERGES)
def test_the_ring_kept_through_changes_is_the_ring_built_from_its_members(ops: list[tuple[bool, int]],
                                                                          keys: list[int], whole_sort: int) -> None:
    # points go in and out as workers come and go (merged into the lists at the next lookup):
    # after any history, every walk and pair is that of a ring built afresh from the members
    with _whole_sort(whole_sort):
        _check_ring_history(ops, keys)


@contextmanager
def _whole_sort(threshold: int) -> Iterator[None]:
    kept = hash_ring._WHOLE_SORT
    hash_ring._WHOLE_SORT = threshold
    try:
        yield
    finally:
        hash_ring._WHOLE_SORT = kept


def _history(ring: DualHashRing | _Ring, ops: list[tuple[bool, int]], lookup: Callable[[], object],
             every: int) -> set[str]:
    """Workers ``gpu-N`` added and removed as ``ops`` say, with a lookup after every ``every``-th
    change (changes go into the ring's lists at the next lookup); returns the members left."""
    members: set[str] = set()
    for step, (adding, n) in enumerate(ops):
        wid = f"gpu-{n}"
        if adding:
            ring.add(wid)
            members.add(wid)
        else:
            ring.remove(wid)
            members.discard(wid)
        if step % every == 0 and members:
            lookup()
    return members


def _check_ring_history(ops: list[tuple[bool, int]], keys: list[int]) -> None:
    ring = DualHashRing(virtual_nodes=8)
    members = _history(ring, ops, lambda: ring.pair(keys[0]), 3)
    fresh = DualHashRing(virtual_nodes=8)
    for wid in sorted(members):
        fresh.add(wid)
    for r in (0, 1):
        kept, built = ring._rings[r], fresh._rings[r]
        expected = sorted((p, w) for w in members for p in built.positions(w))
        for key in keys:
            assert list(kept.walk(key)) == list(built.walk(key)) == [
                w for _, w in expected[bisect_left(expected, (key,)):] + expected[:bisect_left(expected, (key,))]]
    for key in keys:
        if members:
            assert ring.pair(key) == fresh.pair(key)
        else:
            with pytest.raises(LookupError):
                ring.pair(key)


class _CrowdedRing(_Ring):
    """A ring whose workers' points land on four positions: every point is shared."""

    __slots__ = ()

    def positions(self, worker_id: str) -> list[int]:
        return [(p % 4) << 62 for p in super().positions(worker_id)]


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=30),
       keys=st.lists(st.sampled_from([0, 1, 2**62, 2**62 + 1, 2**63, 3 << 62, 2**64 - 1]), min_size=1, max_size=7),
       whole_sort=_MERGES)
def test_workers_whose_points_collide_are_walked_in_id_order(ops: list[tuple[bool, int]], keys: list[int],
                                                             whole_sort: int) -> None:
    # two workers on one point (a 64-bit collision: rare, but replicas must still agree) are
    # reached in id order, both of them, and a removal takes only its own worker off the point
    with _whole_sort(whole_sort):
        _check_crowded_history(ops, keys)


def _check_crowded_history(ops: list[tuple[bool, int]], keys: list[int]) -> None:
    ring = _CrowdedRing(seed=1, virtual_nodes=3)
    members = _history(ring, ops, lambda: list(ring.walk(keys[0])), 2)
    expected = sorted((p, w) for w in members for p in ring.positions(w))
    for key in keys:
        cut = bisect_left(expected, (key,))
        assert list(ring.walk(key)) == [w for _, w in expected[cut:] + expected[:cut]]
