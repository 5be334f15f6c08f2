"""Router replicas that share no state agree on DualMap's candidate pairs (docs/operations/replicas.md)."""

from __future__ import annotations

import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, RouteRequest
from kvrouterd.router import Router, RouterSettings

BS = 16


# A prompt cached nowhere goes to the fleet's best worker by each replica's own load view
# (dualmap's default cold_placement: fleet), so replicas agree on pairs only with the
# paper's pair placement
PAIRED = {"name": "dualmap", "cold_placement": "pair"}


def replica(order: list[str], seed: int, routing: dict | None = None) -> Router:
    router = Router(RouterSettings(block_size=BS, routing=dict(routing or PAIRED)), ManualClock(), random.Random(seed))
    for wid in order:
        router.add_worker(WorkerSpec(id=wid, address=f"{wid}:8000", mode=CacheMode.APPROXIMATE))
    return router


def pair(router: Router, prompt: list[int]) -> frozenset[str]:
    decision, _, _ = router.decide(RouteRequest(request_id="", keys=router.keys_for_tokens(prompt), prompt_tokens=len(prompt)))
    return frozenset({decision.worker_id, decision.alternative_worker_id})


@pytest.mark.parametrize("routing", [PAIRED, {"name": "dualmap_paper"}])
def test_replicas_with_the_same_workers_pick_the_same_pairs_whatever_their_history(routing: dict):
    ids = [f"gpu-{i}" for i in range(8)]
    a = replica(ids, seed=1, routing=routing)
    b = replica(list(reversed(ids)), seed=99, routing=routing)  # other registration order (other slots), other seed
    rng = random.Random(5)
    prompts = [[rng.randrange(50_000) for _ in range(64 * BS)] for _ in range(40)]
    # replica a has routed (and so loaded and cached) half the prompts; b has seen nothing
    for p in prompts[::2]:
        a.route(RouteRequest(request_id="", keys=a.keys_for_tokens(p), prompt_tokens=len(p)))
    pairs_a = [pair(a, p) for p in prompts]
    assert pairs_a == [pair(b, p) for p in prompts]
    assert all(len(x) == 2 for x in pairs_a)
    assert len(set(pairs_a)) > 5  # the prompts spread over many pairs


def test_a_membership_change_remaps_only_keys_of_the_removed_worker():
    ids = [f"gpu-{i}" for i in range(8)]
    a, b = replica(ids, seed=1), replica(ids, seed=2)
    b.remove_worker("gpu-3")
    rng = random.Random(6)
    prompts = [[rng.randrange(50_000) for _ in range(64 * BS)] for _ in range(60)]
    for p in prompts:
        before, after = pair(a, p), pair(b, p)
        if "gpu-3" not in before:
            assert before == after
