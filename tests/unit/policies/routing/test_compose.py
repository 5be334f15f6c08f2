"""compose: one policy's candidates (DualMap's pair), another's choice (LBGR, min-TTFT)."""

from __future__ import annotations

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.routing.compose import ComposePolicy

from .helpers import complete, make_router, prompt, request


def _compose(router) -> ComposePolicy:  # type: ignore[no-untyped-def]
    policy = router.routing_policy()
    assert isinstance(policy, ComposePolicy)
    return policy


def test_the_scorer_chooses_only_within_dualmaps_pair() -> None:
    router, _ = make_router({"name": "compose"}, 8)
    policy = _compose(router)
    for i in range(40):
        req = request(prompt(i, 1024, i, 64))
        d, ctx, _ = router.decide(req)
        pair = policy.restrict.candidate_ids(ctx)
        assert len(pair) == 2 and d.worker_id in pair
        assert d.policy == "compose" and d.attributes["scorer"] == "lbgr"
        assert sorted(d.attributes["candidates"].split(",")) == sorted(pair)
        # LBGR scored exactly the pair, and picked the lower estimate of the two
        assert {c.worker_id for c in d.candidates} == set(pair)
        estimate = {c.worker_id: c.terms["estimate_ms"] for c in d.candidates}  # rounded to 1 us
        assert estimate[d.worker_id] == pytest.approx(min(estimate.values()), abs=2e-3)
        complete(router, router.commit(d, ctx, policy).request.request_id)


def test_both_policies_hear_dispatch_and_completion() -> None:
    router, clock = make_router({"name": "compose"}, 4)
    policy = _compose(router)
    res = router.route(request(prompt(1, 512, 0, 0)))
    # LBGR charged its queue load, DualMap its latency model
    assert policy.scorer.load(res.worker.id, clock.now()) == pytest.approx(512.0)
    assert policy.restrict.latency.pending_tokens(res.worker, clock.now()) == 512
    complete(router, res.request.request_id, ttft_ms=40.0)
    assert policy.scorer.load(res.worker.id, clock.now()) == pytest.approx(0.0)


def test_hot_prefix_stays_on_its_pair_while_lbgr_balances_within_it() -> None:
    router, _ = make_router({"name": "compose"}, 8)
    chosen = {router.route(request(prompt(7, 1024, i, 256))).worker.id for i in range(30)}
    assert 1 <= len(chosen) <= 2  # never outside the prefix's two candidates


@pytest.mark.parametrize(
    "spec,match",
    [({"scorer": "compose"}, "compose itself"), ({"candidates": "lbgr"}, "does not restrict"),
     ({"scorer": "nope"}, "unknown routing policy 'nope'"), ({"scorer_params": {"decay_rho": 2}}, "decay_rho")],
)
def test_bad_compositions_fail_naming_the_part(spec: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        registry.build("routing", {"name": "compose", **spec})


def test_min_ttft_can_score_the_pair() -> None:
    router, _ = make_router({"name": "compose", "scorer": "min_ttft"}, 4)
    d = router.route(request(prompt(3, 512, 0, 64))).decision
    assert d.attributes["scorer"] == "min_ttft" and len(d.candidates) == 2


def test_described_defaults_are_the_real_ones() -> None:
    described = {name: default for name, default, _ in registry.describe("routing", "compose")}
    assert described == {"candidates": "dualmap", "scorer": "lbgr", "candidates_params": {}, "scorer_params": {}}
