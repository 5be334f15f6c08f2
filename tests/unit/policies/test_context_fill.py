"""The router's own decisions build their RoutingContext without ``__init__``
(``base.fill_routing_context``, given ``claimed or NONE_CLAIMED`` and ``match.overlaps``): the
context must be the one ``__init__`` builds, member by member, and answer alike, or a policy
would see another overlap, other claims or other candidates' slots."""

from __future__ import annotations

import random
from array import array

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.base import CONTEXT_MEMBERS, NONE_CLAIMED, RoutingContext, fill_routing_context
from kvrouterd.protocols import RouteRequest
from kvrouterd.router import Router, RouterSettings

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)


def test_the_filled_context_is_the_one_init_builds() -> None:
    assert fill_routing_context is not None
    assert sorted(CONTEXT_MEMBERS) == sorted(RoutingContext.__slots__)  # every member, each once
    rng = random.Random(4)
    router = Router(RouterSettings(block_size=16), ManualClock())
    for i in range(6):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1"))
    workers = sorted(router.workers, key=lambda w: w.slot)
    keys = array("Q", range(1, 41))
    for i, w in enumerate(workers):
        router.index.store(w.slot, None, list(keys[:i * 6]), 0.0)
    for _ in range(200):
        candidates = rng.sample(workers, rng.randrange(1, len(workers) + 1))
        match = router.index.match(keys, sum(1 << w.slot for w in candidates))
        req = RouteRequest("r", keys, rng.randrange(1, 700))
        claimed = rng.choice((None, {}, {workers[rng.randrange(6)].slot: rng.randrange(0, 4)}))
        args = (req, candidates, match, 16, rng.random(), router.index, rng.random() < 0.5)
        slots = rng.choice((None, object()))
        built = RoutingContext(*args, claimed, slots)
        filled = fill_routing_context(*args, slots, claimed or NONE_CLAIMED, match.overlaps)
        assert type(filled) is RoutingContext
        for name in RoutingContext.__slots__:
            assert getattr(filled, name) is getattr(built, name), name
        for w in workers:
            assert (filled.overlap(w), filled.uncached_tokens(w)) == (built.overlap(w), built.uncached_tokens(w))
