"""Simulator output a reader can trust: every plot names its setting (the workload's --limit, and
the KV capacity with its block size in tokens), draws the SLO, uses the tables' units, starts
attainment at 0 with headroom above 100%, fits the rate axis to the rates swept and says the
route time is wall time; `sim cache --out` writes a table and a plot."""

from __future__ import annotations

import json

import pytest
from matplotlib.figure import Figure

from kvrouterd.cli import main


@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure the report saves, by file name, as (title, x label, y label, y limits, line labels)."""
    saved = {}
    original = Figure.savefig

    def capture(self, fname, *args, **kwargs):
        (ax,) = self.axes
        saved[str(fname).rsplit("/", 1)[-1]] = {
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(), "ylim": ax.get_ylim(),
            "xlim": ax.get_xlim(),
            "labels": [line.get_label() for line in ax.get_lines()],
        }
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", capture)
    return saved


def test_cluster_plots_name_the_setting_draw_the_slo_and_use_the_tables_units(tmp_path, capsys, saved_figures):
    rc = main(["sim", "cluster", "--workload", "gsp", "--workload-param", "groups=4",
               "--workload-param", "queries_per_group=5", "--rate", "10,40", "--limit", "15", "--workers", "2",
               "--routing", "round_robin", "--eviction", "lru", "--capacity-blocks", "100", "--slo-ms", "250",
               "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    assert set(saved_figures) == {"ttft_cdf_rate10.png", "ttft_cdf_rate40.png", "attainment_vs_rate.png",
                                  "hit_ratio_vs_rate.png"}
    for name, fig in saved_figures.items():
        # gsp's blocks hold 64 tokens: the capacity says so, and the title says only 15 requests ran
        assert "gsp (first 15 requests), 2 workers\nKV cache 100 blocks of 64 tokens per worker" in fig["title"], name
        # lines at 100% stay clear of the frame
        assert fig["ylim"] == (0, 105), name
    cdf = saved_figures["ttft_cdf_rate10.png"]
    assert cdf["xlabel"] == "TTFT (ms)" and "TTFT SLO 250 ms" in cdf["labels"]
    attainment = saved_figures["attainment_vs_rate.png"]
    assert attainment["ylabel"] == "SLO attainment (%)"
    assert any("250 ms TTFT SLO" in label for label in attainment["labels"])
    for name in ("attainment_vs_rate.png", "hit_ratio_vs_rate.png"):
        # the rate axis spans the rates swept, 10 to 40 req/s, not 0 to 40
        assert saved_figures[name]["xlim"] == (8.5, 41.5), name

    table = capsys.readouterr().out
    assert table.startswith("gsp (first 15 requests), 2 workers, KV cache 100 blocks of 64 tokens per worker\n")
    assert "route us (wall)" in table and "route us (wall) = wall-clock time" in table
    report = (tmp_path / "report.md").read_text()
    assert "KV cache 100 blocks of 64 tokens per worker" in report and "| route us (wall) |" in report
    results = json.loads((tmp_path / "results.json").read_text())
    assert {run["block_tokens"] for run in results["runs"]} == {64} and results["meta"]["limit"] == 15


def test_sim_cache_out_writes_a_table_and_a_hit_ratio_vs_capacity_plot(tmp_path, capsys, saved_figures):
    trace = tmp_path / "tiny.jsonl"
    # two conversations sharing block 0, each coming back with a longer prompt
    lines = [{"timestamp": i * 10, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids}
             for i, ids in enumerate([[0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5]])]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "report"
    rc = main(["sim", "cache", "--trace", str(trace), "--eviction", "lru", "--capacity-blocks", "2,4,0",
               "--json", "--out", str(out)])
    assert rc == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["capacity_blocks"] for d in docs] == [2, 4, 0] and {d["block_tokens"] for d in docs} == {512}
    table = (out / "cache.md").read_text()
    assert "capacities in blocks of 512 tokens" in table
    unbounded = docs[2]
    assert f"| unbounded | {100 * unbounded['hit_ratio']:.2f} | {unbounded['hit_blocks']} |" in table
    assert json.loads((out / "results.json").read_text())["results"] == docs
    assert (out / "hit_ratio_vs_capacity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = saved_figures["hit_ratio_vs_capacity.png"]
    assert "tiny.jsonl, 1 worker, capacity 2, 4 blocks of 512 tokens" in fig["title"] and "lru" in fig["title"]
    assert fig["xlabel"] == "cache capacity (blocks of 512 tokens)"
    assert fig["ylabel"] == "hit %" and fig["ylim"] == (0, 105) and "unbounded cache" in fig["labels"]

    # without --json the printed line names the block size too
    assert main(["sim", "cache", "--trace", str(trace), "--eviction", "lru", "--capacity-blocks", "4", "--quiet"]) == 0
    assert "prompt blocks of 512 tokens" in capsys.readouterr().out


class _Terminal:
    """A stream that says it is a terminal, collecting what is written."""

    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_sweep_progress_bar_only_on_a_terminal(tty):
    from kvrouterd.sim.cluster_cli import _Progress

    out = _Terminal(tty)
    bar = _Progress(2, out)  # type: ignore[arg-type]
    for label in ("round_robin+lru rate=10 seed=0", "cache_aware+lru rate=10 seed=0"):
        bar.start(label)
        bar.update(0.5)
        bar.finish_run()
    if tty:
        assert "2.0/2 runs" in out.text and "cache_aware+lru" in out.text
    else:
        assert out.text == ""


def test_bench_steps_are_a_bar_on_a_terminal_and_lines_otherwise(monkeypatch, capsys):
    import sys

    from kvrouterd.benchmarks.cli import _Steps

    tty = _Terminal(True)
    monkeypatch.setattr(sys, "stderr", tty)
    steps = _Steps(2)
    steps("decision cost: 8 workers")
    steps("decision cost: 64 workers")
    steps.close()
    assert "decision cost: 8 workers:" in tty.text and "/2 [" in tty.text and "\r" in tty.text
    monkeypatch.undo()

    steps = _Steps(1)
    steps("memory")
    steps.close()
    err = capsys.readouterr().err
    assert err.startswith("[bench ") and err.rstrip().endswith("] memory") and "\r" not in err
