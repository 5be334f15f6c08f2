"""Reports of ``kvrouterd sim cluster`` runs: a table, JSON with every number, Markdown, plots.

``build`` turns runs into one JSON-able document: every run, the mean over seeds of each
(routing, eviction, rate) cell, and the goodput of each pair (highest swept rate with mean
SLO attainment >= 90%). ``write`` puts report.md, results.json and PNG plots (TTFT CDF per
policy pair at each rate; SLO attainment and hit ratio against rate) in a directory.
Plots use matplotlib's Agg backend and are skipped, with a note in the report, when
matplotlib is not installed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .metrics import goodput, percentile

if TYPE_CHECKING:
    from .cluster import RunResult

__all__ = ["build", "markdown", "table", "write"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_DASHES = ("-", "--", "-.", ":")
_CELL_KEYS = ("hit_ratio", "slo_attainment", "throughput_rps", "load_cv", "evict_us_mean")


def _pair(run: dict[str, Any]) -> str:
    return f"{run['routing']}+{run['eviction']}"


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def build(results: Sequence[RunResult], meta: dict[str, Any]) -> dict[str, Any]:
    runs = [r.as_dict() for r in results]
    cells: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        cells[(_pair(run), run["rate"])].append(run)
    aggregate = []
    for (pair, rate), group in cells.items():
        row: dict[str, Any] = {"pair": pair, "routing": group[0]["routing"], "eviction": group[0]["eviction"],
                               "rate": rate, "seeds": [g["seed"] for g in group], "requests": group[0]["requests"]}
        for key in _CELL_KEYS:
            row[key] = _mean([g[key] for g in group])
        for key in ("ttft_ms", "e2e_ms", "route_us"):
            row[key] = {q: _mean([g[key][q] for g in group]) for q in group[0][key]}
        aggregate.append(row)
    by_pair: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in aggregate:
        by_pair[row["pair"]].append((row["rate"], row["slo_attainment"]))
    rates = sorted({row["rate"] for row in aggregate})
    good = {pair: goodput(points) for pair, points in by_pair.items()} if len(rates) > 1 else {}
    return {"meta": meta, "aggregate": aggregate, "goodput_rps": good, "runs": runs}


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:,.{digits}f}"


_COLUMNS = ("pair", "rate", "hit %", "TTFT p50", "p90", "p99", "E2E p50", "p99", "SLO %", "req/s", "load CV",
            "route us")


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in sorted(doc["aggregate"], key=lambda r: (r["rate"], r["pair"])):
        rows.append([
            r["pair"], _fmt(r["rate"], 1) if r["rate"] else "trace", _fmt(100 * r["hit_ratio"], 1),
            _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p90"]), _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["e2e_ms"]["p50"]), _fmt(r["e2e_ms"]["p99"]), _fmt(100 * r["slo_attainment"], 1),
            _fmt(r["throughput_rps"], 2), _fmt(r["load_cv"], 2), _fmt(r["route_us"]["mean"], 1),
        ])
    return rows


def table(doc: dict[str, Any]) -> str:
    """A plain-text table (times in ms), one row per policy pair and rate, means over seeds."""
    rows = [list(_COLUMNS), *_rows(doc)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    if doc["goodput_rps"]:
        lines.append("")
        lines.append("goodput (highest swept rate with >= 90% SLO attainment): " + ", ".join(
            f"{p} {_fmt(g, 1)} req/s" for p, g in sorted(doc["goodput_rps"].items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def markdown(doc: dict[str, Any], plots: Sequence[str] = (), note: str = "") -> str:
    meta = doc["meta"]
    out = [f"# Cluster simulation: {meta.get('workload', '')}", ""]
    if meta.get("command"):
        out += ["Command:", "", f"    {meta['command']}", ""]
    runs = doc["runs"]
    slo = runs[0]["slo_ms"] if runs else 0
    out.append(f"{meta.get('workers', '?')} workers, cache mode {meta.get('cache_mode', '?')}, TTFT SLO {_fmt(slo)} ms, "
               f"KV capacity per worker {sorted({r['capacity_blocks'] for r in runs})} blocks (0 = unbounded). "
               "Times in ms; each row is the mean over seeds; hit % = prefix-hit blocks / prompt blocks "
               "as the engines found them; load CV = coefficient of variation of pending prefill tokens.")
    out.append("")
    out.append("| " + " | ".join(_COLUMNS) + " |")
    out.append("|" + "---|" * len(_COLUMNS))
    for row in _rows(doc):
        out.append("| " + " | ".join(row) + " |")
    if doc["goodput_rps"]:
        out += ["", "Goodput (highest swept rate with mean SLO attainment >= 90%):", ""]
        out += [f"- {p}: {_fmt(g, 1)} req/s" for p, g in sorted(doc["goodput_rps"].items(), key=lambda kv: -kv[1])]
    if plots:
        out += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    if note:
        out += ["", note]
    return "\n".join(out) + "\n"


def _plots(results: Sequence[RunResult], doc: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    rates = sorted({r.rate for r in results})
    for rate in rates:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        by_pair: dict[str, list[float]] = defaultdict(list)
        for r in results:
            if r.rate == rate:
                by_pair[f"{r.routing}+{r.eviction}"] += [x.ttft_s for x in r.records if not math.isnan(x.ttft_s)]
        for j, (pair, ttfts) in enumerate(sorted(by_pair.items())):
            xs = sorted(ttfts)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], linestyle=_DASHES[j % len(_DASHES)], label=pair)
        if by_pair:
            hi = max(percentile(v, 99) for v in by_pair.values() if v)
            ax.set_xlim(0, hi * 1.05 if hi > 0 else 1)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"TTFT CDF, rate {rate:g} req/s" if rate else "TTFT CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        name = out / (f"ttft_cdf_rate{rate:g}.png" if rate else "ttft_cdf.png")
        fig.tight_layout()
        fig.savefig(name, dpi=110)
        plt.close(fig)
        written.append(str(name))
    if len(rates) > 1:
        for key, label, fname in (("slo_attainment", "SLO attainment", "attainment_vs_rate.png"),
                                  ("hit_ratio", "prefix hit ratio", "hit_ratio_vs_rate.png")):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            series: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for row in doc["aggregate"]:
                series[row["pair"]].append((row["rate"], row[key]))
            for i, (pair, pts) in enumerate(sorted(series.items())):
                pts.sort()
                # overlapping series stay distinguishable by marker and dash
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=_MARKERS[i % len(_MARKERS)],
                        linestyle=_DASHES[i % len(_DASHES)], label=pair)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=110)
            plt.close(fig)
            written.append(str(out / fname))
    return written


def write(doc: dict[str, Any], results: Sequence[RunResult], out: Path) -> list[str]:
    """Write report.md, results.json and the plots into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    note = ""
    try:
        plots = _plots(results, doc, out)
    except ImportError:
        plots, note = [], "(plots skipped: matplotlib is not installed; `pip install kvrouterd[sim]`)"
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "report.md").write_text(markdown(doc, plots, note))
    return [str(out / "report.md"), str(out / "results.json"), *plots]
