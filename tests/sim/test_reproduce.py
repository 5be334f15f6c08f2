"""`kvrouterd sim reproduce`: the experiment list is well-formed, the verdict rules say what
docs/results.md says they do, and a quick run reports the same numbers `sim cluster` gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvrouterd.cli import main
from kvrouterd.config import Config
from kvrouterd.sim.cluster import ClusterSettings, simulate
from kvrouterd.sim.engine import EngineParams
from kvrouterd.sim.experiments import ROWS, Measure, Row, parse_goal, parse_tolerance, verdict
from kvrouterd.sim.reproduce import QUICK_REQUESTS, expand
from kvrouterd.sim.workloads import build_workload


def _row(**kw) -> Row:
    base = dict(name="r", section="0", figure="f", claim="c", run="--workload gsp",
                ours=Measure("hit_pct", ("a+lru",)), versus=Measure("hit_pct", ("b+lru",)), compare="ratio")
    base.update(kw)
    return Row(**base)


def test_verdicts_follow_the_documented_order():
    row = _row(paper=2.0, goal=">=1.2", tolerance="25%")
    assert verdict(row, 2.5) == "reproduced"  # within 25% of 2.0 beats everything
    assert verdict(row, 1.5) == "reproduced"
    assert verdict(row, 1.2) == "goal met"
    assert verdict(row, 9.0) == "goal met"
    assert verdict(row, 1.1) == "direction only"
    assert verdict(row, 1.0) == "not reproduced"  # no effect is not the paper's direction
    assert verdict(row, 0.8) == "not reproduced"
    assert verdict(row, math.nan) == "not measured"
    lower = _row(compare="change", better="lower", paper=-23.9, goal="<=-15")
    assert verdict(lower, -19.0) == "reproduced"
    assert verdict(lower, -15.0) == "goal met"
    assert verdict(lower, -5.0) == "direction only"
    assert verdict(lower, 3.0) == "not reproduced"
    exact = _row(compare="value", versus=None, paper=4.18, tolerance="0.01")
    assert verdict(exact, 4.185) == "reproduced"
    assert verdict(exact, 4.3) == "not reproduced"
    combo = _row(compare="ratio", better="lower")
    assert verdict(combo, 0.9) == "wins"
    assert verdict(combo, 1.0) == "does not win"
    assert verdict(_row(compare="value", versus=None), 42.0) == "reference"


def test_goal_and_tolerance_parsing():
    assert parse_goal("") is None
    op, x = parse_goal(">= 1.5")
    assert x == 1.5 and op(1.5, x) and not op(1.49, x)
    op, x = parse_goal(">1")
    assert not op(1.0, x) and op(1.01, x)
    with pytest.raises(ValueError, match="expected"):
        parse_goal("=1")
    assert parse_tolerance("25%", -20.0) == 5.0
    assert parse_tolerance("0.01", 36.37) == 0.01


def test_every_row_is_well_formed_and_names_pairs_its_runs_make():
    assert len({r.name for r in ROWS}) == len(ROWS)
    traces = Path("/nonexistent")  # expanding parses and plans; nothing is read
    for row in ROWS:
        units = expand(row.run, traces)
        pairs = {u.pair for u in units}
        rates = {u.rate for u in units}
        for m in (row.ours, row.versus):
            if m is None:
                continue
            missing = set(m.pairs) - ({u.pair for u in expand(m.run, traces)} if m.run else pairs)
            assert not missing, f"{row.name}: {missing} not run by its command"
            if m.metric in ("goodput", "peak_good_rps"):
                assert len(rates) > 1, f"{row.name}: {m.metric} needs a rate sweep"
            elif m.rate is not None:
                assert m.rate in rates, f"{row.name}: rate {m.rate} not swept"
            else:
                assert len(rates) == 1, f"{row.name}: several rates and none named"
        parse_goal(row.goal)
        if row.paper is not None:
            parse_tolerance(row.tolerance, row.paper)


def test_every_trace_path_is_the_one_given(tmp_path):
    # the only file a row reads is the Mooncake trace; every command must name it through
    # {mooncake}, or the run fails (after everything else) on a literal path
    from kvrouterd.sim.reproduce import _tokens

    trace = tmp_path / "trace.jsonl"
    for row in ROWS:
        _, tokens = _tokens(row.run, trace)
        paths = [tokens[i + 1] for i, t in enumerate(tokens) if t == "--trace"]
        assert all(p == str(trace) for p in paths), f"{row.name}: {paths}"
        assert ("{mooncake}" in row.run) == bool(paths)


def test_runs_shared_by_rows_are_one_unit():
    by_name = {r.name: r for r in ROWS}
    a = expand(by_name["lbgr_gsp_ttft"].run, Path("."))
    b = expand(by_name["compose_gsp"].run, Path("."))
    shared = set(a) & set(b)
    # cache_aware and lbgr with lru and rlt at 36 req/s, 3 seeds: the same simulations
    assert len(shared) == 2 * 2 * 3
    quick = expand(by_name["lbgr_gsp_ttft"].run, Path("."), quick=True)
    assert {u.seed for u in quick} == {0}
    assert "--limit" in quick[0].base and str(QUICK_REQUESTS) in quick[0].base


def test_prefill_model_flag_reaches_every_cluster_run_and_the_report(tmp_path):
    by_name = {r.name: r for r in ROWS}
    default = expand(by_name["lbgr_gsp_ttft"].run, Path("."))
    linear = expand(by_name["lbgr_gsp_ttft"].run, Path("."), prefill_model="linear")
    assert all("--prefill-model" not in u.base for u in default)  # sim cluster's default: the power law
    assert all(u.base[-2:] == ("--prefill-model", "linear") for u in linear)
    assert set(default).isdisjoint(linear) and len(default) == len(linear)
    out = tmp_path / "rep"
    assert main(["sim", "reproduce", "--only", "tlru_p95_800", "--quick", "--quiet", "--prefill-model", "linear",
                 "--out", str(out)]) == 0
    assert "on the linear prefill cost model" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["meta"]["prefill_model"] == "linear"


def test_quick_run_reports_the_numbers_sim_cluster_gives(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["sim", "reproduce", "--only", "rlt_vs_lru_hit", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert printed == report
    line = next(x for x in report.splitlines() if x.startswith("| rlt_vs_lru_hit |"))
    doc = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in doc["rows"]] == ["rlt_vs_lru_hit"]
    row = doc["rows"][0]
    assert row["a_pair"] == "round_robin+rlt" and row["b_pair"] == "round_robin+lru"
    assert row["ours"] == pytest.approx(row["a"] - row["b"])
    assert row["verdict"] in line and row["verdict"] == verdict(
        next(r for r in ROWS if r.name == "rlt_vs_lru_hit"), row["ours"])
    # the same runs through sim cluster's own path
    settings = ClusterSettings(workers=1, engine=EngineParams(capacity_blocks=3000))
    for pair, key in (("round_robin+rlt", "a"), ("round_robin+lru", "b")):
        wl = build_workload("gsp", 0, 4.0, limit=QUICK_REQUESTS, order="round_robin", groups=64)
        res = simulate(Config(), wl, settings, routing="round_robin", eviction=pair.split("+")[1], seed=0, rate=4.0)
        assert 100 * res.summary.hit_ratio == pytest.approx(row[key])
    assert "**--quick**" in report
    # the run's table says what a block is: gsp's hold 64 tokens
    assert "KV cache 3,000 blocks of 64 tokens per worker." in report


def test_unknown_row_is_an_error_naming_it(capsys):
    assert main(["sim", "reproduce", "--only", "no_such_row"]) == 2
    assert "no_such_row" in capsys.readouterr().err


def test_goodput_rows_use_the_best_baseline(tmp_path):
    # a tiny sweep: the baseline measure must pick the best of several pairs
    from kvrouterd.sim.reproduce import Digest, Table, Unit

    def unit(pair: str, rate: float) -> Unit:
        r, e = pair.split("+")
        return Unit("cluster", (), json.dumps({"name": r}), json.dumps({"name": e}), rate, 0)

    def digest(slo_met: int) -> Digest:
        return Digest([0.1] * 10, 1, 2, slo_met, 10)

    att = {("a+lru", 1.0): 10, ("a+lru", 2.0): 10, ("b+lru", 1.0): 10, ("b+lru", 2.0): 5, ("c+lru", 1.0): 8,
           ("c+lru", 2.0): 3}
    units = [unit(p, r) for p, r in att]
    table = Table(units, {u: digest(att[(u.pair, u.rate)]) for u in units})
    assert table.goodput == {"a+lru": 2.0, "b+lru": 1.0, "c+lru": 0.0}
    from kvrouterd.sim.reproduce import evaluate

    row = _row(run="x", ours=Measure("goodput", ("a+lru",)), versus=Measure("goodput", ("b+lru", "c+lru")),
               paper=2.25, goal=">=1.5", unit="x")
    got = evaluate(row, {"x": table})
    assert got["b_pair"] == "b+lru" and got["ours"] == 2.0 and got["verdict"] == "reproduced"


def test_verdicts_judge_the_number_as_printed():
    from kvrouterd.sim.reproduce import Digest, Table, Unit, evaluate

    def unit(pair: str) -> Unit:
        r, e = pair.split("+")
        return Unit("cluster", (), json.dumps({"name": r}), json.dumps({"name": e}), None, 0)

    # medians 1003 ms and 1000 ms: a 1.003x ratio prints as 1.00x, a tie, not a win
    digests = {unit("a+lru"): Digest([1.003] * 5, 1, 2, 5, 5), unit("b+lru"): Digest([1.0] * 5, 1, 2, 5, 5)}
    table = Table(list(digests), digests)
    row = _row(run="x", ours=Measure("ttft_p50", ("a+lru",)), versus=Measure("ttft_p50", ("b+lru",)), goal=">1",
               unit="x")
    got = evaluate(row, {"x": table})
    assert got["ours"] == pytest.approx(1.003) and got["verdict"] == "not reproduced"


def test_cache_rows_replay_their_one_cache_size(tmp_path):
    # the single-cache LRU rows go through `sim cache`'s parser, whose --capacity-blocks is a list
    from kvrouterd.sim import cache as sim_cache

    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i, "input_length": 512 * 4, "output_length": 1, "hash_ids": [0, 1 + i % 3, 10 + i, 20 + i]}
            for i in range(300)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rep"
    assert main(["sim", "reproduce", "--only", "lru_cache_100", "--mooncake-trace", str(trace), "--out", str(out),
                 "--quiet"]) == 0
    doc = json.loads((out / "results.json").read_text())
    expected = sim_cache.replay(list(sim_cache.read_trace(trace)), "lru", 100)
    assert doc["rows"][0]["ours"] == pytest.approx(100 * expected.hit_ratio)
    assert 0 < expected.hit_ratio < 1


def test_shed_requests_count_as_missing_their_slo():
    """Deadline admission must not buy goodput by refusing requests: a refused request is a
    miss, as ``sim cluster`` counts it (10 served, all in time, plus 10 shed = 50%)."""
    from kvrouterd.sim.reproduce import Digest, Table, Unit

    units = [Unit("cluster", (), json.dumps({"name": "a"}), json.dumps({"name": "lru"}), r, 0) for r in (1.0, 2.0)]
    table = Table(units, {units[0]: Digest([0.1] * 10, 1, 2, 10, 10),
                          units[1]: Digest([0.1] * 10, 1, 2, 10, 10, shed=10)})
    assert table.cells[("a+lru", 2.0)]["slo_pct"] == pytest.approx(50.0)
    assert table.goodput == {"a+lru": 1.0}
