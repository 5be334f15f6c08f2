"""``lbgr``: Learning-Based Greedy Routing (LBGR paper, section 4.2, Algorithm 2, appendix A).

For each worker ``i`` the latency of a request ``q`` is estimated as (Eq. 4)

    E_i = Cost_i + P_i + theta_i . phi_i

- ``Cost_i = alpha_cached * h + alpha_miss * (|q| - h)`` (Eq. 5), ``h`` the cached prompt
  tokens the global index reports for ``i``. The alphas are per 1k tokens in the paper's
  "per-1k-token unit" (appendix A: 0 and 1000), where 1000 stands for the time an engine
  takes to prefill 1k uncached tokens.
- ``P_i`` is the queue-load estimate: the cost of each request routed to ``i`` is added on
  dispatch (Eq. 6) and every ``decay_interval_s`` all loads are multiplied by ``rho``
  (31/32 every 20 ms). The host calls ``tick(now)`` about every 20 ms; the number of elapsed
  intervals is computed from ``now``, so late or early ticks change nothing. On completion
  the remaining decayed share of that request's cost, ``Cost * rho^k`` after ``k``
  intervals, is released (Algorithm 2, line 14).
- ``theta_i . phi_i`` is a per-worker residual learned from each completion against the
  target ``observed - Cost_i - P_i``, both terms as they were at dispatch (line 13). The
  paper's text (section 4.2, appendix A) describes a 4-dimensional linear regression,
  ``phi = (h, |q| - h, P_i, 1)`` (tokens in thousands, ``P_i`` in seconds; here in 1k-token
  prefill times, seconds at the default scale), fitted by
  recursive least squares with forgetting 0.992. The authors' published router
  (fzwark/KVRouting, ``sgl-router/src/router.rs``, ``EtaOnline3D``), which produced the
  paper's numbers, learns only the bias of that regression (its ``learn_mask`` enables
  theta_0 alone) and clamps the target at >= 1 ms (``y_resid.max(1.0)``), with RLS
  forgetting 0.992 and initial covariance 1e6. The defaults follow the published router:
  ``features = ("bias",)`` and ``residual_target = "penalty"``; the text's variant is
  ``features: [hit, miss, load, bias]`` with ``residual_target: signed``.

**Why the published residual, not the text's (measured).** ``Complete`` arrives after the
whole decode, seconds after the routing decision. With the text's regression, each worker's
fit learns to cancel the decayed load term (theta_load near -1) and a large negative bias
from completions that describe a load long gone, so the worker the fit penalises least
draws all traffic: in ``kvrouterd sim cluster`` on the Mooncake conversation trace (8
workers, 4,000 requests, cache 30%, 12 req/s) SLO attainment is 25% and the hit ratio 7%
(``learning_rule: none``: 99.9%). A bias-only residual with a non-negative target cannot
cancel the load term and can only make a worker look slower than ``Cost + P`` says, so
late feedback steers traffic away from a worker that was slow, never onto one: 99.8% on
the same run.

**One time unit (``engine_ms_per_1k``).** Every term of ``E_i`` is a time and is compared
with an observed latency, so all are held in ms: one unit of the alphas' scale is
``engine_ms_per_1k / alpha_miss_ms_per_1k`` ms, ``engine_ms_per_1k`` being the engines' real
prefill time per 1k uncached tokens (what a router that profiled them knows). The alphas then set only
the relative cost of a cached and an uncached token, and the residual target's floor (the
published router's 1, the cost of one uncached token at alpha_miss = 1000 per 1k) is one
uncached token's time. Decisions are then the same whatever scale the alphas are written in
(1000 per 1k or 1 per 1k). Unset (0), one unit is read as one ms, the published router's
literal mix, where the paper's alpha_miss = 1000 means 1 ms per uncached token, 10-40x slower
than a real prefill: its ``Cost + P`` then dwarfs every observed latency, the floored
residual never moves, and LBGR is ``Cost + P`` alone; written in real ms (alpha_miss = 40,
docs/results.md section 2) or with the unit known, the residual learns from completions and
decides, and per worker it herds on their late feedback (measured in
``sim.policy_specs.profiled_spec``'s docstring; ``residual_scope: fleet`` does not).
The load feature of the residual is ``P_i`` in 1k-token prefill times, so a fit does not
depend on the scale either.

The request goes to ``argmin_i E_i`` (ties to the lower slot).

**Target.** The paper regresses end-to-end latency; its runs generate 4 output tokens by
default, so there end-to-end latency is essentially TTFT. kvrouterd's ``Complete`` reports
TTFT separately, the router's objective is a TTFT SLO, and decode time depends on an output
length the router rarely knows, which would make an end-to-end residual mostly noise. The
default target is therefore ``ttft``; ``target: e2e`` follows the paper literally (then
``Decision.estimated_ttft_ms`` is left 0 and the estimate is in ``estimate_ms``).

Parameters:

- ``alpha_cached_ms_per_1k`` = 0.0, ``alpha_miss_ms_per_1k`` = 1000.0 (appendix A).
- ``engine_ms_per_1k`` = 0.0: the engines' prefill ms per 1k uncached tokens, which fixes the
  alphas' unit in ms (0: one unit is one ms, the published router's reading).
- ``decay_rho`` = 0.96875 (31/32), ``decay_interval_s`` = 0.02 (appendix A).
- ``learning_rule`` = "rls"; ``forgetting`` = 0.992 (appendix A); ``rls_initial_variance``
  = 1e6 (the published router's P0); ``nlms_step`` = 0.5 (for ``nlms``).
- ``features`` = ("bias",): the learned features, any non-empty subset of hit, miss, load,
  bias, in any order (the published router learns the bias alone; see above).
- ``residual_target`` = "penalty": ``max(one uncached token's time, observed - Cost - P)`` as
  the published router computes it, or "signed" (``observed - Cost - P``, the paper's text).
- ``target`` = "ttft": "ttft" or "e2e" (see above).
- ``residual_scope`` = "worker": one ``theta_i`` per worker as in the paper; "fleet" shares
  one model, so a worker that stops being chosen cannot keep a stale correction.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ...bounds import MAX_LATENCY_MS
from ...index import native
from ...index.workers import Worker
from ...protocols import Completion, Decision, RouteRequest
from ..base import RoutingContext, RoutingPolicyBase
from ..latency import RecursiveLeastSquares

__all__ = ["LBGRParams", "LBGRPolicy"]

FEATURES = ("hit", "miss", "load", "bias")
_MAX_TRACKED = 200_000
#: every learned coefficient (ms per 1k tokens, per second of load, or ms) and every residual
#: stays within a day's worth of ms: a client's outlier moves the estimate only that far
_RESIDUAL_RANGE = (-MAX_LATENCY_MS, MAX_LATENCY_MS)


def _clip(x: float, lo: float, hi: float) -> float:
    return x if lo <= x <= hi else (hi if x > hi else lo)


@dataclass(frozen=True)
class LBGRParams:
    alpha_cached_ms_per_1k: float = field(default=0.0, metadata={"help": "service cost of cached tokens, ms per 1k"})
    alpha_miss_ms_per_1k: float = field(default=1000.0, metadata={"help": "service cost of uncached tokens, ms per 1k"})
    engine_ms_per_1k: float = field(
        default=0.0, metadata={"help": "engines' prefill ms per 1k uncached tokens: the alphas' unit (0 = 1 ms)"}
    )
    decay_rho: float = field(default=31 / 32, metadata={"help": "queue-load decay factor per interval, in (0, 1]"})
    decay_interval_s: float = field(default=0.02, metadata={"help": "queue-load decay interval, s"})
    learning_rule: Literal["rls", "nlms", "none"] = field(
        default="rls", metadata={"help": "residual learner: recursive least squares, normalised LMS, or none"}
    )
    forgetting: float = field(default=0.992, metadata={"help": "RLS forgetting factor, in (0, 1]"})
    rls_initial_variance: float = field(default=1e6, metadata={"help": "RLS initial covariance diagonal"})
    nlms_step: float = field(default=0.5, metadata={"help": "NLMS step size, in (0, 2)"})
    features: tuple[str, ...] = field(
        default=("bias",), metadata={"help": "learned residual features: subset of hit, miss, load, bias"}
    )
    residual_target: Literal["penalty", "signed"] = field(
        default="penalty",
        metadata={"help": "residual target: max(floor, observed - Cost - P) (published router) or signed (paper text)"},
    )
    target: Literal["ttft", "e2e"] = field(default="ttft", metadata={"help": "latency the estimate predicts"})
    residual_scope: Literal["worker", "fleet"] = field(
        default="worker", metadata={"help": "one residual model per worker (the paper's theta_i) or one for the fleet"}
    )

    def validate(self) -> None:
        if self.alpha_cached_ms_per_1k < 0 or self.alpha_miss_ms_per_1k < 0:
            raise ValueError("alpha_cached_ms_per_1k and alpha_miss_ms_per_1k must be >= 0")
        if self.engine_ms_per_1k < 0:
            raise ValueError(f"engine_ms_per_1k must be >= 0, got {self.engine_ms_per_1k}")
        if self.engine_ms_per_1k > 0 and self.alpha_miss_ms_per_1k <= 0:
            raise ValueError("alpha_miss_ms_per_1k must be > 0 when engine_ms_per_1k is set (it defines the unit)")
        if not 0.0 < self.decay_rho <= 1.0:
            raise ValueError(f"decay_rho must be in (0, 1], got {self.decay_rho}")
        if self.decay_interval_s <= 0:
            raise ValueError(f"decay_interval_s must be > 0, got {self.decay_interval_s}")
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if self.rls_initial_variance <= 0:
            raise ValueError(f"rls_initial_variance must be > 0, got {self.rls_initial_variance}")
        if not 0.0 < self.nlms_step < 2.0:
            raise ValueError(f"nlms_step must be in (0, 2), got {self.nlms_step}")
        if not self.features or len(set(self.features)) != len(self.features) or not set(self.features) <= set(FEATURES):
            raise ValueError(f"features must be distinct names from {', '.join(FEATURES)}, got {list(self.features)}")


class _NLMS:
    """Normalised least mean squares: theta += mu * e * x / (eps + |x|^2)."""

    __slots__ = ("samples", "step", "theta")

    def __init__(self, n: int, step: float) -> None:
        self.theta = [0.0] * n
        self.step = step
        self.samples = 0

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x: list[float], y: float) -> float:
        error = y - self.predict(x)
        norm = 1e-6 + sum(v * v for v in x)
        theta = [t + self.step * error * v / norm for t, v in zip(self.theta, x)]
        if not all(map(math.isfinite, theta)):
            return error  # dropped, as RecursiveLeastSquares drops a sample that overflows
        self.theta = [_clip(t, *_RESIDUAL_RANGE) for t in theta]
        self.samples += 1
        return error


@dataclass(slots=True)
class _Estimate:
    hit: int
    cost: float
    load: float
    residual: float
    phi: list[float]

    @property
    def total(self) -> float:
        return self.cost + self.load + self.residual


@dataclass(slots=True)
class _Dispatched:
    worker_id: str
    cost: float
    step: int
    phi: list[float]
    base: float  # Cost + P at decision time: the part of the estimate that is not learned


class LBGRPolicy(RoutingPolicyBase):
    params: LBGRParams

    def __init__(self, params: LBGRParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self._load: dict[str, float] = {}
        self._learners: dict[str, RecursiveLeastSquares | _NLMS] = {}
        self._origin: float | None = None
        self._step = 0
        self._inflight: OrderedDict[str, _Dispatched] = OrderedDict()
        self._feature_index = tuple(FEATURES.index(f) for f in params.features)
        #: ms per unit of the alphas' scale (see "One time unit")
        self.unit_ms = params.engine_ms_per_1k / params.alpha_miss_ms_per_1k if params.engine_ms_per_1k > 0 else 1.0
        #: one uncached token's time, ms: the floor of the residual target (the published
        #: router's ``y_resid.max(1.0)`` at alpha_miss = 1000 per 1k)
        self.floor_ms = self.unit_ms * params.alpha_miss_ms_per_1k / 1000.0
        #: ms to prefill 1k uncached tokens, the unit of the load feature
        self._k_tokens_ms = self.unit_ms * params.alpha_miss_ms_per_1k or 1000.0

    # ---- queue load -----------------------------------------------------------------
    def _steps_at(self, now: float) -> int:
        if self._origin is None:
            return 0
        return max(self._step, int(math.floor((now - self._origin) / self.params.decay_interval_s)))

    def _advance(self, now: float) -> None:
        if self._origin is None:
            self._origin = now
            return
        step = self._steps_at(now)
        if step > self._step:
            factor = self.params.decay_rho ** (step - self._step)
            for wid in self._load:
                self._load[wid] *= factor
            self._step = step

    def load(self, worker_id: str, now: float) -> float:
        """P_i decayed to ``now`` (ms), without changing state."""
        pending = self._steps_at(now) - self._step
        return self._load.get(worker_id, 0.0) * self.params.decay_rho ** pending

    # ---- estimate -------------------------------------------------------------------
    def _learner(self, worker_id: str) -> RecursiveLeastSquares | _NLMS | None:
        if self.params.learning_rule == "none":
            return None
        learner = self._learners.get(worker_id)
        if learner is None:
            n = len(self.params.features)
            if self.params.learning_rule == "rls":
                learner = RecursiveLeastSquares([0.0] * n, self.params.forgetting, self.params.rls_initial_variance,
                                                bounds=[_RESIDUAL_RANGE] * n)
            else:
                learner = _NLMS(n, self.params.nlms_step)
        return learner

    def _terms(self, now: float) -> tuple[float, float, float]:
        """What every worker's estimate at ``now`` shares: the loads' decay since they were
        last advanced, and Cost's ms per cached and per uncached token (Eq. 5)."""
        p = self.params
        unit = self.unit_ms / 1000.0
        return (p.decay_rho ** (self._steps_at(now) - self._step), p.alpha_cached_ms_per_1k * unit,
                p.alpha_miss_ms_per_1k * unit)

    def estimates(self, ctx: RoutingContext, workers: Sequence[Worker]) -> list[_Estimate]:
        """Eq. 4 for each of ``workers``, without changing state."""
        p = self.params
        factor, per_hit, per_miss = self._terms(ctx.now)
        prompt, bs = ctx.prompt_tokens, ctx.block_size
        k_tokens_ms = self._k_tokens_ms
        index = self._feature_index
        learners = self._learners if p.learning_rule != "none" else {}
        loads = self._load
        fleet = "" if p.residual_scope == "fleet" else None
        out = []
        for w in workers:
            hit = min(prompt, ctx.overlap(w) * bs)
            miss = prompt - hit
            load = loads.get(w.id, 0.0) * factor
            values = (hit / 1000.0, miss / 1000.0, load / k_tokens_ms, 1.0)
            phi = [values[i] for i in index]
            learner = learners.get(w.id if fleet is None else fleet)  # an unseen worker has theta = 0
            residual = _clip(learner.predict(phi), *_RESIDUAL_RANGE) if learner is not None else 0.0
            out.append(_Estimate(hit, per_hit * hit + per_miss * miss, load, residual, phi))
        return out

    def _pick(self, ctx: RoutingContext) -> Worker | None:
        """The candidate with the lowest estimate, from one native pass over the candidates
        (``index/_native.c``: ``lbgr_pick``), or None where it declines or is not built.
        ``estimates`` over every candidate, ~1.5 us each (1.6 ms a Route at 1,024 workers), is
        its reference."""
        if native.module is None:
            return None
        p = self.params
        factor, per_hit, per_miss = self._terms(ctx.now)
        learners: dict[str, RecursiveLeastSquares | _NLMS] | None = None
        fleet_theta = None
        if p.learning_rule != "none":
            if p.residual_scope == "worker":
                learners = self._learners
            elif "" in self._learners:
                fleet_theta = self._learners[""].theta
        picked = native.module.lbgr_pick(ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.prompt_tokens,
                                         ctx.block_size, self._load, factor, per_hit, per_miss, self._k_tokens_ms,
                                         self._feature_index, learners, fleet_theta, *_RESIDUAL_RANGE)
        return None if picked is NotImplemented else ctx.candidates[picked[0]]

    def select(self, ctx: RoutingContext) -> Decision:
        chosen = None if getattr(ctx, "explain", True) else self._pick(ctx)
        if chosen is not None:
            best = self.estimates(ctx, [chosen])[0]
        else:
            estimates = list(zip(self.estimates(ctx, ctx.candidates), ctx.candidates))
            best, chosen = min(estimates, key=lambda ew: (ew[0].total, ew[1].slot))
        scored = []
        if getattr(ctx, "explain", True):
            scored = [
                ctx.candidate(w, score=-e.total, cost_ms=round(e.cost, 3), load_ms=round(e.load, 3),
                              residual_ms=round(e.residual, 3), estimate_ms=round(e.total, 3), hit_tokens=float(e.hit))
                for e, w in estimates
            ]
        decision = self.decide(
            ctx, chosen, "min_estimate", scored, cost_ms=round(best.cost, 3), load_ms=round(best.load, 3),
            residual_ms=round(best.residual, 3), estimate_ms=round(best.total, 3), target=self.params.target,
        )
        decision.estimated_ttft_ms = max(best.total, 0.0) if self.params.target == "ttft" else 0.0
        return decision

    # ---- hooks ----------------------------------------------------------------------
    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        worker = self.dispatched_worker(decision, ctx)
        if worker is None:
            return
        self._advance(ctx.now)
        est = self.estimates(ctx, [worker])[0]
        self._load[worker.id] = self._load.get(worker.id, 0.0) + est.cost
        rid = ctx.request.request_id
        if rid:
            self._inflight[rid] = _Dispatched(worker.id, est.cost, self._step, est.phi, est.cost + est.load)
            if len(self._inflight) > _MAX_TRACKED:
                self._inflight.popitem(last=False)

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        record = self._inflight.pop(completion.request_id, None)
        if record is None or record.worker_id not in self._load:
            return
        self._advance(now)
        remaining = record.cost * self.params.decay_rho ** (self._step - record.step)
        self._load[record.worker_id] = max(0.0, self._load[record.worker_id] - remaining)
        observed = completion.ttft_ms if self.params.target == "ttft" else completion.e2e_ms
        if not completion.success or not 0 < observed <= MAX_LATENCY_MS:  # NaN too: no sample
            return
        key = record.worker_id if self.params.residual_scope == "worker" else ""
        learner = self._learner(key)
        if learner is not None:
            residual = _clip(observed - record.base, *_RESIDUAL_RANGE)
            if self.params.residual_target == "penalty":
                residual = max(self.floor_ms, residual)
            learner.update(record.phi, residual)
            self._learners[key] = learner

    def on_worker_added(self, worker: Worker) -> None:
        self._load.setdefault(worker.id, 0.0)

    def on_worker_removed(self, worker: Worker) -> None:
        self._load.pop(worker.id, None)
        self._learners.pop(worker.id, None)

    def tick(self, now: float) -> None:
        self._advance(now)
