"""The sizing grid: route decision cost and memory per indexed block over fleet width x index size.

    kvrouterd bench --scaling                    # 8/64/256/1,024 workers x 10^5/10^6 blocks
    kvrouterd bench --scaling --rounds 5 --json
    python -m kvrouterd.benchmarks.scaling --cell 1024 1000000   # one cell, one JSON line

Each cell is measured in a fresh process, so one cell's heap is not the next one's baseline:
the process builds the daemon's default router (``workload.build_router``: cache_aware, 4,000-token
prompts of 250 blocks spread round-robin over the workers, the benchmark prompt cached to a
different depth on each), takes its RSS growth over the build as the fleet's memory, then times
2,000 decisions as Route makes them (``inprocess.decision_timings``: hash + match + policy,
untraced). A cell runs ``rounds`` times and the grid shows the median of the runs' medians,
with every run's median beside it: on a shared machine one run can meet cold caches or another
process. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BLOCKS", "WORKERS", "measure_cell", "scaling_grid", "grid_table"]

#: fleet widths of the grid: within one 64-bit holder word, and past it
WORKERS = (8, 64, 256, 1024)
#: index sizes of the grid (blocks of 16 tokens)
BLOCKS = (100_000, 1_000_000)


def measure_cell(workers: int, blocks: int, repeats: int = 2000) -> dict[str, Any]:
    """One cell in this process: the fleet's RSS growth per indexed block, then the decision cost."""
    from ..index import native
    from .inprocess import _rss_bytes, decision_timings
    from .workload import build_router

    before = _rss_bytes()
    router, prompt = build_router(workers, blocks)
    grown = _rss_bytes() - before
    result = decision_timings(router, prompt, repeats)
    result["fleet_rss_bytes"] = grown
    result["bytes_per_block"] = grown / len(router.index)
    result["native"] = native.module is not None
    return result


def _cell_in_subprocess(workers: int, blocks: int, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvrouterd.benchmarks.scaling", "--cell", str(workers), str(blocks),
           "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def scaling_grid(workers: Sequence[int] = WORKERS, blocks: Sequence[int] = BLOCKS, rounds: int = 3,
                 repeats: int = 2000, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every (workers, blocks) cell, ``rounds`` fresh processes each; a row per cell with the
    median over runs of the decision median, p99, hashing share and bytes per block."""
    rows: list[dict[str, Any]] = []
    for n in blocks:
        for w in workers:
            runs = []
            for r in range(rounds):
                if progress is not None:
                    progress(f"scaling: {w} workers, {n:,} blocks, run {r + 1}/{rounds}")
                runs.append(_cell_in_subprocess(w, n, repeats))
            rows.append({
                "workers": w,
                "indexed_blocks": statistics.median(x["indexed_blocks"] for x in runs),
                "decision_us_median": statistics.median(x["decision_us_median"] for x in runs),
                "decision_us_runs": [round(x["decision_us_median"], 1) for x in runs],
                "decision_us_p99": statistics.median(x["decision_us_p99"] for x in runs),
                "hash_us_median": statistics.median(x["hash_us_median"] for x in runs),
                "bytes_per_block": statistics.median(x["bytes_per_block"] for x in runs),
                "fleet_rss_bytes": statistics.median(x["fleet_rss_bytes"] for x in runs),
                "native": all(x["native"] for x in runs),
            })
    return rows


def grid_table(rows: Sequence[dict[str, Any]]) -> str:
    """The grid as a Markdown table, the form docs/operations/performance.md quotes."""
    lines = ["| workers | indexed blocks | decision us, median (runs) | p99 us | of which hashing us "
             "| bytes / block | fleet RSS MB |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        runs = ", ".join(f"{v:.1f}" for v in r["decision_us_runs"])
        lines.append(f"| {r['workers']:,} | {r['indexed_blocks']:,.0f} | {r['decision_us_median']:.1f} ({runs}) "
                     f"| {r['decision_us_p99']:.1f} | {r['hash_us_median']:.1f} | {r['bytes_per_block']:.0f} "
                     f"| {r['fleet_rss_bytes'] / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", nargs=2, type=int, metavar=("WORKERS", "BLOCKS"), required=True,
                        help="measure one cell in this process and print it as one JSON line")
    parser.add_argument("--repeats", type=int, default=2000, help="decisions timed (default 2000)")
    args = parser.parse_args(argv)
    print(json.dumps(measure_cell(args.cell[0], args.cell[1], args.repeats)))


if __name__ == "__main__":
    main()
