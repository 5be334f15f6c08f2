"""An explained decision over a big fleet lists a bounded, telling few of its candidates."""

from __future__ import annotations

import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.base import EXPLAINED_CANDIDATES
from kvrouterd.protocols import CacheMode, EventBatch, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings

BS = 16
TOKENS = list(range(20 * BS))


def fleet(policy: dict, n: int) -> Router:
    router = Router(RouterSettings(block_size=BS, routing=policy), ManualClock(), random.Random(5))
    for i in range(n):
        router.add_worker(WorkerSpec(f"w{i}", f"h{i}:1", mode=CacheMode.EVENTS))
    return router


def cache(router: Router, worker_id: str, blocks: int) -> None:
    router.apply(EventBatch(worker_id, 0, (Stored(tuple(TOKENS[: blocks * BS]), None),)))


def prompt(router: Router) -> RouteRequest:
    return RouteRequest("", router.keys_for_tokens(TOKENS), len(TOKENS))


def load(router: Router, worker_id: str, requests: int) -> None:
    for _ in range(requests):
        req = RouteRequest("", router.keys_for_tokens([random.randrange(10**6) for _ in range(2 * BS)]), 2 * BS,
                           candidate_workers=(worker_id,))
        router.route(req)


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded", "random", "round_robin", "dynamo", "llm_d",
                                    "kv_cost", "min_ttft", "cache_affinity", "preble", "lbgr"])
def test_past_the_bound_a_decision_lists_the_chosen_the_deepest_holders_and_the_least_loaded(policy):
    router = fleet({"name": policy}, 40)
    holders = {f"w{i}": 1 + i % 7 for i in range(3, 40, 4)}  # ten workers hold 1-7 blocks of the prompt
    for wid, blocks in holders.items():
        cache(router, wid, blocks)
    load(router, "w0", 3)
    d, ctx, _ = router.decide(prompt(router), explain=True)
    listed = [c.worker_id for c in d.candidates]
    assert d.candidate_count == 40 and len(listed) == EXPLAINED_CANDIDATES
    assert d.worker_id in listed
    assert listed == sorted(listed, key=lambda w: int(w[1:]))  # candidate (registration) order
    for wid in holders:  # ten holders and the chosen fit: every holder is listed
        assert wid in listed
    assert "w0" not in listed or d.worker_id == "w0"  # the only loaded worker comes last among the rest
    quiet, _, _ = router.decide(prompt(router), explain=False)
    assert quiet.candidates == [] and quiet.candidate_count == 40


def test_dualmap_lists_its_pair_out_of_a_big_fleet():
    router = fleet({"name": "dualmap"}, 40)
    cache(router, "w7", 20)
    d, _, _ = router.decide(prompt(router), explain=True)
    assert d.candidate_count == 40 and len(d.candidates) == 2 and d.worker_id in [c.worker_id for c in d.candidates]


def test_the_deepest_holders_win_the_places_when_more_workers_hold_the_prompt_than_are_listed():
    router = fleet({"name": "least_loaded"}, 40)
    for i in range(40):
        cache(router, f"w{i}", 1 + i % 20)  # w19 and w39 hold all 20 blocks, w18 and w38 19, ...
    d, ctx, _ = router.decide(prompt(router), explain=True)
    chosen = ctx.candidates[[w.id for w in ctx.candidates].index(d.worker_id)]
    listed = {w.id for w in ctx.explained(chosen)}
    deepest = {f"w{i}" for i in range(40) if 1 + i % 20 >= 14}  # the 14 deepest: 20 down to 14 blocks, two each
    assert len(listed) == EXPLAINED_CANDIDATES and deepest <= listed and d.worker_id in listed


def test_up_to_the_bound_every_candidate_is_listed():
    router = fleet({"name": "dynamo"}, EXPLAINED_CANDIDATES)
    d, _, _ = router.decide(prompt(router), explain=True)
    assert [c.worker_id for c in d.candidates] == [f"w{i}" for i in range(EXPLAINED_CANDIDATES)]
    assert d.candidate_count == EXPLAINED_CANDIDATES


def test_listing_fewer_never_changes_the_choice():
    def build(trial: int) -> Router:  # the same fleet, and the same seed for policies that break ties at random
        rng = random.Random(trial)
        router = fleet({"name": rng.choice(["cache_aware", "dynamo", "llm_d", "least_loaded"])}, rng.randint(10, 60))
        for i in range(len(router.workers)):
            if rng.random() < 0.3:
                cache(router, f"w{i}", rng.randint(1, 20))
        return router

    for trial in range(30):
        loud, _, _ = build(trial).decide(prompt(build(trial)), explain=True)
        quiet, _, _ = build(trial).decide(prompt(build(trial)), explain=False)
        assert (loud.worker_id, loud.reason, loud.overlap_blocks) == (quiet.worker_id, quiet.reason, quiet.overlap_blocks)
        assert loud.worker_id in [c.worker_id for c in loud.candidates]



def test_dualmap_places_a_cold_prompt_alike_explained_or_not():
    """A cold placement prices the whole fleet: the record sorts every view, an unrecorded
    decision keeps the best two; both choose the same worker and the same alternative."""
    router = fleet({"name": "dualmap"}, 40)
    for wid, requests in (("w0", 3), ("w1", 1), ("w5", 2), ("w6", 1)):
        load(router, wid, requests)  # routed to each by name: their prefill is pending there
    idle = ["w2", "w3", "w4", "w7", "w8", "w9"]
    for n in range(5):
        tokens = [10**6 + 100 * n + t for t in range(4 * BS)]  # a prompt nobody holds
        req = RouteRequest("", router.keys_for_tokens(tokens), len(tokens))
        explained, _, _ = router.decide(req, explain=True)
        quiet, _, _ = router.decide(req, explain=False)
        assert explained.reason == quiet.reason == "cold_fleet"
        assert (quiet.worker_id, quiet.alternative_worker_id) == (explained.worker_id, explained.alternative_worker_id)
        # an idle worker's TTFT is the prompt's own prefill: the lowest idle slot, then the next
        assert (quiet.worker_id, quiet.alternative_worker_id) == (idle[n], idle[n + 1])
        assert router.route(req).worker.id == idle[n]  # in flight there now: the next moves on
