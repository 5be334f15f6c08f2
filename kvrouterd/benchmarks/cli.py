"""Benchmarks that report and never assert: decision cost, gRPC throughput, ingest, memory,
and Route + Complete along a heterogeneous fleet's paths (pools, LoRA, P/D, past capacity).

    kvrouterd bench                 # everything, a table at the end (a few minutes)
    kvrouterd bench --json          # one JSON object with every number
    kvrouterd bench --only decision,memory --quick
    kvrouterd bench --scaling       # workers x indexed blocks -> decision us, bytes/block

What each figure (and --json key) measures, how the gRPC loads are sent and completed, and how
to read rounds on a shared machine: docs/operations/performance.md, "Running kvrouterd bench".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

STAGES = ("decision", "fleet", "grpc", "ingest", "memory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--only", default=",".join(STAGES), metavar="STAGES",
                        help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and shorter runs (smoke test)")
    # how to read the rounds (same machine, same-round ratios) is in docs/operations/performance.md
    parser.add_argument("--rounds", type=int, default=3, metavar="N",
                        help="gRPC rounds; each ratio is the median of its rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=3.0, metavar="S",
                        help="seconds of each gRPC load run (default 3)")
    parser.add_argument("--scaling", action="store_true",
                        help="print the sizing grid (docs/operations/performance.md) instead of the stages")


class _Steps:
    """Progress over the benchmark's steps: a tqdm bar when stderr is a terminal, otherwise one
    timestamped line per step (logs and CI keep a record, with no carriage returns)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="step", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False,
                         dynamic_ncols=True)
        self._started = False

    def __call__(self, msg: str) -> None:
        if self._bar.disable:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
            return
        if self._started:
            self._bar.update(1)  # the previous step is done
        self._started = True
        self._bar.set_description_str(msg)

    def close(self) -> None:
        if self._started:
            self._bar.update(1)
        self._bar.close()


def _median_of_rounds(values: list[float]) -> str:
    """A ratio's median and every round's value, as the table prints them."""
    return f"{statistics.median(values):.2f} (rounds: {', '.join(f'{r:.2f}' for r in values)})"


def _load_figures(load: dict[str, Any]) -> str:
    """One gRPC load's rate and latency, as the table prints them."""
    return f"{load['rps']:.0f} rps, p50 {load['p50_us']:.0f} us, p99 {load['p99_us']:.0f} us"


def _stream_figures(runs: list[Any], mid: Any, load: str, key: str, label: str,
                    result: dict[str, object], rows: list[tuple[str, str]]) -> None:
    """One streamed load's keys and rows: the daemon's rate, its ratios over the trivial unary
    handler and over the trivial stream (rates and server CPU), and the items per message."""
    def cpu(x: Any, num: tuple[str, str]) -> float:
        return x[num[0]][num[1]]["server_cpu_us_per_call"] / x["daemon"][load]["server_cpu_us_per_call"]

    timed = [x for x in runs if "server_cpu_us_per_call" in x["daemon"][load]]
    unary = [x["daemon"][load]["rps"] / x["trivial"]["inflight_64"]["rps"] for x in runs]
    like = [x["daemon"][load]["rps"] / x["trivial"][load]["rps"] for x in runs]
    ceiling = [x["trivial"][load]["rps"] / x["trivial"]["inflight_64"]["rps"] for x in runs]
    unary_cpu = [cpu(x, ("trivial", "inflight_64")) for x in timed]
    like_cpu = [cpu(x, ("trivial", load)) for x in timed]
    items = statistics.median(x["daemon"][load]["batch_items_sent"] for x in runs)
    result[f"grpc_stream_route{key}_rps"] = statistics.median(x["daemon"][load]["rps"] for x in runs)
    result[f"grpc_stream_route{key}_vs_trivial_unary_ratio"] = statistics.median(unary)
    result[f"grpc_stream_route{key}_vs_trivial_stream_ratio"] = statistics.median(like)
    result[f"grpc_trivial_stream{key}_vs_unary_ratio"] = statistics.median(ceiling)
    if timed:  # the same comparisons in server CPU per call, which load disturbs much less
        result[f"grpc_stream_route{key}_vs_trivial_unary_cpu_ratio"] = statistics.median(unary_cpu)
        result[f"grpc_stream_route{key}_vs_trivial_stream_cpu_ratio"] = statistics.median(like_cpu)
    result[f"grpc_stream{key}_items_per_message"] = items
    rows.append((f"gRPC RouteStream (+ complete) daemon, 64 in flight over 8 streams, {label}",
                 _load_figures(mid["daemon"][load])))
    rows.append(("  calls per stream message sent (median of rounds)", f"{items:.1f}"))
    rows.append(("  daemon / trivial unary ratio", _median_of_rounds(unary)))
    if timed:
        rows.append(("  the same in server CPU per call (trivial unary / streamed daemon)", _median_of_rounds(unary_cpu)))
    rows.append((f"gRPC RouteStream (+ complete) trivial, {label}", _load_figures(mid["trivial"][load])))
    rows.append(("  daemon / trivial stream ratio", _median_of_rounds(like)))
    if timed:
        rows.append(("  the same in server CPU per call (trivial stream / streamed daemon)", _median_of_rounds(like_cpu)))
    rows.append(("  trivial stream / trivial unary (what streaming can give)", _median_of_rounds(ceiling)))


def _memory_in_subprocess(blocks: int, engine_hashes: bool) -> dict[str, float]:
    code = (
        "import json,sys; from kvrouterd.benchmarks.inprocess import memory_per_block; "
        f"print(json.dumps(memory_per_block({blocks}, {engine_hashes})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _run_scaling(args: argparse.Namespace) -> int:
    from .scaling import BLOCKS, WORKERS, grid_table, scaling_grid

    blocks = (10_000, 100_000) if args.quick else BLOCKS
    rounds = 1 if args.quick else max(1, args.rounds)
    progress = _Steps(len(WORKERS) * len(blocks) * rounds)
    rows = scaling_grid(WORKERS, blocks, rounds, repeats=300 if args.quick else 2000, progress=progress)
    progress.close()
    if args.json:
        print(json.dumps({"scaling": rows}, indent=2))
    else:
        native = "C fast path" if all(r["native"] for r in rows) else "pure Python"
        print(f"\nkvrouterd bench --scaling ({native}; 4,000-token prompt, block size 16, cache_aware; "
              f"median of {rounds} fresh processes a cell)")
        print(grid_table(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    from .inprocess import decision_cost

    if args.scaling:
        return _run_scaling(args)
    stages = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        print(f"unknown stage(s): {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    blocks = 100_000 if args.quick else 1_000_000
    seconds = 1.0 if args.quick else args.seconds
    rounds = 1 if args.quick else max(1, args.rounds)
    from ..index import native

    steps = {"decision": 4, "fleet": 6, "grpc": rounds + 1, "ingest": 1, "memory": 1}
    _progress = _Steps(sum(steps[stage] for stage in set(stages)))
    result: dict[str, object] = {"indexed_blocks": blocks, "prompt_tokens": 4000, "block_size": 16,
                                 "native": native.module is not None}
    rows: list[tuple[str, str]] = [("block keys, match walk, engine-hash map", native.status)]

    if "decision" in stages:
        for workers in (8, 64, 256, 1024):
            _progress(f"decision cost: {workers} workers, {blocks:,} blocks")
            d = decision_cost(workers, blocks, repeats=300 if args.quick else 2000)
            result[f"decision_{workers}w"] = d
            rows.append((f"decision, {workers} workers (median / p99)", f"{d['decision_us_median']:.1f} / {d['decision_us_p99']:.1f} us"))
            rows.append(("  of which hashing 250 blocks", f"{d['hash_us_median']:.1f} us"))
            rows.append((f"  route + complete cycle, {workers} workers", f"{d['route_complete_us_median']:.1f} us"))
        result["route_decision_us_median"] = result["decision_64w"]["decision_us_median"]  # type: ignore[index]
        for workers in (256, 1024):
            result[f"route_decision_us_median_{workers}w"] = result[f"decision_{workers}w"]["decision_us_median"]  # type: ignore[index]

    if "fleet" in stages:
        from .fleet_paths import fleet_path_costs, table

        fleet = fleet_path_costs(repeats=100 if args.quick else 300, progress=_progress)
        result["fleet_paths"] = fleet
        for r in fleet:
            result[f"fleet_{r['path']}_us_{r['workers']}w"] = r["us_median"]
        fleet_table = table(fleet)

    if "grpc" in stages:
        from .grpc_bench import route_throughput, server_grpc_experiments
        from .workload import build_router

        result["grpc_server_experiments"] = server_grpc_experiments()
        rows.append(("gRPC experiments of the servers (GRPC_EXPERIMENTS)", result["grpc_server_experiments"]))

        _, prompt = build_router(1, 1000)
        runs = []
        for r in range(rounds):
            _progress(f"gRPC Route round {r + 1}/{rounds}: trivial vs daemon (64 workers, {blocks:,} blocks), {seconds:g}s each")
            runs.append(route_throughput(64, blocks, seconds, prompt))
        ratios = [x["daemon"]["inflight_64"]["rps"] / x["trivial"]["inflight_64"]["rps"] for x in runs]
        ratios1 = [x["daemon"]["inflight_1"]["rps"] / x["trivial"]["inflight_1"]["rps"] for x in runs]
        mid = runs[ratios.index(statistics.median(ratios))] if len(runs) % 2 else runs[-1]
        result["grpc_runs"] = runs
        # which path of the policy the measured decisions took (prefix_match, imbalanced, ...)
        reasons = {load: dict(sum((Counter(x["daemon"][load]["reasons"]) for x in runs), Counter()))
                   for load in ("inflight_1", "inflight_64", "stream_8x8", "stream_8x8_single")}
        result["grpc_daemon_reasons"] = reasons
        result["grpc_route_vs_trivial_ratio"] = statistics.median(ratios)
        result["grpc_route_vs_trivial_ratio_inflight_1"] = statistics.median(ratios1)
        for who in ("trivial", "daemon"):
            for n in (1, 64):
                m = mid[who][f"inflight_{n}"]
                rows.append((f"gRPC Route + Complete {who}, {n} in flight", _load_figures(m)))
        rows.append(("gRPC Route daemon/trivial ratio, 64 in flight", _median_of_rounds(ratios)))
        rows.append(("gRPC Route daemon/trivial ratio, 1 in flight", f"{statistics.median(ratios1):.2f}"))
        # the streamed loads: as the SDK sends (calls ready together in one batch message), then
        # one message per Route and per Complete (the SDK against a router without batches)
        for load, key, label in (("stream_8x8", "", "coalesced as the SDK does"),
                                 ("stream_8x8_single", "_one_per_message", "one message per call")):
            _stream_figures(runs, mid, load, key, label, result, rows)
        server_cpu = [x["daemon"]["stream_8x8"]["server_cpu_us_per_call"] for x in runs
                      if "server_cpu_us_per_call" in x["daemon"]["stream_8x8"]]
        if server_cpu:
            result["grpc_stream_route_server_cpu_us"] = statistics.median(server_cpu)
            rows.append(("daemon server CPU per streamed Route + Complete, us (median of rounds)",
                         _median_of_rounds(server_cpu)))
        # the same load against the daemon as deployed (/metrics on, Completes reporting latencies
        # and cached tokens), and against the floor of any Python router (grpc_bench.FloorService)
        for mode, key, label in (
            ("observed", "grpc_stream_route_observed_server_cpu_us",
             "daemon with /metrics on, Completes reporting TTFT, e2e and cached tokens"),
            ("deadline_off", "grpc_stream_route_deadline_off_server_cpu_us",
             "daemon with deadline admission off (admission.deadline: off)"),
            ("floor", "grpc_stream_floor_server_cpu_us", "floor: a Python router that only hashes, matches and answers"),
        ):
            rows.append((f"gRPC RouteStream (+ complete), {label}", _load_figures(mid[mode]["stream_8x8"])))
            cpu = [x[mode]["stream_8x8"]["server_cpu_us_per_call"] for x in runs
                   if "server_cpu_us_per_call" in x[mode]["stream_8x8"]]
            if cpu:
                result[key] = statistics.median(cpu)
                rows.append(("  server CPU per Route + Complete, us (median of rounds)", _median_of_rounds(cpu)))
        for load, key, label in (("sdk_64", "", "prompt a list"), ("sdk_64_packed", "_packed", "prompt an array('I')"),
                                 ("sdk_64_keys", "_keys", "prompt a list, sent as block keys")):
            cpu = [x["daemon"][load]["client_cpu_us_per_call"] for x in runs]
            result[f"sdk_client_cpu_us_per_route{key}"] = statistics.median(cpu)
            rows.append((f"SDK RouterClient (+ complete), 64 in flight, {label}", _load_figures(mid["daemon"][load])))
            rows.append(("  gateway CPU per Route + Complete, us (median of rounds)", _median_of_rounds(cpu)))
            server_cpu = [x["daemon"][load]["server_cpu_us_per_call"] for x in runs
                          if "server_cpu_us_per_call" in x["daemon"][load]]
            if server_cpu:  # the daemon's, in its own process
                result[f"sdk_server_cpu_us_per_route{key}"] = statistics.median(server_cpu)
                rows.append(("  daemon CPU per Route + Complete, us (median of rounds)", _median_of_rounds(server_cpu)))
        # the daemon's own RouteStream handler under the same messages, in process: what its code
        # costs without the transport, steadier than a live figure on a shared machine
        from .stream_inprocess import RUNS, stream_handler_cost

        _progress(f"RouteStream handler in process (64 workers, {blocks:,} blocks): daemon, deadline off, observed")
        for mode, key, label in (("daemon", "grpc_stream_handler_cpu_us_in_process", "daemon"),
                                 ("deadline_off", "grpc_stream_handler_deadline_off_cpu_us_in_process",
                                  "daemon, deadline admission off"),
                                 ("observed", "grpc_stream_handler_observed_cpu_us_in_process",
                                  "daemon with /metrics on, Completes reporting")):
            cost = stream_handler_cost(mode, 64, blocks, prompt, 50 if args.quick else 200)
            result[key] = cost["us_median"]
            rows.append((f"RouteStream handler in process, no transport: {label}",
                         f"{cost['us_median']:.1f} us per Route + Complete (least of {RUNS} runs: "
                         f"{cost['us_min']:.1f})"))
        for load, label in (("inflight_64", "Route, 64 in flight"), ("stream_8x8", "RouteStream coalesced"),
                            ("stream_8x8_single", "RouteStream one per message")):
            mix = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons[load].items(), key=lambda kv: -kv[1]))
            rows.append((f"daemon decisions by reason, {label} (all rounds)", mix))

    if "ingest" in stages:
        from .grpc_bench import ingest_throughput
        from .inprocess import ingest_rate

        n = 100_000 if args.quick else 500_000
        _progress(f"ingest: {n:,} stored blocks through PublishEvents")
        grpc_rates, repeated_rates = [], []
        for _ in range(rounds):  # interleaved, so load on a shared machine hits both alike
            grpc_rates.append(ingest_throughput(n))
            repeated_rates.append(ingest_throughput(n, packed=False))
        local = ingest_rate(n)
        result["ingest_events_per_s"] = statistics.median(grpc_rates)
        result["ingest_events_per_s_repeated_tokens"] = statistics.median(repeated_rates)
        result["ingest_events_per_s_in_process"] = local["blocks_per_s"]
        rows.append(("ingest via PublishEvents (packed tokens)", f"{statistics.median(grpc_rates):,.0f} block events/s"))
        rows.append(("  the same, repeated token_ids", f"{statistics.median(repeated_rates):,.0f} block events/s"))
        rows.append(("ingest in process (Router.apply)", f"{local['blocks_per_s']:,.0f} block events/s"))

    if "memory" in stages:
        _progress(f"memory: {blocks:,} blocks held by one worker (fresh processes)")
        ours = _memory_in_subprocess(blocks, engine_hashes=False)
        engine = _memory_in_subprocess(blocks, engine_hashes=True)
        result["bytes_per_block"] = ours["bytes_per_block"]
        result["bytes_per_block_with_engine_hashes"] = engine["bytes_per_block"]
        rows.append(("memory per block (publisher uses our keys)", f"{ours['bytes_per_block']:.0f} B"))
        rows.append(("memory per block (+ engine-hash map, vLLM/SGLang)", f"{engine['bytes_per_block']:.0f} B"))

    _progress.close()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(len(k) for k, _ in rows) if rows else 0
        print(f"\nkvrouterd bench ({blocks:,} indexed blocks, 4,000-token prompt, block size 16)")
        print("-" * (width + 40))
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        if "fleet" in stages:
            print("\nRoute + Complete in process by path and fleet width, us: median (p90); "
                  "idle fleet, cold 4,000-token prompts (docs/operations/performance.md)")
            print(fleet_table)
    return 0
