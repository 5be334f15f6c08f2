"""The P/D simulator (issue #31 item 5): prefill and decode engine pools with a KV transfer,
routed by the daemon's Router in each mode, deterministic, every request finishing, and the
hops' costs where the model puts them."""

from __future__ import annotations

import random

import pytest

from kvrouterd.cli import main
from kvrouterd.config import Config
from kvrouterd.errors import ConfigError
from kvrouterd.protocols import WorkerRole
from kvrouterd.sim.cluster import ClusterSettings
from kvrouterd.sim.engine import EngineParams
from kvrouterd.sim.pd import PdSettings, PdSimulation, compare, markdown, row
from kvrouterd.sim.workloads import SimRequest, Workload, long_chat

PD = PdSettings(prefill_workers=1, decode_workers=2)


def chat(seed: int = 0, rate: float = 2.0) -> Workload:
    return long_chat(random.Random(seed), rate=rate, conversations=12, max_turns=4, user_tokens=600,
                     output_tokens=40, turn_gap_s=2.0, block_tokens=64)


def sim(mode: str, wl: Workload, local: int | None = None, pd: PdSettings = PD, **thresholds: int) -> PdSimulation:
    if local is not None:
        thresholds["local_prefill_max_uncached_tokens"] = local
    return PdSimulation(Config(), wl, ClusterSettings(engine=EngineParams()), pd, mode, routing="cache_aware",
                        eviction="lru", seed=1, thresholds=thresholds)


@pytest.mark.parametrize("mode", ["aggregated", "always", "conditional"])
def test_every_mode_finishes_every_request_and_releases_all_load(mode: str) -> None:
    s = sim(mode, chat())
    r = row(s, mode, 2.0, 1)
    assert r["requests"] == len(s.workload.requests) and r["unfinished"] == 0
    assert s.router.workers.inflight_count == 0
    assert all(w.pending_prefill_tokens == 0 for w in s.router.workers)
    roles = {w.spec.role for w in s.router.workers}
    assert roles == ({WorkerRole.BOTH} if mode == "aggregated" else {WorkerRole.PREFILL, WorkerRole.DECODE})
    if mode == "always":
        assert r["remote_share"] == 1.0 and r["transfer_p50_ms"] > 1.0
    if mode == "aggregated":
        assert r["remote_share"] == 0.0


def test_conditional_prefills_follow_up_turns_locally_once_the_decode_engine_holds_the_history() -> None:
    s = sim("conditional", chat(), local=1024)
    row(s, "conditional", 2.0, 1)
    # first turns (600 new tokens) are under the threshold too; the 1024 threshold keeps every
    # turn whose history the decode engine received local, so some took each path
    assert s.reasons["decode_cached"] > 0
    big = sim("conditional", chat(), local=64)
    row(big, "conditional", 2.0, 1)
    assert big.reasons["remote_prefill"] > s.reasons["remote_prefill"]


def test_the_busy_thresholds_reach_the_router() -> None:
    # a 1-token decode budget leaves no room for any local prefill; without the prefill-busy
    # rule a request bypasses the prefill hop only for a short uncached part
    tight = sim("conditional", chat(), local=1024, decode_busy_tokens=1)
    row(tight, "conditional", 2.0, 1)
    assert tight.router.settings.disaggregation.decode_busy_tokens == 1
    assert tight.reasons["decode_cached"] == 0 and tight.reasons["decode_busy"] > 0
    # at 100 req/s the one prefill engine has a queue when most requests arrive
    off = sim("conditional", chat(rate=100.0), local=64, prefill_busy_tokens=0)
    row(off, "conditional", 100.0, 1)
    assert off.router.settings.disaggregation.prefill_busy_tokens == 0 and off.reasons["prefill_saturated"] == 0
    busy = sim("conditional", chat(rate=100.0), local=64, prefill_busy_tokens=1)
    row(busy, "conditional", 100.0, 1)
    assert busy.reasons["prefill_saturated"] > 0
    with pytest.raises(ConfigError, match="decode_busy_tokens"):
        sim("conditional", chat(), decode_busy_tokens=-1)


def test_the_transfer_costs_what_the_link_says() -> None:
    wl = Workload("one", 64, [SimRequest(0.0, 64 * 40, 8, tuple(range(40)))])
    fast, slow = PdSettings(1, 1, link_gbps=1000.0), PdSettings(1, 1, link_gbps=10.0)
    a, b = sim("always", wl, pd=fast), sim("always", wl, pd=slow)
    ra, rb = row(a, "always", 0, 1), row(b, "always", 0, 1)
    tokens = 64 * 40
    assert ra["transfer_p50_ms"] == pytest.approx(fast.transfer_seconds(tokens) * 1000)
    assert rb["transfer_p50_ms"] == pytest.approx(1.0 + tokens * 131072 * 8 / 10e9 * 1000)
    assert rb["ttft_p50_ms"] - ra["ttft_p50_ms"] == pytest.approx(rb["transfer_p50_ms"] - ra["transfer_p50_ms"], rel=1e-6)


def test_same_seed_same_table() -> None:
    def table() -> str:
        rows = compare(Config(), lambda seed, rate: chat(seed), ClusterSettings(), PD, routing={"name": "cache_aware"},
                       eviction={"name": "lru"}, rates=[None], seeds=[0], local_tokens=[512],
                       settings_for=lambda wl: ClusterSettings())
        return markdown(rows, "t")
    first = table()
    assert first == table()
    assert [line.split("|")[1].strip() for line in first.splitlines()[4:]] == ["aggregated", "always", "conditional@512"]


def test_busy_thresholds_sweep_as_a_product_named_in_the_labels() -> None:
    rows = compare(Config(), lambda seed, rate: chat(seed), ClusterSettings(), PD, routing={"name": "cache_aware"},
                   eviction={"name": "lru"}, rates=[None], seeds=[0], local_tokens=[512],
                   settings_for=lambda wl: ClusterSettings(), prefill_busy_tokens=[0, 4096], decode_busy_tokens=[1])
    assert [r["mode"] for r in rows] == ["aggregated", "always", "conditional@512,prefill_busy=off,decode_busy=1",
                                         "conditional@512,prefill_busy=4096,decode_busy=1"]
    # no room on any decode engine: every conditional request takes the prefill hop
    assert all(r["remote_share"] == 1.0 for r in rows[2:])


def test_bad_pd_settings_fail() -> None:
    with pytest.raises(ConfigError):
        PdSettings(0, 2).validate()
    with pytest.raises(ConfigError):
        sim("sometimes", chat())


def test_the_cli_compares_the_modes_and_writes_a_plot(tmp_path, capsys) -> None:
    code = main(["sim", "cluster", "--quiet", "--workload", "longchat", "--workload-param", "conversations=8",
                 "--workload-param", "max_turns=3", "--workload-param", "output_tokens=20", "--limit", "30",
                 "--pd", "1:2", "--pd-local-tokens", "256", "--pd-prefill-busy-tokens", "0,65536",
                 "--pd-decode-busy-tokens", "8192", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| aggregated |" in out and "| always |" in out
    assert "| conditional@256,prefill_busy=off,decode_busy=8192 |" in out
    assert "| conditional@256,prefill_busy=65536,decode_busy=8192 |" in out
    assert (tmp_path / "pd.png").stat().st_size > 0 and (tmp_path / "results.json").exists()
