"""Prefill/decode disaggregation in the simulator: the same fleet aggregated, always disaggregated and conditionally disaggregated.

``kvrouterd sim cluster --pd P:D`` runs one workload over P + D identical engines three ways
(``MODES``), each through the daemon's own Router:

- **aggregated**: every engine has role ``both`` and prefills and decodes its own requests
  (the plain ``sim cluster`` fleet of P + D workers);
- **always**: P engines have role ``prefill``, D role ``decode``, ``disaggregation.mode:
  always``: every request is prefilled on a prefill engine (``max_tokens`` 1, as vLLM's P/D
  proxies send it), its KV crosses the link, then a decode engine generates;
- **conditional** (``disaggregation.mode: conditional``, one run per combination of
  ``--pd-local-tokens``, ``--pd-prefill-busy-tokens`` and ``--pd-decode-busy-tokens``, each
  the config's when not given): the router's bypass rules (``router.disagg``) send some
  requests to prefill on their decode engine.

**KV transfer.** A disaggregated request's prefill engine sends, once its prefill ends, the
prompt tokens its decode engine does not hold (``Decision.decode_uncached_tokens``): it takes
``transfer_latency_ms + tokens * kv_bytes_per_token * 8 / (link_gbps * 1e9)`` s (defaults:
128 KiB per token, Llama-3.1-8B's bf16 KV, 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes;
a 200 Gb/s RDMA link, NIXL's usual path; 1 ms setup). The decode engine then caches the blocks
as if prefilled (``SimEngine.receive``, publishing them as Stored, so the router sees decode
caches), admits the request with only the prompt's partial last block to compute, and the
first token comes from its first step, as the user sees it through llm-d's sidecar or
Dynamo's frontend. The router hears ``prefill_done`` when the KV arrives (releasing the
prefill engine) and the request's Complete at its last token.

**Measures** (after the warm-up): TTFT (arrival to first token), TBT (a request's time between
tokens after the first, ``(e2e - ttft) / (output - 1)``; DistServe's TPOT), SLO attainment of
TTFT alone and of both (TTFT <= ``--slo-ms`` and TBT <= ``--tbt-slo-ms``), and **goodput**:
requests meeting both SLOs per second of simulated time (DistServe's definition, at each
rate). ``remote`` is the share of requests that took the prefill hop.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..deadline import Pricing
from ..errors import ConfigError, NotFound
from ..protocols import Completion, RouteRequest, WorkerRole
from ..router import RouteResult
from . import metrics as m
from .cluster import _DELIVER, ClusterSettings, Simulation
from .engine import Job
from .workloads import Workload

__all__ = ["MODES", "PdSettings", "PdSimulation", "compare", "markdown", "plot"]

MODES = ("aggregated", "always", "conditional")


@dataclass(frozen=True)
class PdSettings:
    """The P/D fleet and its link (see the module docstring)."""

    prefill_workers: int = 2
    decode_workers: int = 6
    kv_bytes_per_token: int = 131072
    link_gbps: float = 200.0
    transfer_latency_ms: float = 1.0
    tbt_slo_ms: float = 100.0

    def validate(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ConfigError("--pd needs at least one prefill and one decode worker (P:D, both >= 1)")
        if self.kv_bytes_per_token < 1 or not self.link_gbps > 0 or self.transfer_latency_ms < 0 or not self.tbt_slo_ms > 0:
            raise ConfigError("--kv-bytes-per-token and --kv-link-gbps must be > 0, --kv-transfer-latency-ms >= 0, "
                              "--tbt-slo-ms > 0")

    def transfer_seconds(self, tokens: int) -> float:
        return self.transfer_latency_ms / 1000.0 + tokens * self.kv_bytes_per_token * 8 / (self.link_gbps * 1e9)


@dataclass(slots=True)
class _Hop:
    """A disaggregated request between routing and its decode engine."""

    decode: int
    transfer_tokens: int
    routed_at: float
    hit_blocks: int = 0
    prefill_s: float = 0.0


@dataclass(slots=True, frozen=True)
class _Transfer:
    index: int


class PdSimulation(Simulation):
    """One run in one ``MODES`` mode (``thresholds``: ``disaggregation:`` fields to override,
    e.g. ``{"prefill_busy_tokens": 0}``; conditional's thresholds)."""

    def __init__(self, cfg: Config, workload: Workload, settings: ClusterSettings, pd: PdSettings, mode: str, *,
                 routing: str | Mapping[str, Any], eviction: str | Mapping[str, Any], seed: int = 0, rate: float = 0.0,
                 thresholds: Mapping[str, int] | None = None, progress: Callable[[float], None] | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"P/D mode must be one of {', '.join(MODES)}, got {mode!r}")
        pd.validate()
        settings = dataclasses.replace(settings, workers=pd.prefill_workers + pd.decode_workers)
        if mode != "aggregated":
            knobs = dataclasses.replace(cfg.disaggregation, mode=mode, **(thresholds or {}))
            cfg = dataclasses.replace(cfg, disaggregation=knobs)
            cfg.validate()
        super().__init__(cfg, workload, settings, routing=routing, eviction=eviction, seed=seed, rate=rate,
                         progress=progress)
        self.pd, self.mode = pd, mode
        if mode != "aggregated":
            for i, engine in enumerate(self.engines):
                spec = self.router.workers.get(engine.worker_id).spec
                role = WorkerRole.PREFILL if i < pd.prefill_workers else WorkerRole.DECODE
                self.router.add_worker(dataclasses.replace(spec, role=role))
        self._hops: dict[int, _Hop] = {}
        self._prefill_jobs: set[Job] = set()
        self.reasons: Counter[str] = Counter()
        self.remote = 0
        self.transfer_ms: list[float] = []

    def _dispatch(self, n: int, rr: RouteRequest, result: RouteResult, now: float, route_us: float,
                  priced: Pricing | None = None) -> None:
        d = result.decision
        self.reasons[d.pd_reason.split("+")[0] or "aggregated"] += 1
        if d.prefill is None or result.prefill_worker is None:
            super()._dispatch(n, rr, result, now, route_us, priced)
            return
        self.remote += 1
        if self.log is not None:
            self.log.append(("route", now, rr, result.worker.id))
        req = self.workload.requests[n]
        keys = list(rr.keys)
        decode = self._by_id[result.worker.id]
        self.records[n] = m.RequestRecord(req.arrival_s, decode, len(keys), 0, req.input_tokens, req.output_tokens,
                                          math.nan, math.nan, route_us, d.prefill.overlap_blocks)
        # the prefill hop computes the prompt and one token, as P/D proxies ask prefill engines to
        job = Job(n, dataclasses.replace(req, output_tokens=1), keys, max(1, d.prefill.uncached_tokens),
                  d.prefill.overlap_blocks)
        self._prefill_jobs.add(job)
        self._hops[n] = _Hop(decode, d.decode_uncached_tokens, now)
        prefill = self._by_id[result.prefill_worker.id]
        self.engines[prefill].enqueue(job)
        self._kick(prefill, now)

    def _finish(self, i: int, job: Job, now: float, kick: bool = True) -> None:
        if job not in self._prefill_jobs:
            hop = self._hops.pop(job.index, None)
            super()._finish(i, job, now, kick)
            rec = self.records[job.index]
            if hop is not None and rec is not None:
                rec.hit_blocks = hop.hit_blocks  # the prefix the prefill hop reused: the compute saved
            return
        self._prefill_jobs.discard(job)
        self.engines[i].finish(job, now)
        self._publish(i, now)
        hop = self._hops[job.index]
        hop.hit_blocks, hop.prefill_s = job.first_hit_blocks, now - hop.routed_at
        self._push(now + self.pd.transfer_seconds(hop.transfer_tokens), _DELIVER, _Transfer(job.index))
        if kick:
            self._kick(i, now)

    def _deliver(self, obj: Any, now: float) -> None:
        if not isinstance(obj, _Transfer):
            super()._deliver(obj, now)
            return
        n = obj.index
        hop = self._hops[n]
        req = self.workload.requests[n]
        keys = self.keys.keys(req.block_ids)
        transfer_ms = (now - hop.routed_at - hop.prefill_s) * 1000.0
        self.transfer_ms.append(transfer_ms)
        engine = self.engines[hop.decode]
        engine.receive(req, keys, now)
        try:
            self.router.release_prefill(Completion(f"r{n}", prefill_ms=hop.prefill_s * 1000.0,
                                                   kv_transfer_ms=transfer_ms, prefill_done=True))
        except NotFound:
            pass  # expired by the router's in-flight timeout
        bs = self.workload.block_tokens
        engine.enqueue(Job(n, req, keys, max(1, req.input_tokens - len(keys) * bs), len(keys)))
        self._kick(hop.decode, now)


def _tbt_s(r: m.RequestRecord) -> float:
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def row(sim: PdSimulation, label: str, rate: float, seed: int) -> dict[str, Any]:
    """One run's numbers for the table (``compare``)."""
    result = sim.run()
    records = result.records
    tbts = [_tbt_s(r) for r in records]
    ttft_slo, tbt_slo = result.summary.slo_ms / 1000.0, sim.pd.tbt_slo_ms / 1000.0
    both = sum(1 for r, tbt in zip(records, tbts) if r.ttft_s <= ttft_slo and tbt <= tbt_slo)
    span = max((max(r.arrival_s + r.e2e_s for r in records) - min(r.arrival_s for r in records)) if records else 1.0, 1e-9)
    total = sum(sim.reasons.values()) or 1
    return {
        "mode": label, "rate": rate, "seed": seed, "requests": len(records),
        "ttft_p50_ms": result.summary.ttft_ms["p50"], "ttft_p90_ms": result.summary.ttft_ms["p90"],
        "ttft_p99_ms": result.summary.ttft_ms["p99"],
        "tbt_p50_ms": m.percentile(tbts, 50) * 1000.0, "tbt_p90_ms": m.percentile(tbts, 90) * 1000.0,
        "tbt_p99_ms": m.percentile(tbts, 99) * 1000.0,
        "ttft_attainment": result.summary.slo_attainment, "both_attainment": both / len(records) if records else 0.0,
        "goodput_rps": both / span, "hit_ratio": result.summary.hit_ratio,
        "remote_share": sim.remote / total,
        "transfer_p50_ms": m.percentile(sim.transfer_ms, 50) if sim.transfer_ms else 0.0,
        "reasons": dict(sim.reasons), "unfinished": result.counters.get("unfinished", 0),
    }


def _conditional_runs(local_tokens: Sequence[int], prefill_busy_tokens: Sequence[int],
                      decode_busy_tokens: Sequence[int]) -> list[tuple[str, dict[str, int]]]:
    """``(label, thresholds)`` per combination; a busy threshold is named in the label only when
    swept (``conditional@1024,prefill_busy=off``), so the plain labels stay ``conditional@N``."""
    out = []
    for local, pbusy, dbusy in itertools.product(local_tokens, prefill_busy_tokens or [None],
                                                 decode_busy_tokens or [None]):
        label, knobs = f"conditional@{local}", {"local_prefill_max_uncached_tokens": local}
        if pbusy is not None:
            label, knobs["prefill_busy_tokens"] = f"{label},prefill_busy={pbusy or 'off'}", pbusy
        if dbusy is not None:
            label, knobs["decode_busy_tokens"] = f"{label},decode_busy={dbusy}", dbusy
        out.append((label, knobs))
    return out


def compare(cfg: Config, workload_for: Callable[[int, float | None], Workload], settings: ClusterSettings,
            pd: PdSettings, *, routing: Mapping[str, Any], eviction: Mapping[str, Any], rates: Sequence[float | None],
            seeds: Sequence[int], local_tokens: Sequence[int], settings_for: Callable[[Workload], ClusterSettings],
            progress: Callable[[str], None] | None = None, prefill_busy_tokens: Sequence[int] = (),
            decode_busy_tokens: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Every mode at every rate and seed, conditional once per combination of ``local_tokens``,
    ``prefill_busy_tokens`` and ``decode_busy_tokens`` (an empty list: the config's value)."""
    runs: list[tuple[str, str, dict[str, int]]] = [("aggregated", "aggregated", {}), ("always", "always", {})]
    runs += [(label, "conditional", knobs)
             for label, knobs in _conditional_runs(local_tokens, prefill_busy_tokens, decode_busy_tokens)]
    out = []
    for rate in rates:
        for seed in seeds:
            wl = workload_for(seed, rate)
            for label, mode, knobs in runs:
                if progress is not None:
                    progress(f"{label} rate={rate} seed={seed}")
                sim = PdSimulation(cfg, wl, settings_for(wl), pd, mode, routing=routing, eviction=eviction, seed=seed,
                                   rate=rate or 0.0, thresholds=knobs)
                out.append(row(sim, label, rate or 0.0, seed))
    return out


def _mean_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows averaged over seeds, per (mode, rate), in first-seen order."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["rate"]), []).append(r)
    out = []
    for (mode, rate), group in groups.items():
        mean = {k: sum(g[k] for g in group) / len(group) for k, v in group[0].items()
                if isinstance(v, (int, float)) and k not in ("rate", "seed")}
        out.append({"mode": mode, "rate": rate, "seeds": len(group), **mean})
    return out


def markdown(rows: Sequence[dict[str, Any]], setting: str) -> str:
    """The comparison table (means over seeds)."""
    lines = [f"{setting}", "",
             "| mode | rate (req/s) | TTFT p50 / p90 / p99 (ms) | TBT p50 / p90 / p99 (ms) | TTFT SLO met | "
             "both SLOs met | goodput (req/s) | remote prefill | hit ratio | KV transfer p50 (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in _mean_rows(rows):
        lines.append(
            f"| {r['mode']} | {r['rate']:g} | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tbt_p50_ms']:.1f} / {r['tbt_p90_ms']:.1f} / {r['tbt_p99_ms']:.1f} | {r['ttft_attainment']:.1%} | "
            f"{r['both_attainment']:.1%} | {r['goodput_rps']:.2f} | {r['remote_share']:.0%} | {r['hit_ratio']:.1%} | "
            f"{r['transfer_p50_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """Goodput, TTFT p90 and TBT p90 against rate, one line per mode (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = _mean_rows(rows)
    modes = list(dict.fromkeys(r["mode"] for r in mean))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for k, (key, label) in enumerate((("goodput_rps", "goodput (req/s meeting TTFT and TBT SLOs)"),
                                      ("ttft_p90_ms", "TTFT p90 (ms)"), ("tbt_p90_ms", "TBT p90 (ms)"))):
        ax = axes[k]
        for j, mode in enumerate(modes):
            pts = sorted((r["rate"], r[key]) for r in mean if r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^DvPX"[j % 7], label=mode)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "ttft_p90_ms":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: Any, make_plan: Callable[[Any], Any]) -> int:
    """``kvrouterd sim cluster --pd P:D``: the comparison table (and, with ``--out``, a PNG and JSON)."""
    import json
    import sys

    from ..errors import KVRouterError

    try:
        p = make_plan(args)
        settings = PdSettings(args.pd[0], args.pd[1], args.kv_bytes_per_token, args.kv_link_gbps,
                              args.kv_transfer_latency_ms, args.tbt_slo_ms)
        settings.validate()
        thresholds = args.pd_local_tokens or [p.cfg.disaggregation.local_prefill_max_uncached_tokens]
        say = None if args.quiet else (lambda what: print(f"sim cluster --pd: {what}", file=sys.stderr))
        rows = compare(p.cfg, p.workload_for, p.settings, settings, routing=p.routings[0], eviction=p.evictions[0],
                       rates=p.rates, seeds=p.seeds, local_tokens=thresholds, settings_for=p.settings_for, progress=say,
                       prefill_busy_tokens=args.pd_prefill_busy_tokens or (),
                       decode_busy_tokens=args.pd_decode_busy_tokens or ())
    except (KVRouterError, ValueError, OSError) as exc:
        print(f"kvrouterd sim cluster: {exc}", file=sys.stderr)
        return 2
    setting = (f"{p.workload_name} (--limit {args.limit or 'none'}), {settings.prefill_workers} prefill + "
               f"{settings.decode_workers} decode engines (aggregated: {settings.prefill_workers + settings.decode_workers} "
               f"engines of role both), routing {p.routings[0]['name']}, SLOs TTFT {p.settings.slo_ms or p.cfg.default_ttft_slo_ms:g} ms "
               f"and TBT {settings.tbt_slo_ms:g} ms, KV {settings.kv_bytes_per_token} B/token over {settings.link_gbps:g} Gb/s")
    table = markdown(rows, setting)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        command = "kvrouterd sim cluster " + " ".join(sys.argv[3:])
        (out / "report.md").write_text(f"`{command}`\n\n{table}")
        (out / "results.json").write_text(json.dumps({"command": command, "setting": setting, "runs": rows}, indent=1))
        plot(rows, setting, out / "pd.png")
    print(json.dumps(rows, indent=1) if args.json else table)
    return 0
