"""Route + Complete over 64 / 256 / 1,024 workers along the paths a heterogeneous fleet takes.

``decision`` and ``--scaling`` time one path: a base-model prompt over a fleet that declares no
pools. Real fleets also route model pools, LoRA adapters, prefill/decode pools, Routes naming
their candidate workers, and, past capacity, Routes whose chosen worker is predicted to miss the
SLO, which deadline admission prices on every eligible worker and reroutes. Each of those once
cost a 1,024-worker router ten to a hundred times what it cost a 64-worker one (issue #30); this
stage times each, so a path that falls off again shows here. Reports, never asserts.

Every path is the daemon's in-process Route (``AdmissionGate.route_now``: decide, deadline
admission, commit) then its Complete, untraced, with a fresh 4,000-token prompt's keys each time
(hashed ahead, outside the timing) on an idle event-driven fleet:

``plain``        no model, no pools (``decision``'s path, the cycle with admission);
``model_pool``   every worker declares the model, the Route names it;
``lora``         workers declare four adapters, two slots each; the Route names one (a few
                 workers hold it loaded: the stage's residency tiers, every Route);
``pd``           a quarter of the workers prefill, the rest decode: both hops decided;
``named_8``      the Route names 8 candidate workers (``RouteRequest.candidate_workers``);
``past_capacity`` every worker but one in eight holds 4 requests in flight whose backlog the
                 SLO cannot wait for, and the prompt's prefix is cached on a busy one: the policy
                 picks it, admission finds it misses, prices every eligible worker and reroutes
                 to those that meet the SLO (the clock stands still, so the backlogs do).

Each (path, width) cell runs in a fresh process, as the sizing grid's do: in the bench's own
process, after the decision stage's 10^6-block routers, the collector's passes over their
leftovers doubled some cells. One cell alone, one JSON line, optionally with every Route naming a routing policy (the
per-policy table in docs/operations/performance.md):

    python -m kvrouterd.benchmarks.fleet_paths --cell past_capacity 1024
    python -m kvrouterd.benchmarks.fleet_paths --cell plain 1024 --policy lbgr
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from ..clock import ManualClock
from ..config import Config
from ..errors import UnknownPolicy
from ..index.workers import WorkerSpec
from ..protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored, WorkerRole
from ..router import Router
from ..server.admission import AdmissionGate
from .workload import BLOCK_SIZE, PROMPT_TOKENS

__all__ = ["FLEETS", "PATHS", "fleet_path_costs"]

PATHS = ("plain", "model_pool", "lora", "pd", "named_8", "past_capacity")
FLEETS = (64, 256, 1024)
ADAPTERS = ("a0", "a1", "a2", "a3")
#: the SLO past capacity, in multiples of the prompt's own prefill: an idle worker meets it,
#: one with four prompts ahead does not
_SLO_PREFILLS = 2.0


def _fleet(path: str, workers: int) -> tuple[Router, AdmissionGate, Callable[[int, Any], RouteRequest]]:
    config = Config(block_size=BLOCK_SIZE)
    router = Router(config.router_settings(), ManualClock(), random.Random(7))
    for i in range(workers):
        router.add_worker(WorkerSpec(
            f"w{i}", f"10.0.{i // 250}.{i % 250}:8000", mode=CacheMode.EVENTS, capacity_blocks=100_000,
            models=("m",) if path in ("model_pool", "lora") else (),
            loras=ADAPTERS if path == "lora" else (), max_loras=2 if path == "lora" else 0,
            role=(WorkerRole.PREFILL if i % 4 == 0 else WorkerRole.DECODE) if path == "pd" else WorkerRole.BOTH))
    gate = AdmissionGate(router, config.admission)
    names = tuple(f"w{i}" for i in random.Random(5).sample(range(workers), 8))

    def request(n: int, keys: Any) -> RouteRequest:
        req = RouteRequest(f"r{n}", keys, PROMPT_TOKENS)
        if path in ("model_pool", "lora"):
            req.model = "m"
        if path == "lora":
            req.lora = "a1"
        if path == "named_8":
            req.candidate_workers = names
        return req

    if path == "lora":  # a few workers hold the adapter, as after its first Routes
        for i in range(0, workers, max(1, workers // 4)):
            router.report_load(f"w{i}", 0, 0, 0.0, loaded_loras=["a1"])
    return router, gate, request


def _past_capacity(router: Router, gate: AdmissionGate, prompt: bytes) -> float:
    """Load the fleet as ``past_capacity`` says; returns the SLO for its Routes."""
    guard = gate.guard
    assert guard is not None  # the daemon's default: deadline admission on
    n = 0
    for w in sorted(router.workers, key=lambda w: w.slot):
        if w.slot % 8 == 0:
            continue
        for _ in range(4):
            n += 1
            keys = router.keys_for_tokens(random.Random(n).randbytes(len(prompt)))
            gate.route_now(RouteRequest(f"busy{n}", keys, PROMPT_TOKENS, candidate_workers=(w.id,)), False)
    # the prompt's prefix on a busy worker: the policy follows it there
    router.apply(EventBatch("w1", 0, (Stored(tuple(array("I", prompt[:len(prompt) // 2])), None),)))
    return _SLO_PREFILLS * guard.prefill_ms(PROMPT_TOKENS, 0)


def fleet_path_cost(path: str, workers: int, repeats: int = 300, policy: str = "") -> dict[str, Any]:
    """Median and p90 microseconds of one Route + Complete along ``path`` over ``workers``, each
    Route naming ``policy`` ("": the default, cache_aware): a fleet that routes with another
    policy pays that policy's own cost per worker."""
    router, gate, request = _fleet(path, workers)
    rng = random.Random(11)
    prompt = rng.randbytes(PROMPT_TOKENS * 4)
    slo = _past_capacity(router, gate, prompt) if path == "past_capacity" else 0.0
    # a fresh prompt each Route (past capacity: sharing the cached prefix), hashed ahead
    half = len(prompt) // 2
    keys = [router.keys_for_tokens(prompt[:half] + rng.randbytes(len(prompt) - half) if path == "past_capacity"
                                   else rng.randbytes(len(prompt))) for _ in range(repeats + 20)]
    samples: list[float] = []
    reasons: dict[str, int] = {}
    placements: dict[str, int] = {}  # a LoRA Route's adapter on its worker: loaded, free slot, swap
    chosen: set[str] = set()
    disaggregated = 0
    rerouted = gate.guard.rerouted if gate.guard is not None else 0
    busy = router.workers.inflight_count  # past capacity's load, which stays
    clock = time.perf_counter
    gc.collect()
    for n, k in enumerate(keys):
        req = request(n, k)
        req.ttft_slo_ms = slo
        req.policy = policy
        t0 = clock()
        result = gate.route_now(req, False)
        done = Completion(result.request.request_id)
        router.complete(done)
        gate.on_complete(result.worker.id, done)
        if n >= 20:  # the first warm the caches
            samples.append(clock() - t0)
            d = result.decision
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
            if d.lora_placement:
                placements[d.lora_placement] = placements.get(d.lora_placement, 0) + 1
            disaggregated += d.prefill is not None
            chosen.add(result.worker.id)
    samples.sort()
    return {
        "path": path,
        "workers": workers,
        "policy": router.routing_policy(policy).name,
        "us_median": statistics.median(samples) * 1e6,
        "us_p90": samples[int(0.9 * (len(samples) - 1))] * 1e6,
        "reasons": reasons,
        # what the timed Routes did (warm-up included in rerouted), so a reader (and a test) can
        # tell the path was the one named
        "rerouted": (gate.guard.rerouted - rerouted) if gate.guard is not None else 0,
        "lora_placements": placements,
        "disaggregated": disaggregated,
        "workers_chosen": len(chosen),
        "left_in_flight": router.workers.inflight_count - busy,
    }


def fleet_path_costs(fleets: tuple[int, ...] = FLEETS, repeats: int = 300,
                     progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """``fleet_path_cost`` for every path and fleet width, each cell in a fresh process."""
    rows = []
    for path in PATHS:
        if progress is not None:
            progress(f"fleet paths: {path} over {', '.join(map(str, fleets))} workers")
        for w in fleets:
            cmd = [sys.executable, "-m", "kvrouterd.benchmarks.fleet_paths", "--cell", path, str(w),
                   "--repeats", str(repeats)]
            rows.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Paths down, fleet widths across: median (p90) microseconds per Route + Complete."""
    fleets = sorted({r["workers"] for r in rows})
    lines = ["| path | " + " | ".join(f"{w:,} workers" for w in fleets) + " |",
             "| --- | " + " | ".join("---:" for _ in fleets) + " |"]
    for path in PATHS:
        cells = {r["workers"]: r for r in rows if r["path"] == path}
        if cells:
            lines.append(f"| {path} | " + " | ".join(
                f"{cells[w]['us_median']:.1f} ({cells[w]['us_p90']:.1f})" if w in cells else "" for w in fleets) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", nargs=2, metavar=("PATH", "WORKERS"), required=True,
                        help=f"time one path ({', '.join(PATHS)}) over WORKERS and print it as one JSON line")
    parser.add_argument("--repeats", type=int, default=300, help="Routes timed (default 300)")
    parser.add_argument("--policy", default="", metavar="NAME",
                        help="the routing policy every Route names (default: the router's, cache_aware)")
    args = parser.parse_args(argv)
    path, workers = args.cell[0], int(args.cell[1])
    if path not in PATHS:
        parser.error(f"unknown path {path!r}; choose from {', '.join(PATHS)}")
    try:
        print(json.dumps(fleet_path_cost(path, workers, args.repeats, args.policy)))
    except UnknownPolicy as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
