"""Regenerate every table of docs/results.md from scratch: ``kvrouterd sim reproduce``.

    kvrouterd sim reproduce --out results/          # everything, seeded (make reproduce)
    kvrouterd sim reproduce --only lbgr_gsp_ttft    # one row (and the runs it needs)
    kvrouterd sim reproduce --only 'dualmap_*' --quick   # a cut-down smoke run
    kvrouterd sim reproduce --list                  # the rows, without running anything

The experiments are the declarative list ``kvrouterd.sim.experiments.ROWS``: each row names
the ``sim cluster`` (or ``sim cache``) arguments of its runs, the number compared and the
paper's number and issue #13's goal it is judged against. Every distinct (workload and
flags, policy pair, rate, seed) runs once, however many rows share it, each through a fresh
router and fleet exactly as ``sim cluster`` would run it; ``--jobs N`` runs N at a time in
worker processes (the numbers do not depend on it). Each number is the mean over seeds of the seed's own number (as ``sim cluster``'s report
computes it); goodput comes from the mean attainment at each rate.

Output: ``report.md`` (the summary: paper figure, claim, paper, ours, goal, verdict per row;
then one table per distinct command) and ``results.json`` (every number) in ``--out``; the
report is printed too. ``--quick`` cuts every run to its first 300 requests and its first
seed (the verdicts of a quick run mean nothing; it checks the machinery). A progress line
goes to stderr when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, KVRouterError
from . import cache as sim_cache
from . import cluster, cluster_cli
from .engine import EngineParams
from .experiments import ROWS, Measure, Row, verdict
from .metrics import goodput, percentile
from .report import capacity_text

__all__ = ["Digest", "Unit", "add_arguments", "evaluate", "expand", "run", "run_unit"]

QUICK_REQUESTS = 300
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
_PER_RUN_OPTIONS = ("--routing", "--eviction", "--rate", "--seeds", "--set")


@dataclass(frozen=True)
class Unit:
    """One simulation: a command's fixed arguments, one policy pair, one rate, one seed."""

    tool: str  # "cluster" or "cache"
    base: tuple[str, ...]
    routing: str  # the policy spec as JSON ("" for the cache tool)
    eviction: str
    rate: float | None
    seed: int
    quick: bool = False

    @property
    def pair(self) -> str:
        r = json.loads(self.routing)["name"] if self.routing else ""
        e = json.loads(self.eviction)["name"]
        return f"{r}+{e}" if r else e

    def label(self) -> str:
        rate = f" rate={self.rate:g}" if self.rate else ""
        return f"{self.pair}{rate} seed={self.seed}"


@dataclass
class Digest:
    """What a row needs of one run: every TTFT and the block and SLO counts."""

    ttft_s: list[float] = field(default_factory=list)
    hit_blocks: int = 0
    prompt_blocks: int = 0
    slo_met: int = 0
    requests: int = 0
    unfinished: int = 0
    wall_s: float = 0.0
    #: CPU seconds of the simulation (its process's), for timings on a loaded machine
    cpu_s: float = 0.0
    #: DualMap's hotspot migrations (A.1.2) and its decode-bottleneck rule (A.7): decisions
    #: with a candidate flagged, and those the flag sent elsewhere
    migrations: int = 0
    bottleneck_decisions: int = 0
    bottleneck_moves: int = 0
    #: the KV cache per worker in blocks (0 = unbounded) and the tokens a block holds
    capacity_blocks: int = 0
    block_tokens: int = 0
    #: requests deadline admission refused: each missed its SLO, as ``sim cluster`` counts them
    shed: int = 0
    #: requests that met their SLO per second of the run (``sim cluster``'s goodput column)
    good_rps: float = 0.0


def _strip(tokens: Sequence[str], options: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``tokens`` without ``options`` (each followed by one value), and the values removed."""
    drop = set(options)
    kept: list[str] = []
    removed: dict[str, list[str]] = defaultdict(list)
    it = iter(tokens)
    for tok in it:
        if tok in drop:
            removed[tok].append(next(it))
        else:
            kept.append(tok)
    return kept, removed


def _quick_base(tokens: list[str]) -> list[str]:
    kept, removed = _strip(tokens, ("--limit", "--warmup"))
    limit = min([int(v) for v in removed.get("--limit", [])] + [QUICK_REQUESTS])
    warmup = min([int(v) for v in removed.get("--warmup", [])] + [limit // 10]) if "--warmup" in removed else 0
    return kept + ["--limit", str(limit)] + (["--warmup", str(warmup)] if warmup else [])


def _tokens(row_run: str, traces: Path) -> tuple[str, list[str]]:
    tool, *rest = row_run.split(" ", 1) if row_run.startswith("cache ") else ("cluster", row_run)
    tokens = shlex.split(rest[0].replace("{mooncake}", str(traces)))
    left = [t for t in tokens if _PLACEHOLDER.search(t)]
    if left:
        raise ConfigError(f"unknown placeholder in {left[0]!r} (only {{mooncake}} is substituted)")
    return tool, tokens


def _cluster_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    (cluster_cli if prog == "cluster" else sim_cache).add_arguments(parser)
    return parser


class _ArgError(Exception):
    pass


def _parse(prog: str, tokens: Sequence[str]) -> argparse.Namespace:
    parser = _cluster_parser(prog)
    parser.error = lambda message: (_ for _ in ()).throw(_ArgError(message))  # type: ignore[method-assign]
    try:
        return parser.parse_args(list(tokens))
    except _ArgError as exc:
        raise ConfigError(f"sim {prog} {shlex.join(tokens)}: {exc}") from None


def expand(row_run: str, traces: Path, quick: bool = False, prefill_model: str = "") -> list[Unit]:
    """The runs of one row's command, one per policy pair, rate and seed (``prefill_model``:
    the engines' step-time model for every ``sim cluster`` run, "" = its default)."""
    tool, tokens = _tokens(row_run, traces)
    if prefill_model and tool == "cluster":
        tokens += ["--prefill-model", prefill_model]
    args = _parse(tool, tokens)  # fail now on a bad command, naming it
    if tool == "cache":
        spec = sim_cache._eviction_spec(args.eviction, args.eviction_param)
        spec = spec if isinstance(spec, dict) else {"name": spec}
        base, _ = _strip(tokens, ("--eviction", "--eviction-param"))
        return [Unit("cache", tuple(base), "", json.dumps(spec, sort_keys=True), None, 0, quick)]
    p = cluster_cli.plan(args)
    base, _ = _strip(tokens, _PER_RUN_OPTIONS)
    if quick:
        base = _quick_base(base)
    seeds = p.seeds[:1] if quick else p.seeds
    return [Unit("cluster", tuple(base), json.dumps(r, sort_keys=True), json.dumps(e, sort_keys=True), rate, seed, quick)
            for r in p.routings for e in p.evictions for rate in p.rates for seed in seeds]


def _sets(spec: dict[str, Any]) -> list[str]:
    name = spec["name"]
    out: list[str] = []
    for key, value in spec.items():
        if key != "name":
            out += ["--set", f"{name}.{key}={json.dumps(value)}"]
    return out


_WORKLOADS: OrderedDict[tuple[Any, ...], Any] = OrderedDict()


def run_unit(unit: Unit) -> Digest:
    """Run one simulation (in this process) and digest it."""
    started, cpu = time.perf_counter(), time.process_time()
    if unit.tool == "cache":
        args = _parse("cache", [*unit.base, "--eviction", "lru"])
        trace = list(sim_cache.read_trace(args.trace))
        if unit.quick:
            trace = trace[:QUICK_REQUESTS * 10]
        if len(args.capacity_blocks) != 1:  # `sim cache` sweeps a list; a row is one number
            raise ConfigError(f"a reproduce row replays one cache size, got --capacity-blocks {args.capacity_blocks}")
        res = sim_cache.replay(trace, json.loads(unit.eviction), args.capacity_blocks[0], block_tokens=args.block_tokens)
        return Digest([], res.hit_blocks, res.blocks, 0, res.requests, 0, time.perf_counter() - started,
                      time.process_time() - cpu, capacity_blocks=res.capacity_blocks, block_tokens=res.block_tokens)
    routing, eviction = json.loads(unit.routing), json.loads(unit.eviction)
    tokens = [*unit.base, "--routing", routing["name"], "--eviction", eviction["name"], "--seeds", str(unit.seed),
              *(["--rate", repr(unit.rate)] if unit.rate else []), *_sets(routing), *_sets(eviction)]
    p = cluster_cli.plan(_parse("cluster", tokens))
    key = (unit.base, unit.seed, unit.rate)
    wl = _WORKLOADS.get(key)
    if wl is None:
        wl = p.workload_for(unit.seed, unit.rate)
        _WORKLOADS[key] = wl
        while len(_WORKLOADS) > 2:
            _WORKLOADS.popitem(last=False)
    result = cluster.simulate(p.cfg, wl, p.settings_for(wl), routing=p.routings[0], eviction=p.evictions[0],
                              seed=unit.seed, rate=unit.rate or 0.0)
    slo_s = result.summary.slo_ms / 1000.0
    recs = result.records
    return Digest([r.ttft_s for r in recs], sum(r.hit_blocks for r in recs), sum(r.prompt_blocks for r in recs),
                  sum(1 for r in recs if r.ttft_s <= slo_s), len(recs), result.counters.get("unfinished", 0),
                  time.perf_counter() - started, time.process_time() - cpu, result.counters.get("migrations", 0),
                  result.counters.get("decode_bottleneck_decisions", 0),
                  result.counters.get("decode_bottleneck_moves", 0),
                  capacity_blocks=result.capacity_blocks, block_tokens=result.block_tokens,
                  shed=result.summary.shed, good_rps=result.summary.goodput_rps)


# ---- turning runs into numbers ----------------------------------------------------------

def _one(d: Digest) -> dict[str, float]:
    ttfts = sorted(d.ttft_s)
    out = {"hit_pct": 100.0 * d.hit_blocks / d.prompt_blocks if d.prompt_blocks else math.nan,
           "slo_pct": 100.0 * d.slo_met / (d.requests + d.shed) if d.requests and ttfts else math.nan,
           "good_rps": d.good_rps if d.requests else math.nan}
    for q in (50, 90, 95, 99):
        out[f"ttft_p{q}"] = percentile(ttfts, q) * 1000.0 if ttfts else math.nan
    return out


def _pool(digests: Sequence[Digest]) -> dict[str, float]:
    """The mean over seeds of each seed's number, as ``sim cluster``'s report computes it."""
    per_seed = [_one(d) for d in digests]
    out = {}
    for key in per_seed[0]:
        values = [x[key] for x in per_seed if not math.isnan(x[key])]
        out[key] = sum(values) / len(values) if values else math.nan
    out["requests"] = float(sum(d.requests for d in digests))
    out["unfinished"] = float(sum(d.unfinished for d in digests))
    out["shed"] = float(sum(d.shed for d in digests))
    for key in ("migrations", "bottleneck_decisions", "bottleneck_moves"):
        out[key] = float(sum(getattr(d, key) for d in digests))
    return out


class Table:
    """Pooled numbers of one command's runs: (pair, rate) -> metrics, and goodput per pair."""

    def __init__(self, units: Sequence[Unit], digests: dict[Unit, Digest]) -> None:
        cells: dict[tuple[str, float | None], list[Digest]] = defaultdict(list)
        for u in units:
            cells[(u.pair, u.rate)].append(digests[u])
        self.cells = {k: _pool(v) for k, v in cells.items()}
        runs = [digests[u] for u in units]
        #: the KV cache per worker the runs had, with the block size (it differs between workloads)
        self.capacity = capacity_text([d.capacity_blocks for d in runs], [d.block_tokens for d in runs])
        self.rates = sorted({r for _, r in self.cells if r is not None})
        self.pairs = list(dict.fromkeys(p for p, _ in self.cells))
        self.goodput = {p: goodput([(r, self.cells[(p, r)]["slo_pct"] / 100.0) for r in self.rates if (p, r) in self.cells])
                        for p in self.pairs} if len(self.rates) > 1 else {}

    def value(self, m: Measure) -> float:
        if m.metric == "goodput":
            return self.goodput.get(m.pairs[0], math.nan) if self.goodput else math.nan
        if m.metric == "peak_good_rps":
            rates = [c["good_rps"] for (p, _), c in self.cells.items() if p == m.pairs[0] and not math.isnan(c["good_rps"])]
            return max(rates) if rates else math.nan
        rate = m.rate
        if rate is None:
            rates = {r for p, r in self.cells if p == m.pairs[0]}
            if len(rates) != 1:
                raise ConfigError(f"measure {m} names no rate, and its runs have {len(rates)}")
            rate = rates.pop()
        cell = self.cells.get((m.pairs[0], rate))
        return cell[m.metric] if cell is not None else math.nan


def _measure(m: Measure, table: Table, better: str) -> tuple[float, str]:
    """The measure's value and which pair gave it (the best of ``m.pairs``)."""
    values = [(table.value(Measure(m.metric, (p,), m.rate)), p) for p in m.pairs]
    values = [v for v in values if not math.isnan(v[0])]
    if not values:
        return math.nan, ""
    return max(values) if better == "higher" else min(values)


def evaluate(row: Row, tables: dict[str, Table]) -> dict[str, Any]:
    """Our number for ``row`` and its verdict."""
    table = tables[row.ours.run or row.run]
    a, a_pair = _measure(row.ours, table, row.better)
    b, b_pair = math.nan, ""
    if row.versus is not None:
        # the comparison's "best" baseline is the strongest competitor: the best by the row's direction
        b, b_pair = _measure(row.versus, tables[row.versus.run or row.run], row.better)
    if row.compare == "value":
        ours = a
    elif row.compare == "ratio":
        ours = a / b if b else math.nan
    elif row.compare == "change":
        ours = 100.0 * (a / b - 1.0) if b else math.nan
    else:
        ours = a - b
    return {"name": row.name, "section": row.section, "figure": row.figure, "claim": row.claim, "paper": row.paper,
            "goal": row.goal, "unit": row.unit, "ours": ours, "a": a, "a_pair": a_pair, "b": b, "b_pair": b_pair,
            # judged on the number as the report prints it: 1.003x is a tie, not a win
            "verdict": verdict(row, round(ours, digits(row)) if not math.isnan(ours) else ours)}


# ---- the report -------------------------------------------------------------------------

def _num(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def digits(row: Row) -> int:
    """Decimals ``row``'s number is printed (and judged) with."""
    return row.digits if row.digits is not None else 2 if row.unit == "x" else 1


def _with_unit(x: float | None, row: Row, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    n = digits(row)
    text = f"{x:+.{n}f}" if signed else f"{x:.{n}f}"
    return text + {"x": "x", "%": "%", "": ""}.get(row.unit, f" {row.unit}")


def _ours_text(r: dict[str, Any], row: Row) -> str:
    signed = row.compare in ("change", "diff")
    main = _with_unit(r["ours"], row, signed)
    if row.versus is None:
        return main
    metric = row.ours.metric
    # goodput is swept in 0.5 req/s steps: one decimal, or 11.5 would print as 12
    fmt = (lambda v: _num(v, 0)) if metric.startswith("ttft") else (lambda v: _num(v, 1))
    return f"{main} ({r['a_pair']} {fmt(r['a'])} vs {r['b_pair']} {fmt(r['b'])})"


def _command(row_run: str) -> str:
    tool = "cache" if row_run.startswith("cache ") else "cluster"
    rest = row_run[len("cache "):] if tool == "cache" else row_run
    return f"kvrouterd sim {tool} {rest}"


def _detail(run: str, table: Table, names: Sequence[str]) -> list[str]:
    out = [f"### {', '.join(names)}", "", f"    {_command(run)}", ""]
    if run.startswith("cache "):
        cell = next(iter(table.cells.values()))
        out += [f"hit ratio {cell['hit_pct']:.2f}% ({int(cell['requests']):,} requests; {table.capacity})", ""]
        return out
    out += [f"{table.capacity} per worker.", ""]
    # with load reports or the admission queue, DualMap's A.7 rule and A.1.2 migration can fire: count them
    rules = "--load-report-ms" in run or "--admission-max-inflight" in run
    out += ["| pair | rate | hit % | TTFT p50 | p90 | p95 | p99 (ms) | SLO % | requests |"
            + (" migrations | A.7 flagged | A.7 moved |" if rules else ""),
            "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if rules else "")]
    for (pair, rate), c in sorted(table.cells.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0])):
        unfinished = f" ({int(c['unfinished'])} unfinished)" if c["unfinished"] else ""
        unfinished += f" (+{int(c['shed']):,} shed)" if c["shed"] else ""
        counts = (f" {int(c['migrations']):,} | {int(c['bottleneck_decisions']):,} | {int(c['bottleneck_moves']):,} |"
                  if rules else "")
        out.append(f"| {pair} | {_num(rate, 1) if rate else 'trace'} | {_num(c['hit_pct'])} | {_num(c['ttft_p50'], 0)} | "
                   f"{_num(c['ttft_p90'], 0)} | {_num(c['ttft_p95'], 0)} | {_num(c['ttft_p99'], 0)} | "
                   f"{_num(c['slo_pct'])} | {int(c['requests']):,}{unfinished} |{counts}")
    if rules:
        out += ["", "Migrations: queued requests DualMap moved to their other candidate (A.1.2). A.7 flagged: "
                "dispatched decisions with a candidate flagged decode-bottlenecked (A.7: a queue, and no prefill "
                "finished for 3 s); A.7 moved: those the flag sent to another worker than the rule would have "
                "without it. Counts over the whole run, warm-up included, summed over seeds."]
    if table.goodput:
        out += ["", "Goodput (highest swept rate with mean SLO attainment >= 90%): " + ", ".join(
            f"{p} {_num(g, 1)}" for p, g in sorted(table.goodput.items(), key=lambda kv: -kv[1])) + " req/s"]
    out.append("")
    return out


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(rows: Sequence[Row], results: Sequence[dict[str, Any]], tables: dict[str, Table], meta: dict[str, Any]) -> str:
    out = ["# `kvrouterd sim reproduce`: the papers' claims in the simulator", ""]
    out.append(f"Commit {meta['commit']}, {meta['date']}; {meta['units']} runs, {meta['wall_s']:.0f} s wall, "
               f"{meta['cpu_s']:.0f} s of simulation CPU ({meta['sim_wall_s']:.0f} s of wall time inside the runs: "
               f"more than the CPU time when the machine is shared), {meta['jobs']} job(s)"
               + (" (**--quick**: verdicts meaningless)" if meta["quick"] else "")
               + f"; engines and policies on the {meta.get('prefill_model', 'power_law')} prefill cost model.")
    out += ["", "| row | § | paper figure | claim (ours = ...) | paper | ours | goal | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    for row, r in zip(rows, results):
        paper = _with_unit(row.paper, row, row.compare in ("change", "diff")) if row.paper is not None else "-"
        out.append(f"| {row.name} | {row.section} | {row.figure} | {row.claim} | {paper} | {_ours_text(r, row)} | "
                   f"{row.goal or '-'} | **{r['verdict']}** |")
    out += ["", "## Runs", ""]
    names: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        names[row.run].append(row.name)
    for run, table in tables.items():
        out += _detail(run, table, names.get(run, []))
    return "\n".join(out) + "\n"


# ---- the command ------------------------------------------------------------------------

def _default_trace() -> Path:
    """Where the tests look for the Mooncake trace too (docs/simulator.md)."""
    env = os.environ.get("MOONCAKE_TRACE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default="", metavar="NAME[,NAME..]",
                        help="rows to run: names or shell patterns like 'dualmap_*' (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help=f"first {QUICK_REQUESTS} requests and first seed of every run (checks the machinery)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="simulations run at once, in worker processes")
    parser.add_argument("--mooncake-trace", type=Path, default=None, metavar="FILE",
                        help="the Mooncake conversation trace (default: $MOONCAKE_TRACE or ../shared/traces/)")
    parser.add_argument("--prefill-model", choices=["power_law", "linear"], default="",
                        help=f"prefill cost model of every sim cluster run (default {EngineParams().prefill_model})")
    parser.add_argument("--out", type=Path, metavar="DIR", help="write report.md and results.json here")
    parser.add_argument("--list", action="store_true", help="list the rows and their commands; run nothing")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors (the report goes to --out)")


def select(only: str) -> list[Row]:
    if not only:
        return list(ROWS)
    patterns = [p for p in only.split(",") if p]
    chosen = [r for r in ROWS if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]
    missing = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in ROWS)]
    if missing:
        raise ConfigError(f"--only: no row named {missing[0]!r}; `kvrouterd sim reproduce --list` lists them")
    return chosen


def _execute(units: Sequence[Unit], jobs: int, progress: cluster_cli._Progress) -> dict[Unit, Digest]:
    digests: dict[Unit, Digest] = {}
    if jobs <= 1:
        for u in units:
            progress.start(u.label())
            digests[u] = run_unit(u)
            progress.finish_run()
        return digests
    pool = ProcessPoolExecutor(max_workers=jobs)
    try:
        pending: dict[Future[Digest], Unit] = {pool.submit(run_unit, u): u for u in units}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                u = pending.pop(fut)
                digests[u] = fut.result()
                progress.label = u.label()
                progress.finish_run()
    finally:
        # a failed run fails the command now, not after every other run has finished
        pool.shutdown(wait=True, cancel_futures=True)
    return digests


def run(args: argparse.Namespace) -> int:
    try:
        if args.jobs < 1:
            raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
        rows = select(args.only)
        traces = args.mooncake_trace or _default_trace()
        if args.list:
            for row in rows:
                print(f"{row.name}  (section {row.section})\n    {_command(row.run).replace('{mooncake}', str(traces))}")
            return 0
        needs_trace = any("{mooncake}" in r.run for r in rows)
        if needs_trace and not traces.is_file():
            raise ConfigError(f"no Mooncake trace at {traces} (give --mooncake-trace FILE or set MOONCAKE_TRACE)")
        per_run: dict[str, list[Unit]] = {}
        for row in rows:
            for run_args in {row.run, row.ours.run or row.run, *([row.versus.run] if row.versus and row.versus.run else [])}:
                if run_args not in per_run:
                    per_run[run_args] = expand(run_args, traces, args.quick, args.prefill_model)
        units = list(dict.fromkeys(u for us in per_run.values() for u in us))
        show = sys.stderr if sys.stderr.isatty() and not args.quiet else None
        started, cpu0 = time.perf_counter(), time.process_time()
        digests = _execute(units, args.jobs, cluster_cli._Progress(len(units), show))
        wall = time.perf_counter() - started
        tables = {run_args: Table(us, digests) for run_args, us in per_run.items()}
        results = [evaluate(row, tables) for row in rows]
    except (KVRouterError, ValueError, OSError) as exc:
        print(f"kvrouterd sim reproduce: {exc}", file=sys.stderr)
        return 2
    meta = {"commit": _git_commit(), "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "units": len(units), "wall_s": wall, "cpu_s": sum(d.cpu_s for d in digests.values()),
            "sim_wall_s": sum(d.wall_s for d in digests.values()),
            "jobs": args.jobs, "quick": args.quick, "process_cpu_s": time.process_time() - cpu0,
            "prefill_model": args.prefill_model or EngineParams().prefill_model}
    text = markdown(rows, results, tables, meta)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        doc = {"meta": meta, "rows": [dict(r, spec=asdict(row)) for row, r in zip(rows, results)],
               "runs": {run_args: {"cells": [{"pair": p, "rate": rt, **c} for (p, rt), c in t.cells.items()],
                                   "goodput": t.goodput} for run_args, t in tables.items()}}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    if not args.quiet:
        print(text, end="")
    return 0
