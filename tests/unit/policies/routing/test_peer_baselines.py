"""The peer routers as users run them: dynamo, llm_d, cache_affinity's prefix hash, LBGR's unit."""

from __future__ import annotations

from collections import Counter

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.routing.cache_affinity import CacheAffinityPolicy
from kvrouterd.policies.routing.dynamo import DynamoPolicy
from kvrouterd.sim.engine import EngineParams
from kvrouterd.sim.policy_specs import profiled_spec

from .helpers import BLOCK, complete, make_router, prompt, request


# ---- dynamo -----------------------------------------------------------------------------
def _dynamo_pair(spec: dict):  # type: ignore[no-untyped-def]
    """Router with a and b; one 320-token request (256 shared + 64 own) in flight on home."""
    router, clock = make_router({"name": "dynamo", **spec}, ["a", "b"])
    first = router.route(request(prompt(1, 256, 0)))
    home = first.worker.id
    return router, first, home, "b" if home == "a" else "a"


def test_dynamo_cost_on_a_worked_example() -> None:
    # default.rs worker_logit: prefill_load_scale * max(0, raw_prefill - credit * overlap)
    # + decode_blocks, raw_prefill = (active prefill tokens + ISL) / block, decode_blocks =
    # active blocks + the request's blocks not already active there. Blocks of 16 tokens;
    # the new request (320 tokens, 20 blocks) shares 16 blocks with the one in flight on home.
    router, _, home, other = _dynamo_pair({})
    d = router.decide(request(prompt(1, 256, 1)))[0]
    terms = {c.worker_id: c.terms for c in d.candidates}
    # home: raw (320 in flight + 320) / 16 = 40, minus 16 cached = 24; decode 20 + 4 new = 24
    assert terms[home] == {"cost": 48.0, "prefill_blocks": 24.0, "decode_blocks": 24.0, "raw_prefill_blocks": 40.0}
    # other: raw 320 / 16 = 20, nothing cached; decode 0 + 20
    assert terms[other] == {"cost": 40.0, "prefill_blocks": 20.0, "decode_blocks": 20.0, "raw_prefill_blocks": 20.0}
    assert (d.worker_id, d.reason) == (other, "min_cost")


def test_dynamo_releases_load_at_completion_and_follows_the_cache() -> None:
    router, first, home, _ = _dynamo_pair({})
    complete(router, first.request.request_id)
    policy = router.routing_policy()
    assert isinstance(policy, DynamoPolicy) and policy.active_blocks(home) == 0
    d = router.decide(request(prompt(1, 256, 1)))[0]
    # home: 320 / 16 - 16 cached = 4, plus 20 blocks; other: 20 + 20
    assert d.worker_id == home and d.attributes["cost"] == 24.0


def test_dynamo_without_kv_reuse_counts_shared_active_blocks_twice() -> None:
    router, _, home, _ = _dynamo_pair({"assume_kv_reuse": False})
    terms = {c.worker_id: c.terms for c in router.decide(request(prompt(1, 256, 1)))[0].candidates}
    assert terms[home]["decode_blocks"] == 40.0  # 20 active + all 20 of the request


def test_dynamo_softmax_temperature_samples_by_range_normalised_cost() -> None:
    router, _, home, other = _dynamo_pair({"router_temperature": 1.0})
    counts = Counter(router.decide(request(prompt(1, 256, 1)))[0].worker_id for _ in range(3000))
    # costs 48 (home) and 40 normalise to 1 and 0: P(other) = 1 / (1 + e^-1) = 0.731
    assert counts[other] / 3000 == pytest.approx(0.731, abs=0.03)


def test_dynamo_equal_costs_break_ties_at_random() -> None:
    router, _ = make_router({"name": "dynamo"}, ["a", "b", "c"])
    picks = Counter(router.decide(request(prompt(9, 256, 0)))[0].worker_id for _ in range(600))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 150


# ---- llm_d ------------------------------------------------------------------------------
def test_llm_d_picks_the_highest_weighted_score() -> None:
    router, _ = make_router({"name": "llm_d"}, ["w0", "w1", "w2"])
    placed = request(prompt(3, 256, 0))
    placed.candidate_workers = ("w0",)
    complete(router, router.route(placed).request.request_id)  # w0 now holds the whole prompt
    router.report_load("w0", 4, 8, 0.9)
    router.report_load("w1", 0, 2, 0.5)
    router.report_load("w2", 2, 4, 0.0)
    d = router.decide(request(prompt(3, 256, 0)))[0]
    totals = {c.worker_id: c.score for c in d.candidates}
    # queue (max - q) / (max - min) * 2 + (1 - kv) * 2 + matched / prompt blocks * 3
    assert totals == pytest.approx({"w0": 0 + 0.2 + 3.0, "w1": 2.0 + 1.0 + 0, "w2": 1.0 + 2.0 + 0})
    assert (d.worker_id, d.reason) == ("w0", "max_score")
    # without the prefix scorer, w1 and w2 tie at 3.0 and the picker draws between them
    router2, _ = make_router({"name": "llm_d", "prefix_weight": 0.0}, ["w0", "w1", "w2"])
    for wid, q, kv in (("w0", 4, 0.9), ("w1", 0, 0.5), ("w2", 2, 0.0)):
        router2.report_load(wid, q, 1, kv)
    picks = Counter(router2.decide(request(prompt(3, 256, 0)))[0].worker_id for _ in range(400))
    assert set(picks) == {"w1", "w2"} and min(picks.values()) > 150


def test_llm_d_prefix_score_reads_only_the_prompts_first_256_blocks() -> None:
    # llm-d hashes at most maxPrefixBlocksToMatch = 256 blocks (approximateprefix/types.go,
    # hashing.go): a worker holding a long prompt's first 256 blocks scores 1 like one holding
    # all of it, and the load scorers decide between them
    def run(spec: dict) -> tuple[str, dict[str, float]]:
        router, _ = make_router({"name": "llm_d", **spec}, ["w0", "w1", "w2"])
        for wid, suffix in (("w0", 0), ("w1", 1)):  # 256 shared blocks + 128 own blocks each
            placed = request(prompt(5, 256 * BLOCK, suffix, 128 * BLOCK))
            placed.candidate_workers = (wid,)
            complete(router, router.route(placed).request.request_id)
        for wid, kv in (("w0", 0.0), ("w1", 0.4), ("w2", 1.0)):
            router.report_load(wid, 0, 1, kv)
        d = router.decide(request(prompt(5, 256 * BLOCK, 1, 128 * BLOCK)))[0]
        return d.worker_id, {c.worker_id: c.terms["prefix_score"] for c in d.candidates}

    # w0: 2 + 2 * 1.0 + 3 * 1; w1: 2 + 2 * 0.6 + 3 * 1
    assert run({}) == ("w0", {"w0": 1.0, "w1": 1.0, "w2": 0.0})
    # the whole prompt read (384 blocks): w0 holds 256 of them, 2 + 2 + 3 * 2/3 < 2 + 1.2 + 3
    worker, prefix = run({"max_prefix_blocks": 0})
    assert worker == "w1" and prefix == pytest.approx({"w0": 0.6667, "w1": 1.0, "w2": 0.0})


def test_llm_d_equal_queues_all_score_one() -> None:
    router, _ = make_router({"name": "llm_d"}, ["a", "b"])
    d = router.decide(request(prompt(4, 128, 0)))[0]
    assert all(c.terms["queue_score"] == 1.0 for c in d.candidates)


# ---- cache_affinity ---------------------------------------------------------------------
def test_cache_affinity_places_a_cold_prompt_by_its_prefix_hash_whatever_the_load() -> None:
    router, _ = make_router({"name": "cache_affinity"}, ["a", "b", "c", "d"])
    policy = router.routing_policy()
    assert isinstance(policy, CacheAffinityPolicy)
    for group in range(12):
        d = router.decide(request(prompt(20 + group, 1024, 0)))[0]
        assert d.reason == "prefix_hash"
        # the same 1024-token prefix with any suffix: the same worker, even with nothing cached
        assert {router.decide(request(prompt(20 + group, 1024, s)))[0].worker_id for s in range(1, 6)} == {d.worker_id}
        # load does not move it: pile requests of other prefixes on that worker first
        for i in range(3):
            busy = request(prompt(500 + group * 10 + i, 512, 0))
            busy.candidate_workers = (d.worker_id,)
            router.route(busy)
        assert router.decide(request(prompt(20 + group, 1024, 9)))[0].worker_id == d.worker_id


def test_cache_affinity_a_shared_system_prompt_shorter_than_the_key_does_not_pull_everything() -> None:
    # every conversation opens with the same 512 tokens (32 blocks, the key is 64): once one
    # worker caches them, a new conversation is still placed by its own key's hash
    router, _ = make_router({"name": "cache_affinity"}, ["a", "b", "c", "d"])
    first = router.route(request(prompt(40, 512, 0, 1024)))
    picks = [router.route(request(prompt(40, 512, s, 1024))).decision for s in range(1, 25)]
    assert {d.reason for d in picks} == {"prefix_hash"} and len({d.worker_id for d in picks}) > 2
    # the next turn of a conversation holds its whole key where it went: it follows it there
    again = router.route(request(prompt(40, 512, 0, 1024) + list(range(90_000, 90_064)))).decision
    assert (again.worker_id, again.reason) == (first.worker.id, "longest_prefix")


def test_cache_affinity_least_loaded_variant_spreads_cold_prompts() -> None:
    router, _ = make_router({"name": "cache_affinity", "cold_placement": "least_loaded"}, ["a", "b"])
    first = router.route(request(prompt(30, 1024, 0)))
    d = router.decide(request(prompt(31, 1024, 0)))[0]
    assert (d.reason, d.worker_id) == ("cold_least_loaded", "b" if first.worker.id == "a" else "a")


# ---- lbgr: one time unit ----------------------------------------------------------------
def _lbgr_run(spec: dict) -> list[tuple[str, float]]:
    """Decisions of LBGR on a fixed script of routes and completions (slow TTFTs on w0)."""
    router, clock = make_router({"name": "lbgr", **spec}, ["w0", "w1", "w2"])
    out = []
    for i in range(40):
        res = router.route(request(prompt(i % 5, 512, i, 64 + 16 * (i % 3))))
        out.append((res.worker.id, round(res.decision.estimated_ttft_ms, 6)))
        clock.advance(0.05)
        ttft = 2000.0 if res.worker.id == "w0" else 60.0 + 10 * (i % 4)
        complete(router, res.request.request_id, ttft_ms=ttft, e2e_ms=ttft + 500)
    return out


@pytest.mark.parametrize("variant", [{}, {"features": ["hit", "miss", "load", "bias"], "residual_target": "signed"}])
def test_lbgr_decisions_do_not_depend_on_the_unit_of_its_alphas(variant: dict) -> None:
    # the paper's unit (1000 per 1k uncached tokens) and the same model written per second
    # (1 per 1k): with the engines' speed known, every term is in ms and nothing changes
    paper = _lbgr_run({**variant, "engine_ms_per_1k": 40.0})
    seconds = _lbgr_run({**variant, "engine_ms_per_1k": 40.0, "alpha_miss_ms_per_1k": 1.0})
    assert [w for w, _ in paper] == [w for w, _ in seconds]
    assert [e for _, e in paper] == pytest.approx([e for _, e in seconds])
    assert paper[-1][1] > 0 and {w for w, _ in paper} != {"w0"}


def test_lbgr_without_a_profile_reads_the_unit_as_ms_and_its_scale_changes_decisions() -> None:
    # the published router's literal reading: 1000 per 1k is 1 ms per token, so Cost + P
    # dwarfs the observed TTFT and the floored residual never steers; at 1 per 1k it does
    literal = _lbgr_run({})
    small = _lbgr_run({"alpha_miss_ms_per_1k": 1.0})
    assert [w for w, _ in literal] != [w for w, _ in small]


# ---- parameters and fair knowledge ------------------------------------------------------
@pytest.mark.parametrize(
    "spec,field",
    [({"name": "dynamo", "overlap_score_credit": 1.5}, "overlap_score_credit"),
     ({"name": "dynamo", "router_temperature": -1}, "router_temperature"),
     ({"name": "llm_d", "queue_weight": -1}, "queue_weight"),
     ({"name": "llm_d", "max_prefix_blocks": -1}, "max_prefix_blocks"),
     ({"name": "cache_affinity", "cold_placement": "nearest"}, "cold_placement"),
     ({"name": "cache_aware", "match_rule": "longest"}, "match_rule"),
     ({"name": "lbgr", "engine_ms_per_1k": 40.0, "alpha_miss_ms_per_1k": 0.0}, "alpha_miss_ms_per_1k")],
)
def test_bad_parameters_fail_naming_the_field(spec: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        registry.build("routing", spec)


def test_simulated_runs_give_every_time_estimating_policy_the_same_fixed_profile() -> None:
    engine = EngineParams(prefill_model="linear", prefill_ms_per_1k_tokens=55.0)
    for name in ("min_ttft", "preble", "dualmap"):
        spec = profiled_spec("routing", {"name": name}, engine, BLOCK)
        assert spec["calibrate"] is False and spec["prefill_ms_per_1k_tokens"] == 55.0
    # a spec that asks for the online fit keeps it
    assert profiled_spec("routing", {"name": "min_ttft", "calibrate": True}, engine, BLOCK)["calibrate"] is True
    # LBGR stays in the paper's unit (policy_specs says why); the peers estimate no time
    for name in ("lbgr", "dynamo", "llm_d", "cache_aware", "cache_affinity"):
        assert profiled_spec("routing", {"name": name}, engine, BLOCK) == {"name": name}
