"""End to end through the core: a Router built from the YAML config schema with dualmap or lbgr."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.policies.routing.dualmap import DualMapPolicy
from kvrouterd.policies.routing.lbgr import LBGRPolicy
from kvrouterd.protocols import Completion
from kvrouterd.router import Router

from .helpers import BLOCK, prompt, request

CONFIG = {
    "block_size": BLOCK,
    "workers": [{"id": f"gpu-{i}", "address": f"10.0.0.{i}:8000", "capacity_blocks": 4000} for i in range(6)],
    "extra_routing": [{"name": "least_loaded"}],
}
POLICIES = {
    "dualmap": {"name": "dualmap", "segment_tokens": 128, "default_ttft_slo_ms": 2000},
    "lbgr": {"name": "lbgr", "decay_interval_s": 0.02, "target": "ttft"},
}


def _router(policy: str) -> tuple[Router, ManualClock]:
    cfg = parse_config({**CONFIG, "routing": POLICIES[policy]})
    clock = ManualClock(50.0)
    router = Router(cfg.router_settings(), clock, random.Random(3))
    for w in cfg.workers:
        router.add_worker(w.to_spec(cfg.block_size))
    return router, clock


@pytest.mark.parametrize("policy", ["dualmap", "lbgr"])
def test_configured_policy_routes_completes_and_returns_to_idle(policy: str) -> None:
    router, clock = _router(policy)
    rng = random.Random(9)
    inflight: list[str] = []
    workers_of_prefix: dict[int, set[str]] = defaultdict(set)
    for i in range(300):
        p = rng.randrange(15)
        res = router.route(request(prompt(p, 256, i, 64)))
        d = res.decision
        assert d.policy == policy and d.estimated_ttft_ms >= 0
        workers_of_prefix[p].add(res.worker.id)
        inflight.append(res.request.request_id)
        clock.advance(rng.choice((0.0, 0.005, 0.02)))
        router.tick()
        while len(inflight) > 8:
            rid = inflight.pop(rng.randrange(len(inflight)))
            router.complete(Completion(request_id=rid, ttft_ms=rng.uniform(20, 200), e2e_ms=rng.uniform(300, 900)))
    for rid in inflight:
        router.complete(Completion(request_id=rid, ttft_ms=80.0, e2e_ms=500.0))
    clock.advance(1.0)
    router.tick()
    assert router.counters["decisions"] == 300 and router.decisions_by_policy == {policy: 300}
    assert all(w.inflight_requests == 0 and w.pending_prefill_tokens == 0 for w in router.workers)
    instance = router.routing_policy()
    if policy == "dualmap":
        assert isinstance(instance, DualMapPolicy)
        # 15 prefixes at ~7% each are never hot for 6 workers (2/n = 33%): each stays in its pair
        assert all(len(ws) <= 2 for ws in workers_of_prefix.values())
        # the profiled prefill model, as in the paper: completions do not refit it
        assert not instance.latency.calibrated and instance.latency.samples == 0
    else:
        assert isinstance(instance, LBGRPolicy)
        assert all(instance.load(w.id, clock.now()) == pytest.approx(0.0, abs=1e-6) for w in router.workers)
    # a request may still name the other configured policy
    other = request(prompt(99, 256, 0))
    other.policy = "least_loaded"
    assert router.route(other).decision.policy == "least_loaded"


@pytest.mark.parametrize(
    "routing,field",
    [({"name": "dualmap", "slo_test": "maybe"}, "slo_test"), ({"name": "lbgr", "decay_rho": 2}, "decay_rho")],
)
def test_bad_policy_parameters_fail_config_validation(routing: dict, field: str) -> None:
    from kvrouterd.errors import ConfigError

    with pytest.raises(ConfigError, match=f"routing: .*{field}"):
        parse_config({**CONFIG, "routing": routing})
