"""What a simulated run measured, and the summary numbers a report shows.

Definitions (all over the requests after the warm-up):

- **hit ratio**: prefix-hit blocks / prompt blocks, as the engines found them at admission
  (the systematic study's and the cache replay's definition); per worker too.
- **TTFT**: arrival at the router to the first token (queueing + prefill); **E2E**: arrival
  to the last token. Percentiles interpolate linearly between order statistics (numpy's
  default).
- **SLO attainment**: share of requests with TTFT <= the SLO. A request shed by deadline
  admission (``--admission-deadline``) counts as one that missed it; TTFT and E2E
  percentiles are over the requests served.
- **shed**: requests deadline admission refused at arrival or dropped from a queue.
- **goodput** of a run (``goodput_rps``): requests served within the SLO per second of
  simulated time (same span as throughput): what overload must not collapse.
- **throughput**: completed requests (and output tokens) per second of simulated time,
  from the first arrival to the last completion.
- **load imbalance**: the coefficient of variation (std / mean) of the engines' pending
  prefill tokens, sampled at a fixed interval, averaged over samples whose mean is > 0.
- **decision time**: wall time of ``Router.route`` (routing) and of the engines' eviction
  ``rank`` calls, in microseconds.
- **capacity** (a sweep over rates; reports call it goodput, as the papers do): the highest swept rate whose
  attainment is >= 90%, so its resolution is the sweep's. ``--rate LO:HI:STEP`` sweeps a grid
  (``rate_grid``; issue #27 measures capacity in 0.5 req/s steps, e.g. ``--rate 14:20:0.5``).
  Every grid rate is run rather than bisected: attainment need not fall monotonically with
  rate (seeds, eviction), and a grid is what "highest rate with >= 90%" means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestRecord", "cv", "goodput", "parse_rates", "percentile", "rate_grid", "summarize"]


@dataclass(slots=True)
class RequestRecord:
    arrival_s: float
    worker: int
    prompt_blocks: int
    hit_blocks: int
    input_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    route_us: float
    router_overlap: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (population std / mean); 0 when the mean is 0."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    if mean <= 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


@dataclass
class RunSummary:
    requests: int
    hit_ratio: float
    hit_ratio_per_worker: list[float]
    ttft_ms: dict[str, float]
    e2e_ms: dict[str, float]
    slo_ms: float
    slo_attainment: float
    throughput_rps: float
    output_tokens_per_s: float
    load_cv: float
    route_us: dict[str, float]
    evict_us_mean: float
    requests_per_worker: list[int] = field(default_factory=list)
    shed: int = 0
    goodput_rps: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "hit_ratio": self.hit_ratio, "hit_ratio_per_worker": self.hit_ratio_per_worker,
            "requests_per_worker": self.requests_per_worker, "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms,
            "slo_ms": self.slo_ms, "slo_attainment": self.slo_attainment, "throughput_rps": self.throughput_rps,
            "output_tokens_per_s": self.output_tokens_per_s, "load_cv": self.load_cv, "route_us": self.route_us,
            "evict_us_mean": self.evict_us_mean, "shed": self.shed, "goodput_rps": self.goodput_rps,
        }


_QS = (50, 90, 95, 99)


def _pcts(values: Sequence[float], scale: float) -> dict[str, float]:
    xs = sorted(values)
    out = {f"p{q}": percentile(xs, q) * scale for q in _QS}
    out["mean"] = (sum(xs) / len(xs) * scale) if xs else math.nan
    return out


def summarize(records: Sequence[RequestRecord], workers: int, slo_ms: float, load_samples: Sequence[float],
              evict_seconds: float = 0.0, evict_calls: int = 0, shed: int = 0) -> RunSummary:
    """The summary of completed requests (pass them already stripped of the warm-up); ``shed``
    more were refused by deadline admission and count as missing the SLO."""
    blocks = sum(r.prompt_blocks for r in records)
    hits = sum(r.hit_blocks for r in records)
    per_blocks = [0] * workers
    per_hits = [0] * workers
    per_n = [0] * workers
    for r in records:
        per_blocks[r.worker] += r.prompt_blocks
        per_hits[r.worker] += r.hit_blocks
        per_n[r.worker] += 1
    ttfts = [r.ttft_s for r in records]
    slo_s = slo_ms / 1000.0
    met = sum(1 for t in ttfts if t <= slo_s)
    if records:
        start = min(r.arrival_s for r in records)
        end = max(r.arrival_s + r.e2e_s for r in records)
        span = max(end - start, 1e-9)
    else:
        span = 1.0
    samples = [s for s in load_samples if not math.isnan(s)]
    return RunSummary(
        requests=len(records),
        hit_ratio=hits / blocks if blocks else 0.0,
        hit_ratio_per_worker=[h / b if b else 0.0 for h, b in zip(per_hits, per_blocks)],
        requests_per_worker=per_n,
        ttft_ms=_pcts(ttfts, 1000.0),
        e2e_ms=_pcts([r.e2e_s for r in records], 1000.0),
        slo_ms=slo_ms,
        slo_attainment=met / (len(records) + shed) if records or shed else 0.0,
        throughput_rps=len(records) / span,
        output_tokens_per_s=sum(r.output_tokens for r in records) / span,
        load_cv=sum(samples) / len(samples) if samples else 0.0,
        route_us=_pcts([r.route_us for r in records], 1.0),
        evict_us_mean=evict_seconds / evict_calls * 1e6 if evict_calls else 0.0,
        shed=shed,
        goodput_rps=met / span if records else 0.0,
    )


def goodput(points: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """Highest rate among ``(rate, attainment)`` points with attainment >= target (0 if none)."""
    ok = [rate for rate, att in points if att >= target]
    return max(ok) if ok else 0.0


def rate_grid(lo: float, hi: float, step: float) -> list[float]:
    """``lo``, ``lo + step``, ... up to ``hi`` inclusive, each rounded to 6 decimals so that
    0.1 + 0.2 steps do not drift (14:20:0.5 gives 14.0, 14.5, ..., 20.0)."""
    if not step > 0:
        raise ValueError(f"rate step must be > 0, got {step}")
    if hi < lo:
        raise ValueError(f"rate range {lo}:{hi} runs backwards")
    n = math.floor((hi - lo) / step + 1e-9)
    return [round(lo + i * step, 6) for i in range(n + 1)]


def parse_rates(text: str) -> list[float]:
    """``"4,8,12"`` or grids ``"14:20:0.5"`` (``rate_grid``), mixed, in order, duplicates once."""
    rates: dict[float, None] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        try:
            values = [float(x) for x in parts]
        except ValueError:
            raise ValueError(f"expected a rate or LO:HI:STEP, got {item!r}") from None
        if len(values) == 1:
            rates[values[0]] = None
        elif len(values) == 3:
            rates.update(dict.fromkeys(rate_grid(*values)))
        else:
            raise ValueError(f"expected a rate or LO:HI:STEP, got {item!r}")
    return list(rates)
