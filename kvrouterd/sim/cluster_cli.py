"""Simulate a cluster of engines behind the daemon's own router, on a trace or a generator.

    kvrouterd sim cluster --trace conversation_trace.jsonl --workers 8 --rate 10 \\
        --routing cache_aware,least_loaded --eviction lru --capacity-fraction 0.3 --out report/

The router is the daemon's: ``Router(cfg.router_settings(), clock, rng)`` built from the same
``kvrouterd.config`` Config (``--config``, the daemon's YAML) through the same policy
registry, with the routing and eviction names swapped in per run. Only the edges differ:
the workload is the request source, ``SimEngine``s (``sim.engine``) serve and publish
Stored/Removed events into ``Router.apply`` (``--cache-mode events``, optionally delayed or
lost) or the router models their caches itself (``approximate``), a ``ManualClock`` moves
from event to event, and ``Router.tick`` runs at the config's ``tick_interval_s``.
Completions report the observed TTFT and end-to-end latency back through
``Router.complete``, as a gateway would.

Policy parameters come from the config file: a run of routing policy NAME uses the config's
``routing`` spec if its name is NAME, else an ``extra_routing`` entry named NAME, else the
policy's defaults (likewise ``eviction``); ``--set NAME.FIELD=VALUE`` overrides one field.

One command sweeps every routing x eviction pair over ``--rate``s and ``--seeds`` and writes
one report (``--out DIR``: report.md, results.json, PNG plots; ``--json`` prints the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..config import Config, load_config
from ..errors import ConfigError, KVRouterError
from ..protocols import CacheMode
from . import metrics as m
from . import report
from .cluster import ClusterSettings, simulate
from .engine import EngineParams
from .policy_specs import policy_spec
from .results import RunResult
from .workloads import GENERATORS, Workload, build_workload

__all__ = ["ClusterPlan", "add_arguments", "plan", "run", "sweep"]


# ---- sweeps ---------------------------------------------------------------------------------

class _Progress:
    """A tqdm progress bar on stderr: runs done (fractional within the current run) and its label.
    Off when ``out`` is None or not a terminal, so logs and CI output stay clean."""

    def __init__(self, total: int, out: TextIO | None) -> None:
        from tqdm import tqdm

        self.total, self.done, self.label = total, 0, ""
        self.out = out
        self._bar = tqdm(total=total, unit="run", file=out, disable=out is None or not out.isatty(),
                         bar_format="{l_bar}{bar}| {n:.1f}/{total} runs [{elapsed}<{remaining}]", dynamic_ncols=True)

    def start(self, label: str) -> None:
        self.label = label
        self._bar.set_description_str(label[:60], refresh=False)
        self.update(0.0)

    def update(self, frac: float) -> None:
        self._bar.n = self.done + frac
        if frac == 0.0:
            self._bar.refresh()
        else:
            self._bar.update(0)  # redraws at tqdm's own pace (mininterval)

    def finish_run(self) -> None:
        self.done += 1
        if self.label:
            self._bar.set_description_str(self.label[:60], refresh=False)
        self.update(0.0)
        if self.done == self.total:
            self._bar.close()


def sweep(cfg: Config, workload_for: Callable[[int, float | None], Workload], settings: ClusterSettings,
          routings: Sequence[Mapping[str, Any]], evictions: Sequence[Mapping[str, Any]], rates: Sequence[float | None],
          seeds: Sequence[int], capacity_for: Callable[[Workload], int] | None = None,
          out: TextIO | None = sys.stderr) -> list[RunResult]:
    """Every routing x eviction pair at every rate and seed, one fresh router per run."""
    bar = _Progress(len(routings) * len(evictions) * len(rates) * len(seeds), out)
    results = []
    for rate in rates:
        for seed in seeds:
            wl = workload_for(seed, rate)
            s = settings
            if capacity_for is not None:
                s = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, capacity_blocks=capacity_for(wl)))
            for r_spec in routings:
                for e_spec in evictions:
                    bar.start(f"{r_spec['name']}+{e_spec['name']} rate={rate or 'trace'} seed={seed}")
                    results.append(simulate(cfg, wl, s, routing=r_spec, eviction=e_spec, seed=seed, rate=rate or 0.0,
                                            progress=bar.update))
                    bar.finish_run()
    return results


# ---- command line ---------------------------------------------------------------------------

def _floats(text: str) -> list[float]:
    try:
        return m.parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # one line per flag: what each one means in depth is in docs/simulator.md
    w = parser.add_argument_group("workload")
    w.add_argument("--trace", type=Path, metavar="FILE",
                   help="Mooncake-format JSONL trace (implies --workload mooncake)")
    names = ["mooncake", *GENERATORS]
    w.add_argument("--workload", choices=names, metavar="NAME", help=f"{', '.join(names[:-1])} or {names[-1]}")
    w.add_argument("--rate", type=_floats, default=None, metavar="R[,R..]",
                   help="request rates in req/s: a list or a grid LO:HI:STEP (default: the workload's)")
    w.add_argument("--seeds", type=_ints, default=[0], metavar="S[,S..]", help="seeds of workload, router and engines")
    w.add_argument("--limit", type=int, default=0, metavar="N", help="use only the first N requests")
    w.add_argument("--max-input-tokens", type=int, default=0, metavar="N",
                   help="cap trace prompts at N tokens (0 = no cap)")
    w.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE",
                   help="generator parameter, e.g. prefix_ratio=0.7 (repeatable)")
    p = parser.add_argument_group("policies")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="the daemon's YAML config (policy parameters, tick, SLO)")
    p.add_argument("--routing", default="", metavar="NAME[,NAME..]", help="routing policies (default: the config's)")
    p.add_argument("--eviction", default="", metavar="NAME[,NAME..]", help="eviction policies (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="POLICY.FIELD=VALUE",
                   help="override one policy parameter with a JSON value (repeatable)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--workers", type=int, default=8, metavar="N", help="simulated engine workers (default 8)")
    cap = c.add_mutually_exclusive_group()
    cap.add_argument("--capacity-blocks", type=int, default=None, metavar="N",
                     help="KV cache per worker, in the workload's blocks (0 = unbounded)")
    cap.add_argument("--capacity-fraction", type=float, default=None, metavar="F",
                     help="KV cache of the cluster as a share of the workload's distinct blocks")
    c.add_argument("--cache-mode", choices=["events", "approximate"], default="events",
                   help="the router's view of the caches: engine events or its own model (default events)")
    c.add_argument("--event-delay-ms", type=float, default=0.0, metavar="MS",
                   help="delay before engine KV events reach the router")
    c.add_argument("--event-loss", type=float, default=0.0, metavar="P", help="probability that an event batch is lost")
    c.add_argument("--slo-ms", type=float, default=0.0, metavar="MS", help="TTFT SLO (default: the config's)")
    c.add_argument("--warmup", type=int, default=0, metavar="N", help="leading requests left out of the metrics")
    c.add_argument("--speculative-ttl-s", type=float, default=None, metavar="S",
                   help="events mode: a routed prompt counts as cached until stored or S seconds pass")
    c.add_argument("--session-end", action="store_true",
                   help="mark each session's last request session_ended (end-aware eviction)")
    c.add_argument("--load-report-ms", type=float, default=0.0, metavar="MS",
                   help="engines send ReportLoad this often (0 = never)")
    c.add_argument("--admission-max-inflight", type=int, default=0, metavar="N",
                   help="admission queue: at most N uncompleted requests per worker (0 = off)")
    c.add_argument("--admission-deadline", choices=["off", "shed", "defer"], default=None,
                   help="shed what is predicted to miss its SLO everywhere (default: the config's)")
    c.add_argument("--admission-deadline-quantile", type=float, default=None, metavar="Q",
                   help="admit when this quantile of TTFT meets the SLO (default: the config's)")
    c.add_argument("--first-token-reports", action=argparse.BooleanOptionalAction, default=True,
                   help="the gateway reports each first token, as ext_proc does (default: on)")
    c.add_argument("--shared-cache", action="store_true",
                   help="bound: the engines share one KV memory of the fleet's summed size")
    e = parser.add_argument_group("engines")
    d = EngineParams()
    e.add_argument("--prefill-model", choices=["linear", "power_law"], default=d.prefill_model,
                   help=f"prefill cost model of engines and policies (default {d.prefill_model})")
    e.add_argument("--prefill-ms-per-1k", type=float, default=d.prefill_ms_per_1k_tokens, metavar="MS",
                   help=f"linear model: prefill ms per 1,000 uncached tokens (default {d.prefill_ms_per_1k_tokens})")
    e.add_argument("--tpot-ms", type=float, default=d.tpot_ms, metavar="MS",
                   help=f"decode time per output token (default {d.tpot_ms})")
    e.add_argument("--decode-model", choices=["constant", "batched"], default=d.decode_model,
                   help=f"decode in engine steps beside prefill, or at a constant tpot (default {d.decode_model})")
    e.add_argument("--decode-batch-slope", type=float, default=d.decode_batch_slope, metavar="X",
                   help=f"batched: share of tpot a step gains per extra decode (default {d.decode_batch_slope})")
    e.add_argument("--decode-kv", action=argparse.BooleanOptionalAction, default=d.decode_kv,
                   help="batched: generated tokens take KV blocks, preempting when full (default on)")
    e.add_argument("--attention-context-tokens", type=float, default=d.attention_context_tokens, metavar="N",
                   help=f"attention costs a token per N context tokens "
                        f"(default {d.attention_context_tokens:.0f}; 0 = off)")
    e.add_argument("--hardware-speed", type=float, default=d.hardware_speed, metavar="X",
                   help="divide every compute time by X (default 1)")
    e.add_argument("--cache-decode", action="store_true",
                   help="engines cache the blocks generated tokens fill, as vLLM does")
    e.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, metavar="N",
                   help=f"prefill tokens per engine step (default {d.max_batch_tokens})")
    e.add_argument("--max-running", type=int, default=d.max_running, metavar="N",
                   help=f"requests an engine runs at once (default {d.max_running})")
    pd = parser.add_argument_group("prefill/decode disaggregation (docs/simulator.md, sim/pd.py)")
    pd.add_argument("--pd", type=_pd_split, default=None, metavar="P:D",
                    help="compare aggregated, always and conditional P/D on P prefill + D decode engines")
    pd.add_argument("--pd-local-tokens", type=_ints, default=None, metavar="N[,N..]",
                    help="conditional runs' local-prefill thresholds (default: the config's)")
    pd.add_argument("--pd-prefill-busy-tokens", type=_ints, default=None, metavar="N[,N..]",
                    help="conditional runs' prefill-busy thresholds (0 = off; default: config's)")
    pd.add_argument("--pd-decode-busy-tokens", type=_ints, default=None, metavar="N[,N..]",
                    help="conditional runs' decode-busy thresholds (default: the config's)")
    pd.add_argument("--kv-bytes-per-token", type=int, default=131072, metavar="B",
                    help="KV bytes a prompt token moves (default: Llama-3.1-8B bf16, 128 KiB)")
    pd.add_argument("--kv-link-gbps", type=float, default=200.0, metavar="G", help="KV transfer link, Gb/s (default 200)")
    pd.add_argument("--kv-transfer-latency-ms", type=float, default=1.0, metavar="MS", help="fixed cost of a transfer")
    pd.add_argument("--tbt-slo-ms", type=float, default=100.0, metavar="MS", help="time-between-tokens SLO for goodput")
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print every number as JSON")
    o.add_argument("--out", type=Path, metavar="DIR", help="write report.md, results.json and PNG plots here")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def _pd_split(text: str) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected P:D (prefill and decode workers), got {text!r}")
    return int(p), int(d)


def _kv(items: Sequence[str], flag: str) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.append((key.strip(), value))
    return out


@dataclass
class ClusterPlan:
    """What a ``sim cluster`` command line asks for, ready to run (``sweep``) or to split into
    single runs (``sim reproduce``): one workload per (seed, rate), the policies, the fleet."""

    cfg: Config
    workload_name: str
    workload_for: Callable[[int, float | None], Workload]
    settings: ClusterSettings
    routings: list[dict[str, Any]]
    evictions: list[dict[str, Any]]
    rates: list[float | None]
    seeds: list[int]
    capacity_for: Callable[[Workload], int] | None
    meta: dict[str, Any]

    def settings_for(self, wl: Workload) -> ClusterSettings:
        """The fleet for one workload (``--capacity-fraction`` sizes caches from the workload)."""
        if self.capacity_for is None:
            return self.settings
        engine = dataclasses.replace(self.settings.engine, capacity_blocks=self.capacity_for(wl))
        return dataclasses.replace(self.settings, engine=engine)


def plan(args: argparse.Namespace) -> ClusterPlan:
    """Validate parsed ``sim cluster`` arguments into a plan; raises ConfigError/ValueError."""
    cfg = load_config(args.config, environ={})
    if args.speculative_ttl_s is not None:
        cfg = dataclasses.replace(cfg, speculative=dataclasses.replace(cfg.speculative, ttl_s=args.speculative_ttl_s))
        cfg.speculative.validate()
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in _kv(args.set, "--set"):
        policy, dot, fname = key.partition(".")
        if not dot:
            raise ConfigError(f"--set expects POLICY.FIELD=VALUE, got {key!r}")
        overrides.setdefault(policy, {})[fname] = value
    routing_names = [n for n in args.routing.split(",") if n] or [cfg.routing["name"]]
    eviction_names = [n for n in args.eviction.split(",") if n] or [cfg.eviction["name"]]
    unused = sorted(set(overrides) - set(routing_names) - set(eviction_names))
    if unused:
        raise ConfigError(f"--set names policy {unused[0]!r}, which is not in --routing or --eviction")
    routings = [policy_spec(cfg, "routing", n, overrides) for n in routing_names]
    evictions = [policy_spec(cfg, "eviction", n, overrides) for n in eviction_names]
    if not args.workload and not args.trace:
        raise ConfigError("give --trace FILE or --workload NAME")
    name: str = args.workload or "mooncake"
    wparams = dict(_kv(args.workload_param, "--workload-param"))
    engine = EngineParams(capacity_blocks=args.capacity_blocks or 0, max_batch_tokens=args.max_batch_tokens,
                          max_running=args.max_running, prefill_model=args.prefill_model,
                          prefill_ms_per_1k_tokens=args.prefill_ms_per_1k, tpot_ms=args.tpot_ms,
                          cache_decode=args.cache_decode, decode_model=args.decode_model,
                          decode_batch_slope=args.decode_batch_slope, decode_kv=args.decode_kv,
                          attention_context_tokens=args.attention_context_tokens, hardware_speed=args.hardware_speed)
    # deadline admission as the daemon's config has it (docs/operations/configure.md), unless given
    deadline = args.admission_deadline if args.admission_deadline is not None else cfg.admission.deadline
    quantile = (args.admission_deadline_quantile if args.admission_deadline_quantile is not None
                else cfg.admission.deadline_quantile)
    settings = ClusterSettings(
        workers=args.workers, engine=engine,
        cache_mode=CacheMode.EVENTS if args.cache_mode == "events" else CacheMode.APPROXIMATE,
        event_delay_s=args.event_delay_ms / 1000.0, event_loss=args.event_loss, slo_ms=args.slo_ms,
        warmup=args.warmup, load_report_interval_s=args.load_report_ms / 1000.0,
        signal_session_end=args.session_end, admission_max_inflight=args.admission_max_inflight,
        admission_deadline=deadline, admission_deadline_quantile=quantile,
        first_token_reports=args.first_token_reports, shared_cache=args.shared_cache)
    settings.validate()
    capacity_for = None
    if args.capacity_fraction is not None:
        frac = args.capacity_fraction
        if not 0 < frac:
            raise ConfigError(f"--capacity-fraction must be > 0, got {frac}")
        workers = args.workers
        capacity_for = lambda wl: max(1, int(frac * wl.unique_blocks() / workers))  # noqa: E731

    def workload_for(seed: int, rate: float | None) -> Workload:
        return build_workload(name, seed, rate, trace=args.trace, limit=args.limit,
                              max_input_tokens=args.max_input_tokens, **dict(wparams))

    meta = {"workload": name, "limit": args.limit, "workers": args.workers, "cache_mode": args.cache_mode,
            "event_delay_ms": args.event_delay_ms, "event_loss": args.event_loss,
            "speculative_ttl_s": cfg.speculative.ttl_s, "engine": dataclasses.asdict(engine),
            "capacity_fraction": args.capacity_fraction, "admission_max_inflight": args.admission_max_inflight,
            "admission_deadline": deadline, "admission_deadline_quantile": quantile,
            "first_token_reports": args.first_token_reports, "shared_cache": args.shared_cache}
    return ClusterPlan(cfg, name, workload_for, settings, routings, evictions, list(args.rate or [None]),
                       list(args.seeds), capacity_for, meta)


def run(args: argparse.Namespace) -> int:
    if args.pd is not None:
        from . import pd

        return pd.run(args, plan)
    try:
        p = plan(args)
        results = sweep(p.cfg, p.workload_for, p.settings, p.routings, p.evictions, p.rates, p.seeds,
                        p.capacity_for, out=None if args.quiet else sys.stderr)
    except (KVRouterError, ValueError, OSError) as exc:
        print(f"kvrouterd sim cluster: {exc}", file=sys.stderr)
        return 2
    meta = dict(p.meta, command="kvrouterd sim cluster " + " ".join(sys.argv[3:]))
    doc = report.build(results, meta)
    if args.out:
        report.write(doc, results, args.out)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(report.table(doc))
    return 0
