"""random, round_robin, least_loaded and cache_aware (SGLang semantics)."""

from __future__ import annotations

import random

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies import registry
from kvrouterd.policies.base import RoutingContext
from kvrouterd.protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings

BS = 16


def fleet(policy, n=3):
    router = Router(RouterSettings(block_size=BS, routing=policy), ManualClock(), random.Random(3))
    for i in range(n):
        router.add_worker(WorkerSpec(f"w{i}", f"h{i}:1", mode=CacheMode.EVENTS))
    return router


def prompt(router, tokens):
    return RouteRequest("", router.keys_for_tokens(tokens), len(tokens))


def cache(router, wid, tokens, seq=0):
    router.apply(EventBatch(wid, seq, (Stored(tuple(tokens), None),)))


def test_round_robin_cycles_and_only_advances_on_dispatch():
    router = fleet({"name": "round_robin"})
    picked = [router.route(prompt(router, list(range(32)))).worker.id for _ in range(6)]
    assert picked == ["w0", "w1", "w2", "w0", "w1", "w2"]
    # decide() is a dry run: it must not move the cursor
    router.decide(prompt(router, list(range(32))))
    assert router.route(prompt(router, list(range(32)))).worker.id == "w0"


def test_random_is_reproducible_under_a_seed_and_covers_workers():
    a, b = fleet({"name": "random"}), fleet({"name": "random"})
    pa = [a.route(prompt(a, list(range(32)))).worker.id for _ in range(30)]
    pb = [b.route(prompt(b, list(range(32)))).worker.id for _ in range(30)]
    assert pa == pb and set(pa) == {"w0", "w1", "w2"}


def test_least_loaded_picks_fewest_pending_prefill_tokens():
    router = fleet({"name": "least_loaded"})
    router.route(prompt(router, list(range(4000))))  # w0: 4000 tokens
    router.route(prompt(router, list(range(100))))  # w1: 100 tokens
    assert router.route(prompt(router, list(range(2000)))).worker.id == "w2"
    assert router.route(prompt(router, list(range(50)))).worker.id == "w1"


def test_least_loaded_breaks_ties_by_inflight_then_reported_queue_then_slot():
    router = fleet({"name": "least_loaded"}, 4)
    held = list(range(4 * BS))
    cache(router, "w0", held)
    # w0 holds the whole prompt: one request in flight there, no prefill pending
    first = router.route(prompt(router, held))
    assert first.worker.id == "w0" and first.worker.pending_prefill_tokens == 0
    router.report_load("w1", 3, 0, 0.0)  # w1's engine has three requests queued
    # no prefill pending anywhere else: w0 has a request in flight, w1 a queue; w2 then w3
    picked = [router.route(prompt(router, list(range(9000 + i, 9100 + i)))).worker.id for i in range(2)]
    assert picked == ["w2", "w3"]
    # w2 and w3 now prefill: of w0 and w1 (none pending), fewer in flight wins over a shorter queue
    assert router.route(prompt(router, list(range(500, 600)))).worker.id == "w1"


def test_cache_aware_prefers_the_prefix_holder_above_the_threshold():
    router = fleet({"name": "cache_aware", "cache_threshold": 0.5})
    tokens = list(range(10 * BS))
    cache(router, "w2", tokens[: 6 * BS])  # 60% match
    d = router.route(prompt(router, tokens)).decision
    assert d.worker_id == "w2" and d.reason == "prefix_match" and d.attributes["match_rate"] == 0.6


def test_cache_aware_below_threshold_goes_to_least_loaded():
    # SGLang's approximate-tree rule (no KV events): the match rate must clear the threshold
    router = fleet({"name": "cache_aware", "cache_threshold": 0.5, "match_rule": "threshold"})
    tokens = list(range(10 * BS))
    cache(router, "w2", tokens[: 4 * BS])  # 40%: not enough
    router.route(prompt(router, list(range(9000, 9100))))  # load w0 with one request
    d = router.route(prompt(router, tokens)).decision
    # w1 and w2 are idle and were sent nothing: SGLang's min_load_idx takes the lower index
    assert d.reason == "low_match" and d.worker_id == "w1"


def test_cache_aware_with_engine_events_follows_any_overlap():
    # SGLang's event-driven rule (select_worker_event_driven): the most cached blocks win
    # whatever the match rate; with none anywhere, the least loaded
    router = fleet({"name": "cache_aware", "cache_threshold": 0.5})
    tokens = list(range(10 * BS))
    cache(router, "w2", tokens[: 4 * BS])  # 40%: below the threshold, still the holder
    d = router.route(prompt(router, tokens)).decision
    assert (d.worker_id, d.reason, d.attributes["match_rule"]) == ("w2", "prefix_match", "overlap")
    cold = router.route(prompt(router, list(range(50_000, 50_000 + 4 * BS)))).decision
    assert (cold.worker_id, cold.reason) == ("w0", "no_overlap")


def test_cache_aware_auto_rule_follows_a_worker_re_registered_in_another_cache_mode():
    # the rule is worked out once per candidate list: a worker whose cache is now modelled
    # (approximate) makes the fleet's rule SGLang's approximate-tree threshold, at once
    router = fleet({"name": "cache_aware"})
    tokens = list(range(10 * BS))
    assert router.decide(prompt(router, tokens))[0].attributes["match_rule"] == "overlap"
    router.add_worker(WorkerSpec("w1", "h1:1", mode=CacheMode.APPROXIMATE))
    assert router.decide(prompt(router, tokens))[0].attributes["match_rule"] == "threshold"


def test_cache_aware_auto_rule_is_worked_out_per_list_when_two_lists_alternate():
    # a disaggregated Route decides its decode hop and its prefill hop over two lists in turn
    router = fleet({"name": "cache_aware"}, n=4)
    router.add_worker(WorkerSpec("w1", "h1:1", mode=CacheMode.APPROXIMATE))
    policy = registry.build("routing", {"name": "cache_aware"})
    _, ctx, _ = router.decide(prompt(router, list(range(10 * BS))))
    workers = sorted(router.workers, key=lambda w: w.slot)
    events = [w for w in workers if w.mode is CacheMode.EVENTS]

    def rule(candidates):
        narrowed = RoutingContext(ctx.request, candidates, ctx.match, BS, ctx.now, ctx.index)
        return policy.select(narrowed).attributes["match_rule"]

    assert [rule(lst) for lst in (events, workers, events, workers, [workers[1]], events)] == [
        "overlap", "threshold", "overlap", "threshold", "threshold", "overlap"]


def test_cache_aware_min_load_ties_go_to_the_worker_sent_fewer_requests():
    router = fleet({"name": "cache_aware", "match_rule": "threshold"})
    picks = [router.route(prompt(router, list(range(i * 1000, i * 1000 + 2 * BS)))) for i in range(3)]
    for res in picks:  # all complete: equal load again, but w0..w2 were each sent one
        router.complete_anywhere(Completion(request_id=res.request.request_id, ttft_ms=1.0, e2e_ms=2.0))
    router.route(prompt(router, list(range(9000, 9000 + 2 * BS))))  # w0: 1 in flight, 2 sent
    res = router.route(prompt(router, list(range(8000, 8000 + 2 * BS))))
    assert res.worker.id == "w1" and res.decision.reason == "low_match"


def test_cache_aware_spreads_an_idle_fleets_cold_requests_by_requests_sent():
    # every worker idle between requests: each cold one goes to the worker sent the fewest, the
    # lowest slot among equals (SGLang's min_load_idx), over a fleet past the explained bound too
    for n in (3, 40):
        router = fleet({"name": "cache_aware"}, n=n)
        picked = []
        for i in range(2 * n + 1):
            res = router.route(prompt(router, list(range(i * 1000, i * 1000 + 2 * BS))))
            router.complete_anywhere(Completion(request_id=res.request.request_id, ttft_ms=1.0, e2e_ms=2.0))
            picked.append(res.worker.id)
        assert picked == [f"w{i % n}" for i in range(2 * n + 1)]


def test_cache_aware_counts_requests_sent_through_membership_changes_and_reloads():
    # the count of requests sent is per worker: one that leaves and registers again starts from
    # none (and catches up first), and a policy rebuilt by a reload counts afresh
    router = fleet({"name": "cache_aware"}, n=3)

    def cold(i):
        res = router.route(prompt(router, list(range(i * 1000, i * 1000 + 2 * BS))))
        router.complete_anywhere(Completion(request_id=res.request.request_id, ttft_ms=1.0, e2e_ms=2.0))
        return res.worker.id

    assert [cold(i) for i in range(6)] == ["w0", "w1", "w2"] * 2
    router.remove_worker("w1")
    router.add_worker(WorkerSpec("w1", "h1:1", mode=CacheMode.EVENTS))
    assert router.workers.get("w1").slot == 1  # its slot again, a new Worker
    assert [cold(i) for i in range(6, 10)] == ["w1", "w1", "w0", "w1"]
    assert router.reload_routing({"name": "cache_aware", "balance_abs_threshold": 31}) == ["cache_aware"]
    assert [cold(i) for i in range(10, 16)] == ["w0", "w1", "w2"] * 2


def test_cache_aware_imbalance_overrides_affinity():
    router = fleet({"name": "cache_aware", "balance_abs_threshold": 2, "balance_rel_threshold": 1.5})
    tokens = list(range(10 * BS))
    cache(router, "w0", tokens)
    picks = [router.route(prompt(router, tokens)).decision for _ in range(6)]
    assert [p.worker_id for p in picks[:3]] == ["w0"] * 3  # spread 0..2 is not yet > 2
    assert picks[3].reason == "imbalanced" and picks[3].worker_id != "w0"


def test_decisions_list_candidates_only_when_explained():
    router = fleet({"name": "cache_aware"})
    d, _, _ = router.decide(prompt(router, list(range(64))), explain=True)
    assert [c.worker_id for c in d.candidates] == ["w0", "w1", "w2"] and "load" in d.candidates[0].terms
    quiet, _, _ = router.decide(prompt(router, list(range(64))), explain=False)
    assert quiet.candidates == [] and quiet.worker_id == d.worker_id


def test_cache_aware_decides_alike_explained_or_not():
    # unexplained decisions (every untraced Route) take a shorter path through the policy: the
    # choice must be the one the traced path makes, on all three of its rules
    rng = random.Random(11)
    reasons = set()
    for trial in range(60):
        rule = ("threshold", "overlap")[trial % 2]
        router = fleet({"name": "cache_aware", "balance_abs_threshold": 3, "match_rule": rule}, n=rng.randint(1, 8))
        tokens = list(range(trial * 1000, trial * 1000 + 20 * BS))
        for w in range(len(router.workers)):
            depth = rng.choice((0, 0, 3, 8, 14, 20))
            if depth:
                cache(router, f"w{w}", tokens[: depth * BS])
        for _ in range(rng.randint(0, 12)):  # load, unevenly: other prompts sent to w0 or w1
            req = prompt(router, [rng.randrange(10**6) for _ in range(2 * BS)])
            req.candidate_workers = (f"w{rng.randrange(min(2, len(router.workers)))}",)
            router.route(req)
        loud, _, _ = router.decide(prompt(router, tokens), explain=True)
        quiet, _, _ = router.decide(prompt(router, tokens), explain=False)
        assert (quiet.worker_id, quiet.reason, quiet.overlap_blocks, quiet.policy) == (
            loud.worker_id, loud.reason, loud.overlap_blocks, loud.policy)
        assert set(loud.attributes) == {"match_rate", "imbalanced", "match_rule"}
        assert len(loud.candidates) == len(router.workers)
        reasons.add(loud.reason)
    assert reasons == {"prefix_match", "low_match", "no_overlap", "imbalanced"}


def test_registry_params_reach_the_policy():
    policy = registry.build("routing", {"name": "cache_aware", "load_metric": "prefill_tokens"})
    assert policy.params.load_metric == "prefill_tokens"


def test_cache_aware_overlap_ties_go_to_the_smaller_cache_however_many_tie():
    # score_overlap: the most cached blocks, then the lower load, then the smaller cache, then the
    # lower index; ties are found by repeated scans up to a few, then by one pass: same answer
    tokens = list(range(6 * BS))
    for holders in (2, 5, 12, 20):
        router = fleet({"name": "cache_aware"}, n=24)
        rng = random.Random(holders)
        tying = sorted(rng.sample(range(24), holders))
        for seq, i in enumerate(tying):
            cache(router, f"w{i}", tokens)
        extra = {i: rng.randrange(0, 3) for i in tying}  # unrelated blocks: the cache sizes differ
        for i, n in extra.items():
            for k in range(n):
                cache(router, f"w{i}", list(range(10_000 * (i + 1) + 100 * k, 10_000 * (i + 1) + 100 * k + BS)),
                      seq=1 + k)
        smallest = min(tying, key=lambda i: (extra[i], i))
        d = router.decide(prompt(router, tokens), explain=False)[0]
        assert (d.worker_id, d.reason) == (f"w{smallest}", "prefix_match"), (holders, extra)
