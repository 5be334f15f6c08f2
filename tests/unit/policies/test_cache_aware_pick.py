"""cache_aware's pick in one native pass (``cache_aware_pick``) chooses as its reference.

``CacheAwarePolicy.select`` of a decision nobody reads the record of, with the KV-use triggers
off, runs natively where the extension is built; ``_select_py`` is the reference. Over a
fleet's life (prompts sharing prefixes stored by engines, load from Routes in flight, a
worker drained now and then) and every match rule and load metric, with thresholds that make
the fleet imbalanced often, the native pick must name the worker, reason and overlap the
reference names, keep the same choice for ``on_dispatch``, and decline only what it must.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.routing import cache_aware
from kvrouterd.protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

BS = 16


def picked(decision: Any) -> tuple[Any, ...]:
    return decision.worker_id, decision.policy, decision.reason, decision.overlap_blocks, decision.candidates, \
        decision.attributes


@pytest.mark.parametrize("rule", ["auto", "overlap", "threshold"])
@pytest.mark.parametrize("load_metric", ["requests", "prefill_tokens"])
def test_the_native_pick_chooses_as_the_reference(rule: str, load_metric: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(f"{rule}-{load_metric}")
    params = {"name": "cache_aware", "match_rule": rule, "load_metric": load_metric, "balance_abs_threshold": 2,
              "balance_rel_threshold": 1.2, "cache_threshold": 0.5}
    router = Router(RouterSettings(block_size=BS, routing=params), ManualClock(), random.Random(1))
    for i in range(10):  # one approximate worker among events ones: "auto" reads the threshold rule
        mode = CacheMode.APPROXIMATE if rule == "auto" and i == 9 and rng.random() < 0.5 else CacheMode.EVENTS
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=mode))
    policy = router.routing_policy("cache_aware")
    native_pick = native.module.cache_aware_pick
    seen: dict[str, int] = {}
    declined = 0

    def counted(*args: Any) -> Any:
        nonlocal declined
        out = native_pick(*args)
        declined += out is NotImplemented
        return out

    monkeypatch.setattr(cache_aware, "_cache_aware_pick", counted)
    prefixes = [[rng.randrange(10**6) for _ in range(BS * rng.randrange(1, 8))] for _ in range(6)]
    sequence = dict.fromkeys((w.id for w in router.workers), 0)
    in_flight: list[str] = []
    for _ in range(500):
        roll = rng.random()
        if roll < 0.2:  # an engine stores a prefix (or part of it)
            worker = rng.choice(list(sequence))
            prefix = rng.choice(prefixes)
            tokens = prefix[:BS * rng.randrange(1, len(prefix) // BS + 1)]
            router.apply(EventBatch(worker, sequence[worker], (Stored(tuple(tokens), None, None),)))
            sequence[worker] += 1
        elif roll < 0.45 and in_flight:
            router.complete(Completion(in_flight.pop(rng.randrange(len(in_flight)))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(10**6) for _ in range(BS * rng.randrange(0, 3))]
            req = RouteRequest("", router.keys_for_tokens(tokens), len(tokens))
            decision, ctx, _ = router.decide(req, explain=False)
            chosen = policy._chosen
            assert picked(decision) == picked(policy._select_py(ctx))
            assert policy._chosen is chosen
            seen[decision.reason] = seen.get(decision.reason, 0) + 1
            in_flight.append(router.commit(decision, ctx, policy).request.request_id)
    # every branch the rule has ran natively: the load spread, and the cache's own reasons
    assert declined == 0
    reasons = {"auto": {"imbalanced"}, "overlap": {"imbalanced", "prefix_match", "no_overlap"},
               "threshold": {"imbalanced", "prefix_match", "low_match"}}[rule]
    assert reasons <= set(seen), seen


def test_what_the_native_pick_does_not_read_it_leaves_to_the_reference() -> None:
    router = Router(RouterSettings(block_size=BS, routing={"name": "cache_aware"}), ManualClock(), random.Random(1))
    for i in range(3):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=CacheMode.EVENTS))
    policy = router.routing_policy("cache_aware")
    _, ctx, _ = router.decide(RouteRequest("", router.keys_for_tokens(list(range(2 * BS))), 2 * BS), explain=False)
    before = policy._chosen = None
    args = (True, 64.0, 1.5, 0.3, "inflight_requests", cache_aware._new_decision, "cache_aware")
    router.workers.get("w1").inflight_requests = 2**60  # a load past what a float holds exactly
    assert native.module.cache_aware_pick(policy, ctx, *args) is NotImplemented
    assert policy._chosen is before
    router.workers.get("w1").inflight_requests = 0
    assert native.module.cache_aware_pick(policy, ctx, *args[:4], 7, *args[5:]) is NotImplemented  # no load name
    ctx.candidates = tuple(ctx.candidates)  # not the router's list
    assert native.module.cache_aware_pick(policy, ctx, *args) is NotImplemented
    assert policy._chosen is before
    ctx.candidates = list(ctx.candidates)
    decision = native.module.cache_aware_pick(policy, ctx, *args)
    assert decision.reason == "no_overlap" and policy._chosen is router.workers.get(decision.worker_id)
