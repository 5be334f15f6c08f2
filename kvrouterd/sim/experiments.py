"""The experiments behind docs/results.md, as data: one ``Row`` per claim row of its tables.

Each row says which runs to make (``run``: the arguments of one ``kvrouterd sim cluster``
or ``kvrouterd sim cache`` command, workload, flags, policies, rates and seeds included),
which number of those runs is ours (``ours``, optionally against ``versus``), and which paper
number (``paper``) and issue #13 goal (``goal``) it is judged against. ``sim reproduce``
runs every distinct (workload, flags, policy pair, rate, seed) once, however many rows
share it, and writes the summary and one detail table per distinct ``run``.

``{mooncake}`` in a ``run`` stands for the Mooncake conversation trace
(``sim reproduce --mooncake-trace``).

Numbers are means over seeds of each seed's number, as ``sim cluster``'s report gives them,
and are judged as printed (``Row.digits`` decimals), so a 1.003x ratio is a tie.

Verdicts (``verdict``), in this order:

- **reproduced**: ours within ``tolerance`` of the paper's number (``"25%"`` = relative to the
  paper's number, ``"0.01"`` = absolute, in the row's unit);
- **goal met**: ours passes the issue #13 goal (``">=1.5"``, ``"<=-15"``, ``">0"``, ...);
- **direction only**: ours is on the paper's side of "no effect" (1 for ratios, 0 for
  changes and differences), short of the paper's number and of the goal;
- **not reproduced**: ours is on the other side, or at "no effect";
- for a row with neither a paper number nor a goal (a combination no paper ran): **wins**
  when ours is on the better side of "no effect", else **does not win**; without a
  "no effect" (a plain value), **reference** (a measured setting the text refers to).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["PEER_WORKLOADS", "ROWS", "Measure", "Row", "neutral", "parse_goal", "parse_tolerance", "verdict"]

Compare = Literal["value", "ratio", "change", "diff"]


@dataclass(frozen=True)
class Measure:
    """One number of a set of runs, pooled over seeds (requests of all seeds together).

    ``metric``: ``hit_pct`` (prefix-hit blocks / prompt blocks, %), ``ttft_p50`` / ``ttft_p90``
    / ``ttft_p95`` / ``ttft_p99`` (ms), ``slo_pct`` (% of requests within the SLO),
    ``goodput`` (highest swept rate with pooled SLO attainment >= 90%, req/s), ``good_rps``
    (requests within their SLO per second at ``rate``) and ``peak_good_rps`` (the highest
    ``good_rps`` of the swept rates). ``pairs``: a
    ``routing+eviction`` pair, or several (the best of them, by the row's ``better``).
    ``rate``: which swept rate (None: the run's only rate; ignored for goodput). ``run``:
    other runs than the row's own (None = the row's).
    """

    metric: str
    pairs: tuple[str, ...]
    rate: float | None = None
    run: str | None = None


@dataclass(frozen=True)
class Row:
    name: str
    #: the docs/results.md section whose table this row feeds
    section: str
    #: the paper and figure/table the claim comes from
    figure: str
    #: the claim, and what "ours" measures, in words
    claim: str
    run: str
    ours: Measure
    versus: Measure | None = None
    #: how ours is formed from ``ours`` and ``versus``: value, ratio (a / b), change (100 * (a / b - 1), %), diff (a - b)
    compare: Compare = "value"
    #: the side the paper claims is better
    better: Literal["higher", "lower"] = "higher"
    #: the paper's number in the same unit as ours (None: the paper gives none)
    paper: float | None = None
    #: issue #13's goal on ours ("" = none)
    goal: str = ""
    tolerance: str = "25%"
    unit: str = ""
    #: decimals ours is printed and judged with (None: 2 for ratios in "x", else 1)
    digits: int | None = None


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}


def parse_goal(goal: str) -> tuple[Callable[[float, float], bool], float] | None:
    """``">=1.5"`` -> (operator.ge, 1.5); ``""`` -> None."""
    goal = goal.replace(" ", "")
    if not goal:
        return None
    for sym in (">=", "<=", ">", "<"):
        if goal.startswith(sym):
            return _OPS[sym], float(goal[len(sym):])
    raise ValueError(f"goal {goal!r}: expected >=X, <=X, >X or <X")


def parse_tolerance(tolerance: str, paper: float) -> float:
    """The largest |ours - paper| that still counts as reproduced."""
    tolerance = tolerance.strip()
    if tolerance.endswith("%"):
        return abs(paper) * float(tolerance[:-1]) / 100.0
    return float(tolerance)


def neutral(compare: Compare) -> float | None:
    """The value of "no effect" for a comparison (None for a plain value)."""
    return {"value": None, "ratio": 1.0, "change": 0.0, "diff": 0.0}[compare]


def verdict(row: Row, ours: float) -> str:
    """The verdict of ``row`` given our number (see the module docstring)."""
    if ours != ours:  # NaN: nothing was measured
        return "not measured"
    if row.paper is not None and abs(ours - row.paper) <= parse_tolerance(row.tolerance, row.paper):
        return "reproduced"
    goal = parse_goal(row.goal)
    if goal is not None and goal[0](ours, goal[1]):
        return "goal met"
    zero = neutral(row.compare)
    claimless = row.paper is None and goal is None
    if zero is None:
        return "reference" if claimless else "not reproduced"
    if (ours > zero) if row.better == "higher" else (ours < zero):
        return "wins" if claimless else "direction only"
    return "does not win" if claimless else "not reproduced"


# ---- the experiments ----------------------------------------------------------------------

MOONCAKE = "--trace {mooncake} --limit 4000 --warmup 500 --workers 8 --capacity-fraction 0.3 --slo-ms 5000"
TOOLAGENT = "--workload toolagent --workload-param requests=3000 --warmup 300 --workers 8 --capacity-fraction 0.3 --slo-ms 5000"
# DualMap's Table 1 for Mooncake's Tool&Agent trace: 8.6k-token inputs, 59% shared
TOOLAGENT_T1 = (TOOLAGENT + " --workload-param tool_tokens=[2048,4096,8192] --workload-param user_tokens=[1024,6144]"
                " --workload-param output_tokens=182")
GSP_PAPER_CACHE = "--workload gsp --workers 4 --capacity-blocks 3125 --seeds 0,1,2"
BASELINES = ("cache_affinity+lru", "least_loaded+lru", "min_ttft+lru", "preble+lru")


def _zipf2_rounds(conversations: int = 2000, longest: int = 40) -> str:
    """T-LRU's heavy-tailed conversation lengths: Zipf(2) over 1..40 turns, as a list the
    chat generator draws from uniformly (section 9.3)."""
    norm = sum(j ** -2 for j in range(1, longest + 1))
    rounds: list[int] = []
    for k in range(1, longest + 1):
        rounds += [k] * round(conversations * k ** -2 / norm)
    return "[" + ",".join(map(str, rounds)) + "]"


LONG_CHAT = ("--workload chat --workers 1 --routing round_robin --seeds 0,1,2 --workload-param clients=800"
             f" --workload-param rounds={_zipf2_rounds()} --workload-param user_tokens=200"
             " --workload-param output_tokens=300 --rate 0.5 --cache-decode --eviction lru,tlru"
             " --set tlru.next_prompt_blocks=3.125")


def _lru_cache_row(blocks: int, published: float) -> Row:
    return Row(
        f"lru_cache_{blocks}", "6", "systematic study, Table 3",
        f"single-cache LRU hit ratio on the Mooncake conversation trace, {blocks:,} blocks",
        f"cache --trace {{mooncake}} --eviction lru --capacity-blocks {blocks}",
        Measure("hit_pct", ("lru",)), paper=published, tolerance="0.01", unit="%", digits=2)


def _dualmap_row(name: str, what: str, run: str, baselines: tuple[str, ...], goal: str) -> Row:
    return Row(
        name, "9.2", "DualMap, Fig. 7 and abstract (up to 2.25x effective capacity)",
        f"goodput of DualMap / the best baseline's, {what} (SLO 5 s, >= 90% attainment)", run,
        Measure("goodput", ("dualmap+lru",)), Measure("goodput", baselines), compare="ratio", paper=2.25, goal=goal,
        unit="x")


# the daemon's admission queue (at most 32 routed, uncompleted requests per worker) with
# DualMap's hotspot migration (A.1.2) and engines reporting their queues every 100 ms (A.7)
ADMISSION = " --admission-max-inflight 32 --load-report-ms 100"


def _admission_row(row: Row) -> Row:
    return Row(row.name + "_admission", "10", row.figure, row.claim.replace("(SLO", "with admission queue + migration (SLO"),
               row.run.replace(" --rate", ADMISSION + " --rate", 1), row.ours, row.versus, row.compare, row.better,
               row.paper, row.goal, row.tolerance, row.unit, row.digits)


def _tlru_row(blocks: int) -> Row:
    return Row(
        f"tlru_p95_{blocks}", "9.3", "T-LRU, Table 1 (WildChat, P95 -23.9%)",
        f"T-LRU's P95 TTFT change vs LRU, heavy-tailed long chat, answers cached, {blocks} blocks, 3 seeds",
        f"{LONG_CHAT} --capacity-blocks {blocks}", Measure("ttft_p95", ("round_robin+tlru",)),
        Measure("ttft_p95", ("round_robin+lru",)), compare="change", better="lower", paper=-23.9, goal="<=-15", unit="%")


LONGCHAT = ("--workload longchat --workers 1 --routing round_robin --seeds 0,1,2 --cache-decode --eviction lru,tlru"
            " --set tlru.next_prompt_blocks=3.125")


def _tlru_longchat_row(blocks: int) -> Row:
    return Row(
        f"tlru_p95_longchat_{blocks}", "9.3", "T-LRU, Table 1 (WildChat, P95 -23.9%)",
        f"as above on the longchat generator (appendix F's arrivals: Poisson conversations, exponential"
        f" 20 s turn gaps, no rescaling), {blocks} blocks, 3 seeds",
        f"{LONGCHAT} --capacity-blocks {blocks}", Measure("ttft_p95", ("round_robin+tlru",)),
        Measure("ttft_p95", ("round_robin+lru",)), compare="change", better="lower", paper=-23.9, goal="<=-15", unit="%")


def _unicache_row(mix: str, decode: bool) -> Row:
    flag = " --cache-decode" if decode else ""
    return Row(
        f"unicache_{mix}" + ("_decode" if decode else ""), "9.4", "UniCache, Fig. 10 (+3.9 to +17.3 points over LRU)",
        f"UniCache's hit ratio - LRU's, {mix}" + (", answers cached" if decode else "") + ", 3 seeds",
        f"--workload {mix} --rate 4 --workers 1 --capacity-fraction 0.2 --routing round_robin --eviction lru,lfu,unicache"
        f" --seeds 0,1,2{flag}",
        Measure("hit_pct", ("round_robin+unicache",)), Measure("hit_pct", ("round_robin+lru",)), compare="diff",
        paper=3.9, goal=">=4", unit="points")


_GSP_91 = f"{GSP_PAPER_CACHE} --rate 24,36,42 --routing cache_aware,lbgr --eviction lru,rlt"
_HERD = "--trace {mooncake} --limit 4000 --warmup 500 --rate 12 --workers 8 --capacity-fraction 0.3 --slo-ms 5000 --eviction lru"
_COMPOSE_TOOL = f"{TOOLAGENT} --rate 120,150,165 --routing dualmap,cache_affinity,compose --eviction lru,rlt"
_COMPOSE_MOONCAKE = f"{MOONCAKE} --rate 15,18,19 --routing dualmap,preble,compose --eviction lru,rlt"
_COMPOSE_GSP = f"{GSP_PAPER_CACHE} --rate 36 --routing dualmap,cache_aware,lbgr,compose --eviction lru,rlt"
_COMPOSE_CHAT = ("--workload chat --workers 4 --capacity-fraction 0.3 --rate 4 --seeds 0,1,2"
                 " --routing dualmap,cache_aware,lbgr,compose --eviction lru,rlt,tlru")
_COMPOSE_MIX2 = ("--workload mix2 --workers 4 --capacity-fraction 0.2 --rate 8 --seeds 0,1,2"
                 " --routing dualmap,cache_aware,compose --eviction lru,rlt,tlru,unicache")
_PAPER_PAIRS = ("dualmap+lru", "dualmap+rlt", "lbgr+lru", "lbgr+rlt", "cache_aware+lru", "cache_aware+rlt",
                "cache_affinity+lru", "cache_affinity+rlt", "preble+lru", "preble+rlt", "dualmap+tlru", "lbgr+tlru",
                "cache_aware+tlru", "dualmap+unicache", "cache_aware+unicache")


def _compose_row(name: str, what: str, run: str, metric: str, rate: float | None, better: Literal["higher", "lower"],
                 others: tuple[str, ...]) -> Row:
    return Row(
        name, "9.5", "none (a combination no paper ran)",
        f"DualMap's pair scored by LBGR (compose+rlt) vs the best other pair run, {what}", run,
        Measure(metric, ("compose+rlt",), rate), Measure(metric, others, rate), compare="ratio", better=better,
        unit="x")


_HEAD_ROWS: tuple[Row, ...] = (
    Row("rlt_vs_lru_hit", "1", "LBGR/RLT, appendix Table 3 (RLT 41.9% vs leaf-LRU 6.1%)",
        "RLT's hit ratio - leaf-LRU's, one worker, GSP in round-robin order, 64 groups, 3,000 blocks",
        "--workload gsp --workload-param order=round_robin --workload-param groups=64 --rate 4 --workers 1"
        " --capacity-blocks 3000 --routing round_robin --eviction lru,rlt",
        Measure("hit_pct", ("round_robin+rlt",)), Measure("hit_pct", ("round_robin+lru",)), compare="diff",
        paper=35.8, unit="points"),
    Row("rlt_vs_lru_hit_small", "1", "LBGR/RLT, appendix Table 3 (RLT 41.9% vs leaf-LRU 6.1%)",
        "as above, 2,400 blocks (a cache below one round-robin cycle's working set)",
        "--workload gsp --workload-param order=round_robin --workload-param groups=64 --rate 4 --workers 1"
        " --capacity-blocks 2400 --routing round_robin --eviction lru,rlt",
        Measure("hit_pct", ("round_robin+rlt",)), Measure("hit_pct", ("round_robin+lru",)), compare="diff",
        paper=35.8, unit="points"),
    _lru_cache_row(100, 4.18),
    _lru_cache_row(1000, 4.45),
    _lru_cache_row(5000, 11.18),
    _lru_cache_row(10000, 21.16),
    _lru_cache_row(100000, 36.37),
    Row("lbgr_gsp_ttft", "9.1", "LBGR/RLT, Fig. 5 (GSP: median latency up to 11.96x lower)",
        "cache_aware+lru's median TTFT / lbgr+rlt's, GSP, 4 workers, 200k-token caches, 36 req/s, 3 seeds",
        _GSP_91, Measure("ttft_p50", ("cache_aware+lru",), 36), Measure("ttft_p50", ("lbgr+rlt",), 36),
        compare="ratio", paper=11.96, goal=">1", unit="x"),
    Row("lbgr_gsp_ttft_42", "9.1", "LBGR/RLT, Fig. 5 (GSP: median latency up to 11.96x lower)",
        "as above at 42 req/s (the edge of saturation)",
        _GSP_91, Measure("ttft_p50", ("cache_aware+lru",), 42), Measure("ttft_p50", ("lbgr+rlt",), 42),
        compare="ratio", paper=11.96, goal=">1", unit="x"),
    Row("lbgr_gsp_hit", "9.1", "LBGR/RLT, Fig. 5 (GSP hit ratio 37.3% vs 23.9%)",
        "lbgr+rlt's hit ratio - cache_aware+lru's, GSP, 36 req/s, 3 seeds",
        _GSP_91, Measure("hit_pct", ("lbgr+rlt",), 36), Measure("hit_pct", ("cache_aware+lru",), 36),
        compare="diff", paper=13.4, unit="points"),
    Row("lbgr_residual_published", "9.1", "issue #13: LBGR's residual must not herd (published router's residual)",
        "SLO attainment of LBGR as configured by default (bias-only residual), Mooncake 12 req/s",
        _HERD + " --routing lbgr", Measure("slo_pct", ("lbgr+lru",)), goal=">=90", unit="%"),
    Row("lbgr_residual_paper_text", "9.1", "LBGR/RLT, section 4.2 (4-feature signed residual)",
        "SLO attainment of LBGR with the paper text's residual, Mooncake 12 req/s",
        _HERD + """ --routing lbgr --set 'lbgr.features=["hit","miss","load","bias"]'"""
        """ --set 'lbgr.residual_target="signed"'""", Measure("slo_pct", ("lbgr+lru",)), unit="%"),
)

_DUALMAP_ROWS: tuple[Row, ...] = (
    _dualmap_row("dualmap_toolagent", "tool/agent (ours), engine events",
                 f"{TOOLAGENT} --rate 120,135,150,165,180 --routing dualmap,cache_affinity,min_ttft,preble --eviction lru",
                 ("cache_affinity+lru", "min_ttft+lru", "preble+lru"), ">=1.5"),
    _dualmap_row("dualmap_toolagent_approx", "tool/agent (ours), the router's own cache model",
                 f"{TOOLAGENT} --cache-mode approximate --rate 60,90,120,135,150,165"
                 " --routing dualmap,cache_affinity,least_loaded,min_ttft,preble --eviction lru", BASELINES, ">=1.5"),
    _dualmap_row("dualmap_toolagent_table1", "tool/agent shaped as DualMap's Table 1, engine events",
                 f"{TOOLAGENT_T1} --rate 20,25,30,35,40,45,50 --routing dualmap,cache_affinity,least_loaded,min_ttft,preble"
                 " --eviction lru", BASELINES, ">=1.5"),
    _dualmap_row("dualmap_mooncake", "Mooncake conversation, engine events",
                 f"{MOONCAKE} --rate 14,16,17,18,19,20 --routing dualmap,cache_affinity,min_ttft,preble --eviction lru",
                 ("cache_affinity+lru", "min_ttft+lru", "preble+lru"), ">=1.2"),
    _dualmap_row("dualmap_mooncake_approx", "Mooncake conversation, the router's own cache model",
                 f"{MOONCAKE} --cache-mode approximate --rate 12,14,16,17,18,19,20"
                 " --routing dualmap,cache_affinity,least_loaded,min_ttft,preble --eviction lru", BASELINES, ">=1.2"),
    _dualmap_row("dualmap_mooncake_capped", "Mooncake, inputs capped at 20,480 tokens (the paper's 7B setting)",
                 f"{MOONCAKE} --max-input-tokens 20480 --rate 24,26,28,30,32"
                 " --routing dualmap,cache_affinity,min_ttft,preble --eviction lru",
                 ("cache_affinity+lru", "min_ttft+lru", "preble+lru"), ">=1.2"),
)

# section 3.2's reading of the SLO switch (the less loaded candidate, its cache ignored), against
# the same baselines as dualmap_mooncake (section 8: the default follows A.5/A.6's TTFT estimate)
_DUALMAP_LESS_LOADED = Row(
    "dualmap_mooncake_less_loaded", "9.2", "DualMap, Fig. 7 and abstract (up to 2.25x effective capacity)",
    "as dualmap_mooncake, the SLO switch to the less loaded candidate (section 3.2's wording, switch_to=less_loaded)",
    f"{MOONCAKE} --rate 14,16,17,18,19,20 --routing dualmap --eviction lru --set 'dualmap.switch_to=\"less_loaded\"'",
    Measure("goodput", ("dualmap+lru",)),
    Measure("goodput", ("cache_affinity+lru", "min_ttft+lru", "preble+lru"), run=_DUALMAP_ROWS[3].run),
    compare="ratio", paper=2.25, goal=">=1.2", unit="x")

# UniCache without Stage 2's adaptation (weights stay 1): what the queues' own orders cost (9.4)
_UNICACHE_NO_STAGE2 = Row(
    "unicache_mix3_weights_fixed", "9.4", "UniCache, Fig. 12 (w/o Stage 2 ablation)",
    "UniCache's hit ratio - LRU's with the queue weights held at 1 (no update within the run), mix3, 3 seeds",
    "--workload mix3 --rate 4 --workers 1 --capacity-fraction 0.2 --routing round_robin --eviction lru,unicache"
    " --seeds 0,1,2 --set unicache.update_interval_s=1e9",
    Measure("hit_pct", ("round_robin+unicache",)), Measure("hit_pct", ("round_robin+lru",)), compare="diff",
    unit="points")

# ---- section 12: kvrouterd's default against the routers its users run (issue #27) ----------

#: the fleet of the comparison: 8 engines, caches 30% of each workload's distinct blocks, SLO 5 s,
#: engines reporting their load every 100 ms (as vLLM's metrics and llm-d's scrapers do)
PEER_FLEET = " --workers 8 --capacity-fraction 0.3 --slo-ms 5000 --load-report-ms 100 --eviction lru"
#: the peers as they are configured today, each without admission control of ours
PEER_ROUTERS = ("cache_aware", "dynamo", "llm_d")
#: workload -> (its arguments, each peer's capacity, kvrouterd's default's capacity; req/s), as
#: ``kvrouterd sim capacity`` found them (docs/results.md section 12 has the commands). A row runs
#: each capacity and 0.5 req/s either side: the reproduced number is the capacity as long as it
#: stays within that bracket, and shows at the bracket's edge when it moves out of it
PEER_WORKLOADS: dict[str, tuple[str, dict[str, float], float]] = {
    "mooncake": ("--trace {mooncake} --limit 4000 --warmup 500",
                 {"cache_aware": 6.5, "dynamo": 7.5, "llm_d": 2.0}, 16.0),
    "toolagent": ("--workload toolagent --workload-param requests=3000 --warmup 300"
                  " --workload-param tool_tokens=[2048,4096,8192] --workload-param user_tokens=[1024,6144]"
                  " --workload-param output_tokens=182",
                  {"cache_aware": 28.0, "dynamo": 26.5, "llm_d": 27.5}, 29.5),
    "longchat": ("--workload longchat --workload-param conversations=1500 --warmup 300 --cache-decode",
                 {"cache_aware": 122.0, "dynamo": 119.5, "llm_d": 120.5}, 124.0),
    "gsp": ("--workload gsp --warmup 300", {"cache_aware": 113.0, "dynamo": 89.0, "llm_d": 102.0}, 116.0),
}


def _bracket(*capacities: float, extra: tuple[float, ...] = ()) -> str:
    rates = sorted({round(c + d, 1) for c in capacities for d in (-0.5, 0.0, 0.5) if c + d > 0} | set(extra))
    return "--rate " + ",".join(f"{r:g}" for r in rates)


def _peer_rows(name: str) -> tuple[Row, Row]:
    workload, peers, ours = PEER_WORKLOADS[name]
    peer_run = (f"{workload}{PEER_FLEET} --routing {','.join(PEER_ROUTERS)} --admission-deadline off "
                + _bracket(*peers.values()))
    overload = round(ours * 1.5 * 2) / 2
    ours_run = f"{workload}{PEER_FLEET} --routing cache_aware " + _bracket(ours, extra=(overload,))
    capacity = Row(
        f"peer_capacity_{name}", "12", "issue #27 (targets: >= 1.25x on three workloads, never below 1.0x)",
        f"capacity of kvrouterd's default (cache_aware + deadline admission) / the best peer router's"
        f" (SGLang cache_aware, Dynamo KV cost, llm-d default scorers; no admission), {name}",
        ours_run, Measure("goodput", ("cache_aware+lru",)),
        Measure("goodput", tuple(f"{p}+lru" for p in PEER_ROUTERS), run=peer_run),
        compare="ratio", goal=">=1.25", unit="x")
    kept = Row(
        f"peer_overload_{name}", "12", "issue #27 (target: >= 80% of peak goodput at 1.5x capacity)",
        f"goodput of kvrouterd's default at {overload:g} req/s (1.5x its capacity) / its peak, {name}",
        ours_run, Measure("good_rps", ("cache_aware+lru",), overload), Measure("peak_good_rps", ("cache_aware+lru",)),
        compare="ratio", goal=">=0.8", unit="x")
    return capacity, kept


def _as_published(row: Row) -> Row:
    """Sections 1-11 measure policies as their papers ran them: deadline admission (the daemon's
    default since issue #27) off, unless the row says otherwise."""
    if row.run.startswith("cache ") or "--admission-deadline" in row.run:
        return row
    return dataclasses.replace(row, run=row.run + " --admission-deadline off")


_PUBLISHED_ROWS: tuple[Row, ...] = (
    *_HEAD_ROWS,
    *_DUALMAP_ROWS,
    _DUALMAP_LESS_LOADED,
    *(_tlru_row(b) for b in (500, 600, 700, 800, 1000)),
    *(_tlru_longchat_row(b) for b in (500, 600, 700, 800)),
    *(_unicache_row(m, d) for d in (False, True) for m in ("mix1", "mix2", "mix3")),
    _UNICACHE_NO_STAGE2,
    _compose_row("compose_toolagent", "tool/agent goodput", _COMPOSE_TOOL, "goodput", None, "higher",
                 ("dualmap+lru", "dualmap+rlt", "cache_affinity+lru", "cache_affinity+rlt")),
    _compose_row("compose_mooncake", "Mooncake goodput", _COMPOSE_MOONCAKE, "goodput", None, "higher",
                 ("dualmap+lru", "dualmap+rlt", "preble+lru", "preble+rlt")),
    _compose_row("compose_gsp", "GSP median TTFT, 36 req/s, 3 seeds", _COMPOSE_GSP, "ttft_p50", 36, "lower",
                 ("dualmap+lru", "dualmap+rlt", "cache_aware+lru", "cache_aware+rlt", "lbgr+lru", "lbgr+rlt")),
    _compose_row("compose_chat", "LBGR's chat P95 TTFT, 4 req/s, 3 seeds", _COMPOSE_CHAT, "ttft_p95", None, "lower",
                 tuple(p for p in _PAPER_PAIRS if p.split("+")[0] in ("dualmap", "cache_aware", "lbgr")
                       and p.split("+")[1] in ("lru", "rlt", "tlru"))),
    _compose_row("compose_mix2", "mix2 P95 TTFT, 8 req/s, 3 seeds", _COMPOSE_MIX2, "ttft_p95", None, "lower",
                 tuple(p for p in _PAPER_PAIRS if p.split("+")[0] in ("dualmap", "cache_aware"))),
    *(_admission_row(r) for r in _DUALMAP_ROWS if "approx" not in r.name),
)

ROWS: tuple[Row, ...] = (
    *(_as_published(r) for r in _PUBLISHED_ROWS),
    *(row for name in PEER_WORKLOADS for row in _peer_rows(name)),
)
