"""The baselines the papers compare against: min_ttft, preble, kv_cost, cache_affinity."""

from __future__ import annotations

from collections import Counter

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.routing.kv_cost import KVCostPolicy
from kvrouterd.policies.routing.min_ttft import MinTTFTPolicy

from .helpers import complete, make_router, prompt, request


# ---- min_ttft ---------------------------------------------------------------------------
def test_min_ttft_trades_queueing_against_recomputation() -> None:
    router, _ = make_router({"name": "min_ttft", "prefill_ms_per_1k_tokens": 100.0}, ["a", "b"])
    home = router.route(request(prompt(1, 2048, 0))).worker.id
    other = "b" if home == "a" else "a"
    # home holds 2048 cached tokens and 2112 pending; other would prefill 2112 from scratch
    d = router.decide(request(prompt(1, 2048, 1)))[0]
    assert d.worker_id == other  # 211 + 6 ms on home > 211 ms elsewhere
    assert d.estimated_ttft_ms == pytest.approx(211.2)


def test_min_ttft_picks_the_lowest_estimate_and_reports_it() -> None:
    router, _ = make_router({"name": "min_ttft"}, ["a", "b", "c"])
    first = router.route(request(prompt(2, 4096, 0)))
    complete(router, first.request.request_id)
    d = router.decide(request(prompt(2, 4096, 1)))[0]
    assert d.worker_id == first.worker.id  # cached and idle
    terms = {c.worker_id: c.terms for c in d.candidates}
    assert d.estimated_ttft_ms == pytest.approx(min(t["ttft_ms"] for t in terms.values()))
    assert terms[d.worker_id]["compute_ms"] == pytest.approx(64 * 40.0 / 1000)


def test_min_ttft_calibrates_from_completions() -> None:
    router, _ = make_router({"name": "min_ttft"}, ["a"])
    policy = router.routing_policy()
    assert isinstance(policy, MinTTFTPolicy)
    for burst in (1, 3, 2, 4, 1, 3):
        sent = []
        for i in range(burst):
            res = router.route(request(prompt(100 + burst * 10 + i, 512, i)))
            sent.append((res.request.request_id, res.worker.pending_prefill_tokens))
        for rid, ahead in sent:
            complete(router, rid, ttft_ms=25.0 + 0.3 * ahead)  # 300 ms per 1k + 25 ms
    per_1k, intercept = policy.latency.coefficients()
    assert per_1k == pytest.approx(300.0, rel=0.02) and intercept == pytest.approx(25.0, abs=2.0)


# ---- preble -----------------------------------------------------------------------------
def test_preble_follows_the_cache_above_half_hit_rate_else_the_load_cost() -> None:
    router, _ = make_router({"name": "preble"}, ["a", "b"])
    home = router.route(request(prompt(3, 1024, 0, 64))).worker.id
    # 1024 of 1088 tokens cached on home (94% > 50%): home, despite its pending load
    d = router.decide(request(prompt(3, 1024, 1, 64)))[0]
    assert (d.worker_id, d.reason) == (home, "prefix_hit")
    # 256 of 1280 cached (20%): the load cost decides, and home is busy
    d = router.decide(request(prompt(3, 256, 2, 1024)))[0]
    assert d.reason == "load_cost" and d.worker_id != home
    assert d.attributes["hit_rate"] == pytest.approx(0.2)


def test_preble_threshold_is_a_parameter() -> None:
    router, _ = make_router({"name": "preble", "hit_threshold": 0.95}, ["a", "b"])
    home = router.route(request(prompt(3, 1024, 0, 64))).worker.id
    d = router.decide(request(prompt(3, 1024, 1, 64)))[0]
    assert d.reason == "load_cost" and d.worker_id != home


# ---- kv_cost ----------------------------------------------------------------------------
def test_kv_cost_adds_weighted_prefill_blocks_to_active_blocks() -> None:
    router, _ = make_router({"name": "kv_cost"}, ["a", "b"])
    first = router.route(request(prompt(4, 1024, 0, 64)))  # 68 blocks, all to compute
    home = first.worker.id
    d = router.decide(request(prompt(4, 1024, 1, 64)))[0]
    terms = {c.worker_id: c.terms for c in d.candidates}
    # home: 4 new blocks + (68 active + 68 own); other: 68 new + 68 own
    assert terms[home]["cost"] == pytest.approx(4 + 136)
    other = "b" if home == "a" else "a"
    assert terms[other]["cost"] == pytest.approx(68 + 68)
    assert d.worker_id == other
    complete(router, first.request.request_id)
    policy = router.routing_policy()
    assert isinstance(policy, KVCostPolicy) and policy.active_blocks(home) == 0
    assert router.decide(request(prompt(4, 1024, 2, 64)))[0].worker_id == home


def test_kv_cost_weight_zero_ignores_the_cache() -> None:
    router, _ = make_router({"name": "kv_cost", "overlap_weight": 0.0}, ["a", "b"])
    first = router.route(request(prompt(5, 1024, 0, 64)))
    complete(router, first.request.request_id)
    terms = {c.worker_id: c.terms["cost"] for c in router.decide(request(prompt(5, 1024, 1, 64)))[0].candidates}
    assert terms["a"] == terms["b"]


def test_kv_cost_softmax_samples_in_proportion_to_exp_of_normalised_cost() -> None:
    router, _ = make_router({"name": "kv_cost", "temperature": 1.0}, ["a", "b"])
    home = router.route(request(prompt(6, 1024, 0, 64), rid="seed")).worker.id
    complete(router, "seed")
    counts = Counter(router.decide(request(prompt(6, 1024, i, 64)))[0].worker_id for i in range(1, 3001))
    # normalised costs 0 (home) and 1: P(home) = 1 / (1 + e^-1) = 0.731
    assert counts[home] / 3000 == pytest.approx(0.731, abs=0.03)


# ---- cache_affinity ---------------------------------------------------------------------
def test_cache_affinity_always_takes_the_longest_prefix_even_when_loaded() -> None:
    # the shared 512 tokens are the prompts' key: requests the paper's affinity keeps together
    router, _ = make_router({"name": "cache_affinity", "key_tokens": 512}, ["a", "b", "c"])
    home = router.route(request(prompt(7, 512, 0))).worker.id
    for i in range(1, 30):
        res = router.route(request(prompt(7, 512, i)))
        assert res.worker.id == home and res.decision.reason == "longest_prefix"
    # a prefix cached nowhere goes where its prefix hashes, loaded or not (the paper's
    # prompt-aware mapping; test_peer_baselines covers it)
    assert router.route(request(prompt(8, 512, 0))).decision.reason == "prefix_hash"


@pytest.mark.parametrize(
    "spec,field",
    [({"name": "preble", "hit_threshold": 1.5}, "hit_threshold"),
     ({"name": "kv_cost", "temperature": -1}, "temperature"),
     ({"name": "kv_cost", "overlap_weight": -0.1}, "overlap_weight"),
     ({"name": "min_ttft", "prefill_model": "cubic"}, "prefill_model")],
)
def test_bad_parameters_fail_naming_the_field(spec: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        registry.build("routing", spec)
