"""cache_aware's requests-sent counts kept by slot (``_processed_by_slot``) for the native tie-break.

The counts by id are the truth; the copy by slot is read only where the slot's owner is the
candidate itself. Over a fleet's life (Routes that tie everywhere, workers removed and
re-registered, workers moved to a fresh slot when they clear a big cache) the copy must agree
with the truth wherever it is read, and the tie-break must choose as the reference does.
"""

from __future__ import annotations

import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies._scan import fewest_counted_at_load, fewest_counted_at_load_py
from kvrouterd.protocols import CacheMode, Cleared, Completion, Decision, EventBatch, RouteRequest
from kvrouterd.router import Router, RouterSettings

BS = 16


def _kept_copy_agrees(policy) -> int:  # type: ignore[no-untyped-def]
    """Asserts the copy by slot equals the count by id wherever it names an owner; returns how many do."""
    owned = 0
    for slot, owner in enumerate(policy._processed_owner):
        if owner is not None:
            assert policy._processed_by_slot[slot] == policy._processed.get(owner.id, 0), (slot, owner.id)
            owned += 1
    return owned


@pytest.mark.skipif(native.module is None, reason=native.status)
@pytest.mark.parametrize("seed", range(6))
def test_the_copy_by_slot_agrees_with_the_counts_and_the_tie_break_with_the_reference(seed, monkeypatch):
    from kvrouterd.router import slots

    monkeypatch.setattr(slots, "CLEAR_IN_PLACE_BLOCKS", -1)  # every clear moves its worker to a fresh slot
    rng = random.Random(seed)
    router = Router(RouterSettings(block_size=BS, routing={"name": "cache_aware"}), ManualClock(), random.Random(seed))
    policy = router.routing_policy("cache_aware")
    names = [f"w{i}" for i in range(12)]
    for name in names[:8]:
        router.add_worker(WorkerSpec(name, f"{name}:1", mode=CacheMode.EVENTS))
    sequence = dict.fromkeys(names, 0)
    inflight: list[str] = []
    seen = {"moved": 0, "readded": 0, "hops": 0, "from_copy": 0}
    for step in range(400):
        registered = sorted(w.id for w in router.workers)
        roll = rng.random()
        if roll < 0.05 and len(registered) > 3:
            router.remove_worker(rng.choice(registered))  # its requests in flight go with it
            inflight = [r for r in inflight if router.workers.inflight_worker(r) is not None]
        elif roll < 0.10:
            free = [n for n in names if n not in registered]
            if free:
                router.add_worker(WorkerSpec(rng.choice(free), "re:1", mode=CacheMode.EVENTS))
                seen["readded"] += 1
        elif roll < 0.15:
            victim = rng.choice(registered)
            before = router.workers.get(victim).slot
            router.apply(EventBatch(victim, sequence[victim], (Cleared(),)))
            sequence[victim] += 1
            seen["moved"] += router.workers.get(victim).slot != before
        elif roll < 0.20:
            # a disaggregated request's prefill hop: dispatched to a worker this policy's last
            # select did not choose (``LoadLedger.commit_prefill_hop`` calls the hook so)
            hop = rng.choice(registered)
            _, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens([step] * BS), BS), explain=False)
            if policy._chosen is not None and policy._chosen.id != hop:
                policy.on_dispatch(Decision(hop, "cache_aware", "prefill", []), ctx)
                seen["hops"] += 1
        elif roll < 0.45 and inflight:
            router.complete(Completion(inflight.pop(rng.randrange(len(inflight)))))
        else:
            tokens = [rng.randrange(10**6) for _ in range(2 * BS)]  # cached nowhere: the least loaded, by count
            req = RouteRequest("", router.keys_for_tokens(tokens), len(tokens))
            decision, ctx, _ = router.decide(req, explain=False)
            args = (ctx.candidates, ctx.match.overlaps, "inflight_requests", 0,
                    min(w.inflight_requests for w in ctx.candidates), policy._processed)
            expected = fewest_counted_at_load_py(*args)
            assert fewest_counted_at_load(*args, ctx.candidate_slots, policy._processed_by_slot,
                                          policy._processed_owner) == expected
            assert fewest_counted_at_load(*args, ctx.candidate_slots) == expected
            if decision.reason == "no_overlap":
                assert decision.worker_id == ctx.candidates[expected].id
            inflight.append(router.route(req).request.request_id)
        seen["from_copy"] += _kept_copy_agrees(policy) > 0
    assert seen["moved"] >= 3 and seen["readded"] >= 3 and seen["hops"] >= 3 and seen["from_copy"] >= 300, seen


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_the_native_tie_break_reads_the_copy_only_where_its_owner_is_the_candidate():
    router = Router(RouterSettings(block_size=BS, routing={"name": "cache_aware"}), ManualClock(), random.Random(1))
    for i in range(4):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=CacheMode.EVENTS))
    req = RouteRequest("", router.keys_for_tokens(list(range(2 * BS))), 2 * BS)
    _, ctx, _ = router.decide(req, explain=False)
    candidates, slots, walked = ctx.candidates, ctx.candidate_slots, ctx.match.overlaps
    fewest = native.module.fewest_counted_at_load
    counts = {"w0": 3, "w1": 1, "w2": 2, "w3": 1}
    by_slot = __import__("array").array("q", [3, 1, 2, 1])
    owners = list(candidates)
    assert fewest(candidates, walked, "inflight_requests", 0, 0, counts, slots, by_slot, owners) == 1
    by_slot[1] = 9  # a copy the caller let go stale is read where its owner is the candidate ...
    assert fewest(candidates, walked, "inflight_requests", 0, 0, counts, slots, by_slot, owners) == 3
    owners[1] = None  # ... and looked up by id where it is not
    assert fewest(candidates, walked, "inflight_requests", 0, 0, counts, slots, by_slot, owners) == 1
    owners[1] = candidates[2]
    assert fewest(candidates, walked, "inflight_requests", 0, 0, counts, slots, by_slot, owners[:2]) == 1  # short lists
    with pytest.raises(TypeError):
        fewest(candidates, walked, "inflight_requests", 0, 0, counts, slots, __import__("array").array("i", [0]), owners)
    with pytest.raises(TypeError):
        fewest(candidates, walked, "inflight_requests", 0, 0, counts, slots, by_slot, None)
