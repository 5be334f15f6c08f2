"""``kvrouterd sim capacity``: each policy's capacity on a workload, found by search, and what it keeps past it.

Capacity is the highest request rate a fleet serves with at least 90% of requests within their
TTFT SLO (issue #27's measure, DualMap's "effective capacity"), in steps of ``--step`` (0.5
req/s). A shed request counts as one that missed (``sim cluster``'s accounting). The arguments
are ``sim cluster``'s (workload, policies, fleet, engines); its ``--rate`` list is the coarse
grid the search starts from. For every routing x eviction pair:

1. run the coarse rates in order until one falls below the target;
2. halve the interval between the last rate that met it and the first that did not, down to
   ``--step``;
3. run at each ``--overload`` multiple of the capacity (1.25x and 1.5x; rounded to the step)
   and report goodput there (requests within the SLO per second) as a share of the best
   goodput any rate of the search reached: what "degrades gracefully" means.

Attainment is the mean over ``--seeds`` of each seed's, as ``sim reproduce`` pools it. The
search assumes attainment falls as the rate rises; every rate it ran is in ``--json`` so a
curve that does not can be seen.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ..errors import KVRouterError
from . import cluster_cli
from .cluster import simulate

__all__ = ["PairCapacity", "add_arguments", "find_capacity", "run"]

#: share of requests within their SLO a rate must reach to count as served
TARGET = 0.9


@dataclass
class PairCapacity:
    """What the search found for one routing x eviction pair."""

    pair: str
    #: highest rate meeting the target (0: not even the first coarse rate); None: every coarse rate met it
    capacity: float | None
    #: rate -> (mean SLO attainment, mean goodput in requests within SLO per second), every rate run
    points: dict[float, tuple[float, float]] = field(default_factory=dict)
    #: overload multiple -> goodput at that multiple of the capacity
    overload: dict[float, float] = field(default_factory=dict)

    @property
    def peak_goodput(self) -> float:
        return max((good for _, good in self.points.values()), default=0.0)


def _snap(rate: float, step: float) -> float:
    return round(round(rate / step) * step, 6)


def find_capacity(measure: Callable[[float], tuple[float, float]], coarse: Sequence[float], step: float,
                  overloads: Sequence[float] = ()) -> tuple[float | None, dict[float, tuple[float, float]], dict[float, float]]:
    """The search of the module docstring over ``measure(rate) -> (attainment, goodput)``."""
    points: dict[float, tuple[float, float]] = {}

    def at(rate: float) -> tuple[float, float]:
        if rate not in points:
            points[rate] = measure(rate)
        return points[rate]

    passed, failed = 0.0, None
    for rate in sorted(coarse):
        if at(rate)[0] >= TARGET:
            passed = rate
        else:
            failed = rate
            break
    if failed is None:
        return None, points, {}
    while failed - passed > step + 1e-9:
        mid = _snap((passed + failed) / 2, step)
        if mid <= passed or mid >= failed:
            mid = _snap(passed + step, step)
        if at(mid)[0] >= TARGET:
            passed = mid
        else:
            failed = mid
    overload = {k: at(_snap(passed * k, step))[1] for k in overloads} if passed > 0 else {}
    return passed, points, overload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cluster_cli.add_arguments(parser)
    s = parser.add_argument_group("search")
    s.add_argument("--step", type=float, default=0.5, metavar="R",
                   help="resolution of the capacity search, req/s (default 0.5)")
    s.add_argument("--overload", type=cluster_cli._floats, default=[1.25, 1.5], metavar="K[,K..]",
                   help="report goodput at these multiples of each capacity (default 1.25,1.5)")


def _table(found: Sequence[PairCapacity], overloads: Sequence[float]) -> str:
    head = ["pair", "capacity req/s"] + [f"goodput at {k:g}x (% of peak)" for k in overloads] + ["runs"]
    rows = []
    for f in found:
        cap = "above the grid" if f.capacity is None else f"{f.capacity:g}"
        peak = f.peak_goodput
        cells = [f"{f.overload[k]:.2f} ({100 * f.overload[k] / peak:.0f}%)" if k in f.overload and peak else "-"
                 for k in overloads]
        rows.append([f.pair, cap, *cells, str(len(f.points))])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.pd is not None or args.out:
        print("kvrouterd sim capacity: --pd and --out are sim cluster's; search one aggregated fleet here",
              file=sys.stderr)
        return 2
    if not args.step > 0 or not all(k > 0 for k in args.overload):
        print("kvrouterd sim capacity: --step and --overload must be > 0", file=sys.stderr)
        return 2
    try:
        p = cluster_cli.plan(args)
        if not p.rates or p.rates[0] is None:
            raise ValueError("give the coarse grid the search starts from: --rate LO:HI:STEP or a list")
        found = []
        for r_spec in p.routings:
            for e_spec in p.evictions:
                pair = f"{r_spec['name']}+{e_spec['name']}"

                def measure(rate: float, r_spec=r_spec, e_spec=e_spec, pair=pair) -> tuple[float, float]:
                    att = good = 0.0
                    for seed in p.seeds:
                        wl = p.workload_for(seed, rate)
                        res = simulate(p.cfg, wl, p.settings_for(wl), routing=r_spec, eviction=e_spec, seed=seed, rate=rate)
                        att += res.summary.slo_attainment / len(p.seeds)
                        good += res.summary.goodput_rps / len(p.seeds)
                    if not args.quiet:
                        print(f"  {pair} at {rate:g} req/s: {100 * att:.1f}% within SLO, goodput {good:.2f}",
                              file=sys.stderr, flush=True)
                    return att, good

                cap, points, overload = find_capacity(measure, [r for r in p.rates if r is not None], args.step,
                                                      args.overload)
                found.append(PairCapacity(pair, cap, dict(sorted(points.items())), overload))
    except (KVRouterError, ValueError, OSError) as exc:
        print(f"kvrouterd sim capacity: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"meta": dict(p.meta, target=TARGET, step=args.step,
                            command="kvrouterd sim capacity " + " ".join(sys.argv[3:])),
               "pairs": [dict(asdict(f), points={str(k): v for k, v in f.points.items()},
                              overload={str(k): v for k, v in f.overload.items()},
                              peak_goodput=f.peak_goodput) for f in found]}
        print(json.dumps(doc, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    else:
        print(f"{p.workload_name}: capacity = highest rate with >= {100 * TARGET:.0f}% of requests within the SLO, "
              f"in {args.step:g} req/s steps")
        print(_table(found, args.overload))
    return 0
