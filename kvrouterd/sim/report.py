"""Reports of ``kvrouterd sim cluster`` runs: a table, JSON with every number, Markdown, plots.

``build`` turns runs into one JSON-able document: every run, the mean over seeds of each
(routing, eviction, rate) cell, and the goodput of each pair (highest swept rate with mean
SLO attainment >= 90%). ``write`` puts report.md, results.json and PNG plots (TTFT CDF per
policy pair at each rate; SLO attainment and hit ratio against rate) in a directory.
Every title and report names the setting in units a reader cannot mistake: the workload and
its ``--limit``, the workers, and the KV capacity in blocks *of the workload's block size*
(a Mooncake block holds 512 tokens, a generated workload's 64, the daemon's 16). Plots use
matplotlib's Agg backend and are skipped, with a note in the report, when matplotlib is not
installed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .metrics import goodput, percentile
from .results import RunResult

#: SLO attainment a rate must reach to count toward goodput (metrics.goodput's default)
GOODPUT_ATTAINMENT = 0.9

__all__ = ["build", "cache_table", "capacity_text", "markdown", "setting", "table", "write", "write_cache"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
#: percentage axes end above 100 so a series at 99-100% stays clear of the frame
_PERCENT_YLIM = (0, 105)
_DASHES = ("-", "--", "-.", ":")
_CELL_KEYS = ("hit_ratio", "slo_attainment", "throughput_rps", "load_cv", "evict_us_mean", "shed", "goodput_rps")


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
            row[key] = _mean([g.get(key, 0) for g in group])  # results written before shed/goodput had none
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


_COLUMNS = ("pair", "rate", "hit %", "TTFT p50", "p90", "p99", "E2E p50", "p99", "SLO %", "req/s", "goodput",
            "shed", "load CV", "route us (wall)")
#: what the columns mean; "route us" is measured on this machine's clock, not simulated time
_LEGEND = ("Times in ms of simulated time; each row is the mean over seeds; hit % = prefix-hit blocks / prompt "
           "blocks as the engines found them; goodput = requests within the SLO per second; shed = requests deadline "
           "admission refused (they count against SLO %; TTFT and E2E are over the served ones); load CV = coefficient of variation of pending prefill tokens; "
           "route us (wall) = mean wall-clock time of one routing decision on the machine that ran the simulation.")


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in sorted(doc["aggregate"], key=lambda r: (r["rate"], r["pair"])):
        rows.append([
            r["pair"], _fmt(r["rate"], 1) if r["rate"] else "trace", _fmt(100 * r["hit_ratio"], 1),
            _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p90"]), _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["e2e_ms"]["p50"]), _fmt(r["e2e_ms"]["p99"]), _fmt(100 * r["slo_attainment"], 1),
            _fmt(r["throughput_rps"], 2), _fmt(r["goodput_rps"], 2), _fmt(r["shed"]), _fmt(r["load_cv"], 2),
            _fmt(r["route_us"]["mean"], 1),
        ])
    return rows


def table(doc: dict[str, Any]) -> str:
    """A plain-text table (times in ms), one row per policy pair and rate, means over seeds, under
    a line naming the setting."""
    rows = [list(_COLUMNS), *_rows(doc)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(0, setting(doc))
    lines.append("times in ms of simulated time; route us (wall) = wall-clock time of one routing decision")
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
    out.append(f"{setting(doc)}; cache mode {meta.get('cache_mode', '?')}, TTFT SLO {_fmt(slo)} ms. {_LEGEND}")
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


def capacity_text(capacities: Sequence[int], block_tokens: Sequence[int]) -> str:
    """A KV capacity in blocks with their size, e.g. "KV cache 1,454 blocks of 512 tokens"."""
    bounded = sorted({c for c in capacities if c})
    sizes = " or ".join(f"{b:,}" for b in sorted(set(block_tokens))) or "?"
    parts = [f"{', '.join(f'{c:,}' for c in bounded)} blocks of {sizes} tokens"] if bounded else []
    if len(bounded) < len(set(capacities)):
        parts.append("unbounded")
    return "KV cache " + " and ".join(parts)


def setting(doc: dict[str, Any], sep: str = ", ") -> str:
    """What every title and report names: workload (and --limit), workers, KV capacity per worker
    (``sep`` between the workload and the capacity: a plot title breaks the line there)."""
    meta = doc["meta"]
    runs = doc["runs"]
    limit = f" (first {meta['limit']:,} requests)" if meta.get("limit") else ""
    capacity = capacity_text([r["capacity_blocks"] for r in runs], [r["block_tokens"] for r in runs])
    return f"{meta.get('workload', '?')}{limit}, {meta.get('workers', '?')} workers{sep}{capacity} per worker"


def _fit(xs: Sequence[float]) -> tuple[float, float]:
    """Axis limits around the data with 5% of the span to spare: a sweep over 2-4 req/s fills the axis."""
    lo, hi = min(xs), max(xs)
    pad = 0.05 * (hi - lo) or 0.5
    return lo - pad, hi + pad


def _plots(results: Sequence[RunResult], doc: dict[str, Any], out: Path) -> list[str]:
    """Plots in the tables' units: times in ms, shares in %, the SLO drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    title = setting(doc, sep="\n")
    slo_ms = doc["runs"][0]["slo_ms"] if doc["runs"] else 0
    rates = sorted({r.rate for r in results})
    for rate in rates:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        by_pair: dict[str, list[float]] = defaultdict(list)
        for r in results:
            if r.rate == rate:
                by_pair[f"{r.routing}+{r.eviction}"] += [1000 * x.ttft_s for x in r.records if not math.isnan(x.ttft_s)]
        for j, (pair, ttfts) in enumerate(sorted(by_pair.items())):
            xs = sorted(ttfts)
            ax.plot(xs, [100 * (i + 1) / len(xs) for i in range(len(xs))], linestyle=_DASHES[j % len(_DASHES)], label=pair)
        hi = max((percentile(v, 99) for v in by_pair.values() if v), default=0.0)
        if slo_ms:
            ax.axvline(slo_ms, color="red", linewidth=1, label=f"TTFT SLO {_fmt(slo_ms)} ms")
        ax.set_xlim(0, max(hi, slo_ms) * 1.05 or 1)
        ax.set_ylim(*_PERCENT_YLIM)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("requests (%)")
        ax.set_title(f"TTFT CDF at {rate:g} req/s\n{title}" if rate else f"TTFT CDF\n{title}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        name = out / (f"ttft_cdf_rate{rate:g}.png" if rate else "ttft_cdf.png")
        fig.tight_layout()
        fig.savefig(name, dpi=110)
        plt.close(fig)
        written.append(str(name))
    if len(rates) > 1:
        for key, label, fname in (("slo_attainment", "SLO attainment (%)", "attainment_vs_rate.png"),
                                  ("hit_ratio", "prefix hit (%)", "hit_ratio_vs_rate.png")):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            series: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for row in doc["aggregate"]:
                series[row["pair"]].append((row["rate"], row[key]))
            for i, (pair, pts) in enumerate(sorted(series.items())):
                pts.sort()
                # overlapping series stay distinguishable by marker and dash
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=_MARKERS[i % len(_MARKERS)],
                        linestyle=_DASHES[i % len(_DASHES)], label=pair)
            if key == "slo_attainment":
                # goodput is the highest rate at or above this line
                ax.axhline(100 * GOODPUT_ATTAINMENT, color="red", linewidth=1,
                           label=f"{100 * GOODPUT_ATTAINMENT:g}% within the {_fmt(slo_ms)} ms TTFT SLO")
            ax.set_ylim(*_PERCENT_YLIM)
            ax.set_xlim(*_fit(rates))
            ax.set_title(f"{label.split(' (')[0]} vs request rate\n{title}", fontsize=10)
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


_CACHE_COLUMNS = ("capacity (blocks)", "hit %", "hit blocks", "prompt blocks", "evicted blocks", "requests")


def cache_table(results: Sequence[dict[str, Any]]) -> str:
    """``sim cache`` results as a Markdown table, one row per capacity (in the trace's blocks)."""
    lines = ["| " + " | ".join(_CACHE_COLUMNS) + " |", "|" + "---|" * len(_CACHE_COLUMNS)]
    for r in sorted(results, key=lambda r: r["capacity_blocks"] or math.inf):
        lines.append("| " + " | ".join((
            _fmt(r["capacity_blocks"]) if r["capacity_blocks"] else "unbounded", _fmt(100 * r["hit_ratio"], 2),
            _fmt(r["hit_blocks"]), _fmt(r["blocks"]), _fmt(r["evicted_blocks"]), _fmt(r["requests"]),
        )) + " |")
    return "\n".join(lines)


def write_cache(results: Sequence[dict[str, Any]], meta: dict[str, Any], out: Path) -> list[str]:
    """Write ``sim cache``'s cache.md, results.json and hit_ratio_vs_capacity.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    eviction = meta.get("eviction", results[0]["eviction"] if results else "?")
    block = f"blocks of {meta['block_tokens']:,} tokens" if meta.get("block_tokens") else "blocks"
    title = f"Prefix hit ratio vs cache capacity, {eviction}\n{meta.get('workload', '?')}, 1 worker"
    written = []
    note = ""
    bounded = [r for r in results if r["capacity_blocks"] > 0]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        pts = sorted((r["capacity_blocks"], 100 * r["hit_ratio"]) for r in bounded)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=eviction)
        for r in results:
            if not r["capacity_blocks"]:  # unbounded: the ceiling every capacity approaches
                ax.axhline(100 * r["hit_ratio"], color="grey", linestyle="--", linewidth=1, label="unbounded cache")
        if len(pts) > 1 and pts[-1][0] / max(pts[0][0], 1) >= 20:
            ax.set_xscale("log")
        ax.set_ylim(*_PERCENT_YLIM)
        ax.set_xlabel(f"cache capacity ({block})")
        ax.set_ylabel("hit %")
        capacities = ", ".join(f"{c:,}" for c, _ in pts) or "unbounded"
        ax.set_title(f"{title}, capacity {capacities} {block}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "hit_ratio_vs_capacity.png", dpi=110)
        plt.close(fig)
        written.append(str(out / "hit_ratio_vs_capacity.png"))
    except ImportError:
        note = "(plot skipped: matplotlib is not installed; `pip install kvrouterd[sim]`)"
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": list(results)}, indent=1))
    md = [f"# Cache simulation: {meta.get('workload', '?')}, eviction {eviction}", ""]
    if meta.get("command"):
        md += ["Command:", "", f"    {meta['command']}", ""]
    md += [f"One cache (1 worker); capacities in {block}; hit % = prefix-hit blocks / prompt blocks.", "",
           cache_table(results)]
    md += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in written]
    if note:
        md += ["", note]
    (out / "cache.md").write_text("\n".join(md) + "\n")
    return [str(out / "cache.md"), str(out / "results.json"), *written]
