"""What the simulated engines charge (issue #27 item 6): attention over earlier context,
hardware speed, and capacity measured on a rate grid."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvrouterd.cli import main
from kvrouterd.config import Config
from kvrouterd.policies.latency import LLAMA31_8B_ATTENTION_TOKENS
from kvrouterd.sim.cluster import ClusterSettings, Simulation
from kvrouterd.sim.engine import PER_CHUNK, EngineParams
from kvrouterd.sim.metrics import goodput, parse_rates, rate_grid
from kvrouterd.sim.reproduce import expand
from kvrouterd.sim.workloads import SimRequest, Workload, build_workload

BS = 64


def _alone(requests: list[SimRequest], engine: EngineParams) -> list:
    """Records of ``requests`` on one worker with an unbounded cache."""
    sim = Simulation(Config(), Workload("t", BS, requests), ClusterSettings(workers=1, engine=engine),
                     routing="round_robin", eviction="lru")
    return sim.run().records


def test_a_long_prompt_pays_attention_to_its_earlier_chunks_and_a_hit_to_its_prefix():
    engine = EngineParams(**dict(PER_CHUNK, attention_context_tokens=LLAMA31_8B_ATTENTION_TOKENS))
    cost, chunk = engine.prefill_cost, engine.max_batch_tokens
    long_prompt = 312 * BS  # 19,968 tokens: chunks of 8,192, 8,192 and 3,584
    first = SimRequest(0.0, long_prompt, 1, tuple(range(312)))
    # long after: the same 250 blocks (16,000 tokens) then 62 of its own
    second = SimRequest(100.0, long_prompt, 1, (*range(250), *range(1000, 1062)))
    a, b = _alone([first, second], engine)
    chunks = [(chunk, 0), (chunk, chunk), (long_prompt - 2 * chunk, 2 * chunk)]
    assert a.ttft_s * 1000.0 == pytest.approx(sum(cost.ms(n, 1, n * before) for n, before in chunks), rel=1e-12)
    assert b.hit_blocks == 250
    new = 62 * BS
    assert b.ttft_s * 1000.0 == pytest.approx(cost.ms(new, 1, new * 250 * BS), rel=1e-12)
    # per-chunk pricing charges neither
    flat = _alone([first, second], EngineParams(**PER_CHUNK))
    assert flat[1].ttft_s * 1000.0 == pytest.approx(cost.ms(new), rel=1e-12)
    assert a.ttft_s > flat[0].ttft_s and b.ttft_s > flat[1].ttft_s


@pytest.mark.parametrize("decode_model", ["batched", "constant"])
def test_hardware_speed_divides_every_compute_time(decode_model):
    # requests far apart, so no queueing: every time is compute, and twice the speed halves it
    reqs = [SimRequest(10.0 * i, 3000 + 700 * i, 40, tuple(range(i * 100, i * 100 + 50))) for i in range(4)]
    slow = EngineParams(decode_model=decode_model)
    fast = dataclasses.replace(slow, hardware_speed=2.0)
    for s, f in zip(_alone(reqs, slow), _alone(reqs, fast)):
        assert f.ttft_s == pytest.approx(s.ttft_s / 2, rel=1e-12) and f.e2e_s == pytest.approx(s.e2e_s / 2, rel=1e-12)
    assert fast.step_seconds(5000, 2, 1e7) == pytest.approx(slow.step_seconds(5000, 2, 1e7) / 2, rel=1e-12)
    assert fast.decode_step_seconds(9) == pytest.approx(slow.decode_step_seconds(9) / 2, rel=1e-12)


def test_routers_profile_the_engines_speed_and_context_cost():
    engine = EngineParams(hardware_speed=4.0)
    sim = Simulation(Config(), build_workload("gsp", 0, 10.0, groups=2, queries_per_group=2), ClusterSettings(
        workers=2, engine=engine), routing="min_ttft", eviction="lru")
    model = sim.router.routing_policy("min_ttft").latency
    assert model.params.attention_context_tokens == engine.attention_context_tokens
    assert model.params.prefill_chunk_tokens == engine.max_batch_tokens
    for tokens, batch, attended in ((5000, 3, 0.0), (8192, 1, 8192 * 40_000.0)):
        assert model.prefill_ms(tokens, batch, attended) == pytest.approx(
            engine.step_seconds(tokens, batch, attended) * 1000.0, rel=1e-12)


def test_new_defaults_and_flags_that_restore_the_old_pricing():
    d = EngineParams()
    assert (d.decode_model, d.decode_kv, d.hardware_speed) == ("batched", True, 1.0)
    assert d.decode_batch_slope == 0.02 and d.attention_context_tokens == LLAMA31_8B_ATTENTION_TOKENS
    with pytest.raises(ValueError, match="hardware_speed"):
        EngineParams(hardware_speed=0.0).validate()
    with pytest.raises(ValueError, match="attention_context_tokens"):
        EngineParams(attention_context_tokens=-1.0).validate()


def test_cli_flags_reach_the_engines(capsys):
    old = ["--attention-context-tokens", "0", "--decode-model", "constant", "--decode-batch-slope", "0",
           "--no-decode-kv"]
    rc = main(["sim", "cluster", "--workload", "gsp", "--workload-param", "groups=2", "--workload-param",
               "queries_per_group=2", "--workers", "1", "--routing", "round_robin", "--eviction", "lru", "--quiet",
               "--json", "--hardware-speed", "3", *old])
    assert rc == 0
    engine = json.loads(capsys.readouterr().out)["meta"]["engine"]
    assert engine == dataclasses.asdict(EngineParams(hardware_speed=3.0, **PER_CHUNK))


# ---- capacity in 0.5 req/s steps ----------------------------------------------------------

def test_rate_grids_parse_to_exact_steps():
    assert rate_grid(14, 16, 0.5) == [14.0, 14.5, 15.0, 15.5, 16.0]
    assert rate_grid(0.1, 0.3, 0.1) == [0.1, 0.2, 0.3]  # no float drift past the end
    assert parse_rates("4,14:15:0.5,15") == [4.0, 14.0, 14.5, 15.0]
    for bad in ("1:2", "a", "3:1:0.5", "1:2:0"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    # capacity is the highest grid rate still >= 90%: 0.5 req/s resolution from a 0.5 grid
    points = list(zip(rate_grid(14, 16, 0.5), [0.99, 0.95, 0.91, 0.89, 0.7]))
    assert goodput(points) == 15.0


def test_sim_cluster_sweeps_a_grid_and_reports_capacity_on_it(capsys):
    rc = main(["sim", "cluster", "--workload", "gsp", "--workload-param", "groups=3", "--workload-param",
               "queries_per_group=4", "--rate", "2:3:0.5", "--workers", "1", "--routing", "round_robin",
               "--eviction", "lru", "--quiet", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted({r["rate"] for r in doc["aggregate"]}) == [2.0, 2.5, 3.0]
    assert doc["goodput_rps"]["round_robin+lru"] in (0.0, 2.0, 2.5, 3.0)
    with pytest.raises(SystemExit):  # argparse names the flag and the bad grid
        main(["sim", "cluster", "--workload", "gsp", "--rate", "2:3", "--quiet"])
    assert "LO:HI:STEP" in capsys.readouterr().err


def test_reproduce_rows_can_sweep_a_grid():
    units = expand("--workload gsp --workers 1 --rate 14:16:0.5 --routing cache_aware,lbgr --eviction lru", Path("."))
    assert sorted({u.rate for u in units}) == [14.0, 14.5, 15.0, 15.5, 16.0]
    assert len(units) == 10
