"""Every routing x eviction pair of the one policy registry runs in the simulator, with the
simulated path's full machinery on (bounded caches, the daemon's admission queue, engine load
reports, batched decoding beside prefill), and every routing policy can score DualMap's
candidate pair through ``compose``, built from the same config the daemon reads.

The pairs iterate ``registry.names``: a newly registered policy is covered without editing
this file, and one that breaks the simulator's invariants fails here by name."""

from __future__ import annotations

import pytest

from kvrouterd.config import Config
from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.sim.cluster import ClusterSettings, Simulation, simulate
from kvrouterd.sim.engine import EngineParams
from kvrouterd.sim.policy_specs import policy_spec
from kvrouterd.sim.workloads import build_workload

CAPACITY = 160
REQUESTS = 24


def _workload():
    # UniCache's balanced mix: sessions (chat, agentic) and single-turn templated requests, so
    # session- and task-aware policies (T-LRU, UniCache, LBGR's features) get their inputs
    return build_workload("mix2", seed=3, rate=20.0, requests=REQUESTS)


def _settings(**kw) -> ClusterSettings:
    engine = EngineParams(capacity_blocks=CAPACITY, decode_model="batched", tpot_ms=5.0, max_running=8)
    return ClusterSettings(workers=3, engine=engine, slo_ms=2000.0, load_report_interval_s=0.05,
                           admission_max_inflight=4, **kw)


class _Checked(Simulation):
    """After every engine step and completion: no engine over capacity, and the router's view
    of each worker's cache equals that engine's cache (event-driven mode)."""

    checks = 0

    def _check(self) -> None:
        for engine in self.engines:
            assert engine.cached_blocks + engine.reserved <= CAPACITY
            slot = self.router.workers.get(engine.worker_id).slot
            assert {b.key for b in self.router.index.blocks_of(slot)} == engine.held_keys()
        self.checks += 1

    def _step_done(self, i, now):
        super()._step_done(i, now)
        self._check()

    def _finish(self, i, job, now, **kw):
        super()._finish(i, job, now, **kw)
        self._check()


@pytest.mark.parametrize("eviction", registry.names("eviction"))
@pytest.mark.parametrize("routing", registry.names("routing"))
def test_every_routing_eviction_pair_runs_to_completion(routing, eviction):
    wl = _workload()
    sim = _Checked(Config(), wl, _settings(), routing=routing, eviction=eviction, seed=1)
    result = sim.run()
    assert (result.routing, result.eviction) == (routing, eviction)
    assert result.summary.requests == len(wl.requests) and result.counters["unfinished"] == 0
    assert all(r.ttft_s >= 0 and r.e2e_s >= r.ttft_s for r in result.records)
    assert sim.checks > len(wl.requests)
    # the bound binds: this is the eviction policy choosing, not an unbounded cache
    assert sum(e.evicted_blocks for e in sim.engines) > 0


@pytest.mark.parametrize("scorer", [n for n in registry.names("routing") if n != "compose"])
def test_every_routing_policy_scores_dualmaps_pair_from_the_daemons_config(scorer):
    # the config shape the daemon loads: routing: {name: compose, candidates: dualmap, scorer: ...}
    cfg = Config(routing={"name": "compose", "candidates": "dualmap", "scorer": scorer})
    result = simulate(cfg, _workload(), _settings(), routing=policy_spec(cfg, "routing", "compose"), eviction="lru",
                      seed=2)
    assert result.routing == "compose"
    assert result.summary.requests == REQUESTS and result.counters["unfinished"] == 0


def test_compose_refuses_a_candidate_policy_that_cannot_restrict():
    cfg = Config(routing={"name": "compose", "candidates": "lbgr", "scorer": "min_ttft"})
    with pytest.raises(ConfigError, match="does not restrict candidates"):
        cfg.validate()  # what the daemon runs on its config file before serving
