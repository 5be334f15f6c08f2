"""The shared time-to-first-token model: queueing + prefill compute, calibrated online.

Both DualMap (section 3.2, Eq. 7: ``TTFT(r, i) = T_q(r, i) + T_c(r, i)``) and Mooncake's
min-TTFT estimate TTFT as the time to clear a worker's pending prefill work plus the time to
prefill the request's own uncached tokens. Every policy that needs that estimate uses this
module, so one calibration serves them all, and the simulated engines (``sim.engine``) time
their steps with the same ``PowerLaw`` fit, so a router and the engines it routes to agree.

Prefill time of ``L`` uncached tokens (``prefill_model``):

- ``power_law``: ``T_c = a_ms * BS^b * (L / BS)^c`` for a batch of ``BS`` requests of
  ``L / BS`` tokens each, UniCache's timing model (section 3.2, Fig. 3; appendix A.1, Fig. 14).
- ``linear`` (default for the daemon): ``T_c = intercept_ms + ms_per_1k * L / 1000``.

**Calibration of the power law (``H100_LLAMA31_8B``, the defaults of ``power_*``).** UniCache
measured prefill times of Llama-3.1-8B on an H100 "across a range of batch sizes and input
lengths" and fitted ``prefill_time = 3.59e-5 s * BS^0.991 * L_in^1.018`` (appendix A.1, Fig.
14, R^2 = 0.999); its Fig. 3 fits ``5.56e-5 s * BS^0.992 * L_in^1.034`` for Llama-3.2-1B on an
A100 (``A100_LLAMA32_1B``). These are the only published fits of prefill time against batch
size among the papers we follow: DualMap (3.2) profiles its GPU but publishes no curve, LBGR
(appendix A) states its cost in a per-1k-token unit (1,000 ms per 1k uncached tokens) rather
than a measured time, and T-LRU (section 1) takes TTFT as linear in uncached tokens with a
fitted per-block ``alpha`` it does not publish. ``a`` is in ms here (3.59e-5 s = 0.0359 ms).
At batch 1 the H100 fit costs 40.7 ms per 1k tokens, which is where the linear default of 40
ms per 1k comes from. The fit is near-linear: a batch of 8 requests costs ``8^(b-1)`` = 98.1%
of prefilling them one by one and ``8^(b-c)`` = 94.5% of one request as long as all eight
(``c > 1``: a longer prompt costs more per token), and an 8,192-token request 346 ms, 5.5%
above the linear default.

**Attention over earlier context** (``attention_context_tokens``). The fits above were measured
on prompts prefilled from scratch in one piece, so they price a chunk's attention to itself
but not to the tokens before it: a chunk of ``n`` new tokens that follows ``p`` tokens already
in the KV cache (a cached prefix, which is not recomputed but is attended to, or the prompt's
earlier chunks) also computes ``n * p`` query-key pairs the fit never saw. ``PrefillCost``
prices them on top of the fit: ``attention_ms = token_ms * n * p / attention_context_tokens``,
where ``token_ms`` is the fit's cost of one token (batch 1, at 1k tokens: 40.7 ms / 1k for
``H100_LLAMA31_8B``, ``ms_per_1k / 1000`` for the linear model, intercept excluded) and
``attention_context_tokens`` is the context length at which one token's attention costs as much
as its linear layers. From FLOP counts per token (Kaplan et al. 2020, "Scaling Laws for Neural
Language Models", Table 1: ``2 N`` for the ``N`` parameters of the linear layers and ``2 *
n_layer * n_ctx * d_attn`` for the attention logits; Hoffmann et al. 2022, "Training
Compute-Optimal LLMs", appendix F, counts the value reduction alike, so ``4 * n_layer *
d_model * context`` in all): for Llama-3.1-8B (N = 8.03e9, 32 layers, d_model 4096) that is
``2 * 8.03e9 / (4 * 32 * 4096)`` = 30,632 tokens (``LLAMA31_8B_ATTENTION_TOKENS``), assuming
attention FLOPs run as fast as the fit's linear ones. What it gives: a prompt short enough for
one chunk, with nothing cached, has no earlier context and costs exactly the fit; a 1k-token
turn after a 4k cached prefix costs 13% more than the fit; a 131,072-token prompt in
8,192-token chunks (vLLM's budget) costs 2.93x the sixteen chunks priced alone (5.5 s of fit
plus 10.7 s of attention to earlier chunks). 0 turns the term off (per-chunk pricing).
What this assumes: attention at the linear layers' FLOP rate. The fit itself hints attention
may be cheaper on short prompts: its cost per token grows 3.8% from 1k to 8k tokens, a third
of the 11.6% FLOP parity predicts for attention within the prompt (ratio ~94k tokens, which
would give 1.6x at 128k); at long context FlashAttention-class kernels run near GEMM rates,
so FLOP parity is kept, matching the 2-3x issue #27 expects.

**Decode cost.** UniCache (section 3.2) found TPOT "relatively small ... but high variance
across settings" with no stable parametric fit, and models it as a batch-independent
constant, its measured mean; the simulated engines do the same (``tpot_ms``, 20 ms, our
assumption for an 8B model since the mean is not published) with ``--decode-model
constant``; by default they run decoding in their steps and charge a decode step ``tpot_ms *
(1 + slope * (D - 1))`` for D decoding requests (``sim.engine`` derives the slope). Routing here
estimates TTFT only, so no policy needs a decode model.

Queueing delay ``T_q`` is the prefill time of the worker's pending prefill tokens (the
uncached tokens of requests routed to it and not yet completed), treated as one batch of
``inflight`` requests for the power law; ``TTFT = T_q + T_c`` is the prefill time of the
pending tokens plus the request's own, so a linear model counts its intercept once. The *ttft_slo_threshold* of DualMap section 3.2,
the pending tokens a worker clears within a TTFT budget, is ``tokens_within(budget_ms)``.

Online calibration (``calibrate``): each ``Complete`` with an observed TTFT gives one sample
(tokens ahead of and including the request at dispatch, observed TTFT). A recursive least
squares fit with forgetting factor ``calibration_forgetting`` tracks ``(ms_per_1k,
intercept_ms)`` for the linear model, or ``(log a, b, c)`` on log-transformed values for the
power law, so estimates converge to the fleet actually served. The configured coefficients
are the prior and stay in use until ``calibration_min_samples`` samples arrived.

Parameters (``LatencyParams``, inherited by the Params of every policy using the model):

- ``prefill_model`` = "linear": "linear" or "power_law".
- ``prefill_ms_per_1k_tokens`` = 40.0: linear per-token cost (UniCache's H100 8B fit at batch 1).
- ``prefill_intercept_ms`` = 0.0: fixed cost per prefill (scheduling, first decode step).
- ``power_a_ms`` = 0.0359, ``power_b`` = 0.991, ``power_c`` = 1.018: ``H100_LLAMA31_8B``.
- ``calibrate`` = True: learn the coefficients from completions.
- ``calibration_forgetting`` = 0.992: RLS forgetting factor (LBGR's value).
- ``calibration_min_samples`` = 8: samples before calibrated coefficients replace the prior.
- ``pending_model`` = "drain": how pending prefill tokens are estimated (see ``pending_tokens``).
- ``attention_context_tokens`` = 0.0: attention over earlier context (see above; 0 = off, the
  daemon's default; ``kvrouterd sim cluster`` sets its engines' 30,632). ``ttft_ms`` prices the
  request's own attention to its cached prefix and its earlier chunks, not that of the queue.
- ``prefill_chunk_tokens`` = 8192: the engines' chunked-prefill budget, which bounds a chunk.

``kvrouterd sim cluster`` fills every ``prefill_*``/``power_*`` field a policy's spec leaves
unset with its engines' values (``sim.policy_specs.profiled_spec``), as DualMap profiles the GPU
it routes to.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..bounds import MAX_LATENCY_MS
from ..index.workers import Worker
from ..protocols import Completion, Decision, RouteRequest
from .base import RoutingContext, RoutingPolicyBase

__all__ = ["A100_LLAMA32_1B", "H100_LLAMA31_8B", "LATENCY_FIELDS", "LLAMA31_8B_ATTENTION_TOKENS", "LatencyModel",
           "LatencyParams", "PowerLaw", "PrefillCost", "RecursiveLeastSquares", "attended_pairs", "power_law_ms"]

# Tracked dispatches awaiting their Complete; beyond this the oldest are forgotten (a caller
# that never completes must not grow memory without bound).
_MAX_TRACKED = 200_000
# tokens_within never answers more than e^40 (~2e17) tokens
_LOG_MAX_TOKENS = 40.0
# a calibrated power law's a stays within e^+-20 ms
_LOG_A_RANGE = 20.0
# Physical bounds on the linear model as used: prefill never costs less than 1 us or more than
# 10^4 s per 1k tokens (a diverged fit in sim cluster reached 5.4e6 ms, inside), and never waits
# more than a day before its first token
_PER_1K_RANGE = (1e-3, 1e7)
_INTERCEPT_RANGE = (0.0, MAX_LATENCY_MS)
# Where the fits' state may wander (wider than the coefficients used, so a sane run never meets
# them: a fit that drifts out and back behaves as before), so one sample never makes it inf/NaN
_LINEAR_STATE = ((-_PER_1K_RANGE[1], _PER_1K_RANGE[1]), (-MAX_LATENCY_MS, MAX_LATENCY_MS))
_POWER_STATE = ((-1000.0, 1000.0), (-1000.0, 1000.0), (-1000.0, 1000.0))
# a calibration sample beyond these is not a measurement: dropped
_MAX_SAMPLE_TOKENS = 1 << 40
_MAX_SAMPLE_BATCH = 1 << 20


def _clip(x: float, lo: float, hi: float) -> float:
    """``x`` within [lo, hi]; NaN goes to ``lo``."""
    return x if lo <= x <= hi else (hi if x > hi else lo)


@dataclass(frozen=True)
class PowerLaw:
    """UniCache's prefill-time model (section 3.2): ``a_ms * BS^b * L_in^c`` ms for a batch of
    ``BS`` requests of ``L_in`` input tokens each."""

    a_ms: float
    b: float
    c: float

    def prefill_ms(self, tokens: float, batch: int = 1) -> float:
        """Prefill time of ``tokens`` tokens in all, split evenly over a batch of ``batch``."""
        return power_law_ms(self.a_ms, self.b, self.c, tokens, batch)

    def tokens_within(self, budget_ms: float) -> int:
        """Tokens one request prefills within ``budget_ms`` (the inverse at batch 1)."""
        if budget_ms <= 0:
            return 0
        # in logs, capped: an online fit can drive c towards 0, where the power overflows; the
        # logs taken apart where the ratio underflows to 0.0 (a subnormal budget: a domain error)
        ratio = budget_ms / self.a_ms
        log_ratio = math.log(ratio) if ratio > 0.0 else math.log(budget_ms) - math.log(self.a_ms)
        return int(math.exp(min(log_ratio / self.c, _LOG_MAX_TOKENS)))


def power_law_ms(a_ms: float, b: float, c: float, tokens: float, batch: int) -> float:
    """``PowerLaw(a_ms, b, c).prefill_ms(tokens, batch)`` without building one: the engines'
    step time and every routing estimate go through here, so they cannot disagree."""
    if tokens <= 0:
        return 0.0
    batch = max(batch, 1)
    return a_ms * batch**b * (tokens / batch) ** c


#: Llama-3.1-8B on an H100, UniCache appendix A.1, Fig. 14 (R^2 = 0.999): 3.59e-5 s * BS^0.991 * L^1.018
H100_LLAMA31_8B = PowerLaw(a_ms=0.0359, b=0.991, c=1.018)
#: Llama-3.2-1B on an A100, UniCache section 3.2, Fig. 3 (R^2 = 0.999): 5.56e-5 s * BS^0.992 * L^1.034
A100_LLAMA32_1B = PowerLaw(a_ms=0.0556, b=0.992, c=1.034)
#: the LatencyParams fields that describe the hardware (what ``sim cluster`` takes from its engines)
LATENCY_FIELDS = ("prefill_model", "prefill_ms_per_1k_tokens", "prefill_intercept_ms", "power_a_ms", "power_b",
                  "power_c", "attention_context_tokens", "prefill_chunk_tokens")
#: Llama-3.1-8B: context at which a token's attention FLOPs equal its linear layers',
#: 2 * params / (4 * layers * d_model) (see the module docstring)
LLAMA31_8B_ATTENTION_TOKENS = 2 * 8.03e9 / (4 * 32 * 4096)
#: the prompt length at which the attention term takes the fit's cost of one token
_ATTENTION_REF_TOKENS = 1000


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Compute time of one prefill step: the fitted model (``power_law`` or ``linear``) for its
    new tokens, plus their attention to the context before each request's chunk. The simulated
    engines time their steps with it and ``LatencyModel`` estimates with it, so the two agree."""

    model: Literal["linear", "power_law"]
    ms_per_1k: float
    intercept_ms: float
    a_ms: float
    b: float
    c: float
    attention_context_tokens: float = 0.0
    _pair_ms: float = field(init=False, repr=False, compare=False, default=0.0)

    def __post_init__(self) -> None:
        if self.attention_context_tokens > 0:
            ref = _ATTENTION_REF_TOKENS
            token_ms = (self.ms_per_1k / 1000.0 if self.model == "linear"
                        else power_law_ms(self.a_ms, self.b, self.c, ref, 1) / ref)
            object.__setattr__(self, "_pair_ms", token_ms / self.attention_context_tokens)

    def ms(self, tokens: float, batch: int = 1, attended: float = 0.0) -> float:
        """Time of ``tokens`` new tokens over ``batch`` requests whose tokens attend to
        ``attended`` (new token, earlier token) pairs outside their own chunk."""
        if tokens <= 0:
            return 0.0
        if self.model == "linear":
            base = self.intercept_ms + self.ms_per_1k * tokens / 1000.0
        else:
            base = power_law_ms(self.a_ms, self.b, self.c, tokens, batch)
        return base + self._pair_ms * attended if attended > 0 else base


#: ``PrefillCost``'s coefficients as a native pass reads them: (linear, ms_per_1k, intercept_ms,
#: a_ms, b, c, pair_ms, chunk), chunk the prompt's chunk tokens where the attention term is on, else 0
PricedCost = tuple[bool, float, float, float, float, float, float, int]


def _priced(cost: PrefillCost, params: LatencyParams) -> PricedCost:
    chunk = max(params.prefill_chunk_tokens, 1) if params.attention_context_tokens > 0 else 0
    return (cost.model == "linear", cost.ms_per_1k, cost.intercept_ms, cost.a_ms, cost.b, cost.c, cost._pair_ms, chunk)


def attended_pairs(new_tokens: int, context_tokens: int, chunk_tokens: int) -> int:
    """(new token, earlier token) pairs outside a chunk when ``new_tokens`` are prefilled after
    ``context_tokens`` already in the cache, ``chunk_tokens`` at a time: every new token attends
    to the context, and each chunk to the chunks before it."""
    if new_tokens <= 0:
        return 0
    full, rest = divmod(new_tokens, max(chunk_tokens, 1))
    chunk = max(chunk_tokens, 1)
    return new_tokens * max(context_tokens, 0) + chunk * chunk * full * (full - 1) // 2 + rest * full * chunk


@dataclass(frozen=True)
class LatencyParams:
    prefill_model: Literal["linear", "power_law"] = field(
        default="linear", metadata={"help": "prefill-time model: linear per-token cost, or UniCache's a*batch^b*L^c"}
    )
    prefill_ms_per_1k_tokens: float = field(
        default=40.0, metadata={"help": "linear model: prefill ms per 1,000 uncached tokens"}
    )
    prefill_intercept_ms: float = field(default=0.0, metadata={"help": "linear model: fixed ms per prefill"})
    power_a_ms: float = field(default=H100_LLAMA31_8B.a_ms, metadata={"help": "power law: coefficient a, in ms"})
    power_b: float = field(default=H100_LLAMA31_8B.b, metadata={"help": "power law: batch-size exponent b"})
    power_c: float = field(default=H100_LLAMA31_8B.c, metadata={"help": "power law: input-length exponent c"})
    calibrate: bool = field(default=True, metadata={"help": "fit the coefficients online from observed TTFT"})
    calibration_forgetting: float = field(
        default=0.992, metadata={"help": "forgetting factor of the online least-squares fit, in (0, 1]"}
    )
    calibration_min_samples: int = field(
        default=8, metadata={"help": "completions needed before calibrated coefficients are used"}
    )
    pending_model: Literal["drain", "inflight"] = field(
        default="drain",
        metadata={"help": "pending prefill tokens: drained at the model's prefill rate, or every uncompleted request's"},
    )
    attention_context_tokens: float = field(default=0.0, metadata={
        "help": "context length at which a token's attention costs as much as its linear layers (prices "
                "attention to a cached prefix and earlier chunks; 0 = off)"})
    prefill_chunk_tokens: int = field(default=8192, metadata={"help": "the engines' chunked-prefill budget, tokens"})

    def validate(self) -> None:
        for name in ("prefill_ms_per_1k_tokens", "prefill_intercept_ms", "power_a_ms", "power_b", "power_c"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.prefill_ms_per_1k_tokens <= 0:
            raise ValueError(f"prefill_ms_per_1k_tokens must be > 0, got {self.prefill_ms_per_1k_tokens}")
        if self.prefill_intercept_ms < 0:
            raise ValueError(f"prefill_intercept_ms must be >= 0, got {self.prefill_intercept_ms}")
        if self.power_a_ms <= 0:
            raise ValueError(f"power_a_ms must be > 0, got {self.power_a_ms}")
        if self.power_c <= 0:
            raise ValueError(f"power_c must be > 0, got {self.power_c}")
        if not 0.0 < self.calibration_forgetting <= 1.0:
            raise ValueError(f"calibration_forgetting must be in (0, 1], got {self.calibration_forgetting}")
        if self.calibration_min_samples < 1:
            raise ValueError(f"calibration_min_samples must be >= 1, got {self.calibration_min_samples}")
        if self.pending_model not in ("drain", "inflight"):
            raise ValueError(f"pending_model must be 'drain' or 'inflight', got {self.pending_model!r}")
        if self.attention_context_tokens < 0:
            raise ValueError(f"attention_context_tokens must be >= 0, got {self.attention_context_tokens}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")


class RecursiveLeastSquares:
    """Exponentially weighted recursive least squares for ``y ~ theta . x``.

    ``forgetting`` < 1 discounts old samples (weight ``forgetting^age``). The covariance is
    not inflated further once its trace exceeds its initial value, so long runs of
    uninformative samples cannot wind it up into instability.

    Samples come from clients, so no sample can break the fit: one that is not finite, or
    whose update would leave theta or the covariance non-finite, is dropped (not counted), and
    theta is held within ``bounds`` (per coefficient ``(low, high)``; None = unbounded) after
    every update.
    """

    __slots__ = ("_bounds", "_max_trace", "_p", "forgetting", "samples", "theta")

    def __init__(self, theta: list[float], forgetting: float, initial_variance: float = 1e4,
                 bounds: Sequence[tuple[float, float]] | None = None) -> None:
        n = len(theta)
        if bounds is not None and len(bounds) != n:
            raise ValueError(f"{len(bounds)} bounds for {n} coefficients")
        self._bounds = tuple(bounds) if bounds is not None else None
        self.theta = list(theta) if bounds is None else [_clip(t, lo, hi) for t, (lo, hi) in zip(theta, bounds)]
        self._p = [[initial_variance if r == c else 0.0 for c in range(n)] for r in range(n)]
        self.forgetting = forgetting
        self._max_trace = initial_variance * n
        self.samples = 0

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x: list[float], y: float) -> float:
        """Fold in one sample; returns the prior error ``y - theta . x`` (NaN for a sample
        dropped as not finite)."""
        if not (math.isfinite(y) and all(map(math.isfinite, x))):
            return math.nan
        p, n = self._p, len(x)
        px = [sum(p[r][c] * x[c] for c in range(n)) for r in range(n)]
        denom = self.forgetting + sum(x[r] * px[r] for r in range(n))
        error = y - self.predict(x)
        if not denom > 0 or not math.isfinite(denom) or not math.isfinite(error):
            return error
        gain = [v / denom for v in px]
        theta = [t + g * error for t, g in zip(self.theta, gain)]
        lam = self.forgetting
        if sum(p[i][i] for i in range(n)) > self._max_trace:
            lam = 1.0
        # P is symmetric, so x^T P = (P x)^T
        new_p = [[(p[r][c] - gain[r] * px[c]) / lam for c in range(n)] for r in range(n)]
        if not (all(map(math.isfinite, theta)) and all(math.isfinite(v) for row in new_p for v in row)):
            return error  # an overflow: the sample is dropped, the fit stays where it was
        if self._bounds is not None:
            theta = [_clip(t, lo, hi) for t, (lo, hi) in zip(theta, self._bounds)]
        self.theta, self._p = theta, new_p
        self.samples += 1
        return error


class LatencyModel:
    """TTFT estimates for a fleet, from one LatencyParams, optionally calibrated online.

    ``note_dispatch`` remembers what a routed request had ahead of it; ``observe_completion``
    turns its observed TTFT into a calibration sample. Both are called from policy hooks, so
    estimation itself (``ttft_ms`` and friends) stays side-effect free.
    """

    def __init__(self, params: LatencyParams) -> None:
        self.params = params
        if params.prefill_model == "linear":
            prior = [params.prefill_ms_per_1k_tokens, params.prefill_intercept_ms]
            state = _LINEAR_STATE
        else:
            prior = [math.log(params.power_a_ms), params.power_b, params.power_c]
            state = _POWER_STATE
        self._fit = RecursiveLeastSquares(prior, params.calibration_forgetting, bounds=state)
        self._prior = tuple(prior)
        self._prior_cost = self._cost(self.coefficients())
        self._tracked: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._backlog: dict[str, tuple[float, float]] = {}  # worker id -> (tokens, as of time)
        #: ``(cost(), prefill_rate(), pricing_inputs()'s cost)`` and the fit's sample count they
        #: were worked out at (``_per_sample``)
        self._kept: tuple[PrefillCost, float, PricedCost] = (self._prior_cost, 0.0, _priced(self._prior_cost, params))
        self._kept_at = -1

    # ---- coefficients -----------------------------------------------------------------
    @property
    def samples(self) -> int:
        return self._fit.samples

    @property
    def calibrated(self) -> bool:
        return self.params.calibrate and self._fit.samples >= self.params.calibration_min_samples

    def coefficients(self) -> tuple[float, ...]:
        """(ms_per_1k, intercept_ms) or (a_ms, b, c) as currently used."""
        theta = self._fit.theta if self.calibrated else list(self._prior)
        if self.params.prefill_model == "linear":
            # a fit can wander non-physical on degenerate data (or a client's outliers): never let
            # prefill cost vanish, or grow past any hardware's
            return (_clip(theta[0], *_PER_1K_RANGE), _clip(theta[1], *_INTERCEPT_RANGE))
        # Samples whose TTFT is mostly queueing the tokens do not explain can drive the log-space
        # fit anywhere (in sim reproduce one reached a = e^710 ms and overflowed): hold it to
        # physical ranges around the published fits (b, c ~ 1): a prefill's cost grows with its
        # tokens at least as sqrt and at most quadratically (attention), and with its batch size
        # at most quadratically
        return (math.exp(_clip(theta[0], -_LOG_A_RANGE, _LOG_A_RANGE)), _clip(theta[1], 0.0, 2.0),
                _clip(theta[2], 0.5, 2.0))

    def _cost(self, coefficients: tuple[float, ...]) -> PrefillCost:
        p = self.params
        if p.prefill_model == "linear":
            per_1k, intercept = coefficients
            return PrefillCost("linear", per_1k, intercept, p.power_a_ms, p.power_b, p.power_c,
                               p.attention_context_tokens)
        a, b, c = coefficients
        return PrefillCost("power_law", p.prefill_ms_per_1k_tokens, p.prefill_intercept_ms, a, b, c,
                           p.attention_context_tokens)

    def cost(self) -> PrefillCost:
        """The prefill cost function under the current coefficients."""
        return self._per_sample()[0]

    def _per_sample(self) -> tuple[PrefillCost, float, PricedCost]:
        """``(cost(), prefill_rate(), the cost as pricing_inputs() gives it)``, worked out once
        per calibration sample: the fit changes only by a sample, and every estimate asks for the
        cost (building it was most of what a calibrated estimate cost), a policy pricing the
        fleet (DualMap's cold placement, min_ttft) for the rate once per worker (~1.5 us each)."""
        samples = self._fit.samples
        if self._kept_at != samples:
            cost = self._cost(self.coefficients()) if self.calibrated else self._prior_cost
            rate = float(max(self.tokens_within(1000.0), 1))
            self._kept, self._kept_at = (cost, rate, _priced(cost, self.params)), samples
        return self._kept

    def pricing_inputs(self) -> tuple[dict[str, tuple[float, float]] | None, float, PricedCost]:
        """What a native pass pricing the fleet (``index/_native.c``: ``min_ttft_pick``) needs
        to work out ``pending_tokens`` and ``ttft_ms`` as this model does: the drained backlog
        (None where the pending model counts the tokens in flight as they are), the prefill
        rate, and the cost's coefficients with the attention term's chunk (0: no term)."""
        _, rate, priced = self._per_sample()
        return (None if self.params.pending_model == "inflight" else self._backlog), rate, priced

    def pricing_args(self, ctx: RoutingContext) -> tuple[object, ...]:
        """The arguments every native pass pricing ``ctx``'s candidates takes first
        (``index/_native.c``: ``TtftPass``, read by ``min_ttft_pick``, ``preble_pick`` and
        ``dualmap_cold_pick``): the candidates, their slots, the walk, the claimed blocks, the
        prompt, the block size and the time, then ``pricing_inputs()``."""
        return (ctx.candidates, ctx.candidate_slots, ctx.match.overlaps, ctx.claimed, ctx.request.prompt_tokens,
                ctx.block_size, ctx.now, *self.pricing_inputs())

    # ---- estimates --------------------------------------------------------------------
    def prefill_ms(self, tokens: float, batch: int = 1, attended: float = 0.0) -> float:
        """Time to prefill ``tokens`` tokens as one batch of ``batch`` requests whose tokens
        attend to ``attended`` earlier-context pairs (``attended_pairs``)."""
        return self.cost().ms(tokens, batch, attended)

    def queue_ms(self, pending_tokens: int, inflight: int = 1) -> float:
        """T_q: time to clear ``pending_tokens`` of prefill already routed to a worker."""
        return self.prefill_ms(pending_tokens, max(inflight, 1))

    def ttft_ms(self, uncached_tokens: int, pending_tokens: int, inflight: int = 0, cached_tokens: int = 0) -> float:
        """T_q + T_c for a request with ``uncached_tokens`` to prefill after ``cached_tokens`` of
        cached prefix, behind ``pending_tokens`` of ``inflight`` requests.

        Estimated as the prefill time of all that work as one batch, the same quantity the
        calibration fits, so T_c is ``ttft_ms - queue_ms`` (the intercept is counted once),
        plus the request's attention to its prefix and earlier chunks (``attention_context_tokens``).
        """
        p = self.params
        attended = (attended_pairs(uncached_tokens, cached_tokens, p.prefill_chunk_tokens)
                    if p.attention_context_tokens > 0 else 0)
        return self.prefill_ms(pending_tokens + uncached_tokens, max(inflight, 0) + 1, attended)

    def tokens_within(self, budget_ms: float) -> int:
        """Prefill tokens one worker clears within ``budget_ms`` (DualMap's ttft_slo_threshold)."""
        if not budget_ms > 0:  # NaN too
            return 0
        if self.params.prefill_model == "linear":
            per_1k, intercept = self.coefficients()
            # capped as the power law's inverse is: an infinite budget is not infinite tokens
            return int(_clip((budget_ms - intercept) * 1000.0 / per_1k, 0.0, math.exp(_LOG_MAX_TOKENS)))
        a, b, c = self.coefficients()
        return PowerLaw(a, b, c).tokens_within(budget_ms)

    # ---- pending prefill ----------------------------------------------------------------
    def prefill_rate(self) -> float:
        """Prefill tokens per second one worker computes, under the current coefficients."""
        return self._per_sample()[1]

    def pending_tokens(self, worker: Worker, now: float) -> int:
        """Prefill tokens still ahead on ``worker`` at ``now``.

        The router learns that a request's prefill is done only from its ``Complete``, after
        the whole decode, so its count of uncached tokens in flight (``pending_model:
        inflight``) includes prompts prefilled long ago. ``drain`` runs each worker's routed
        prefill through a fluid queue served at ``prefill_rate()`` instead, capped by that
        count: the pending prefill tokens a worker would report (DualMap section 3.2).
        """
        return self._pending(worker, now, worker.pending_prefill_tokens)

    def _pending(self, worker: Worker, now: float, committed: int) -> int:
        if self.params.pending_model == "inflight" or committed <= 0:  # nothing committed: none drains
            return committed
        tokens, at = self._backlog.get(worker.id, (0.0, now))
        left = tokens - self.prefill_rate() * max(0.0, now - at)
        return min(max(round(left), 0), committed)

    def on_dispatch(self, worker: Worker, request_id: str, uncached_tokens: int, now: float) -> None:
        """The host committed a request with ``uncached_tokens`` to prefill to ``worker``."""
        # the host has already charged this request to the worker's in-flight count
        before = self._pending(worker, now, max(0, worker.pending_prefill_tokens - uncached_tokens))
        self._backlog[worker.id] = (float(before + uncached_tokens), now)
        self.note_dispatch(request_id, before + uncached_tokens, worker.inflight_requests)

    def forget_worker(self, worker_id: str) -> None:
        self._backlog.pop(worker_id, None)

    # ---- calibration ------------------------------------------------------------------
    def note_dispatch(self, request_id: str, tokens_ahead: int, batch: int) -> None:
        """Remember the prefill tokens ahead of (and including) a dispatched request."""
        if not self.params.calibrate or not request_id:
            return
        self._tracked[request_id] = (tokens_ahead, batch)
        if len(self._tracked) > _MAX_TRACKED:
            self._tracked.popitem(last=False)

    def forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def observe_completion(self, request_id: str, ttft_ms: float) -> bool:
        """Use a completed request's observed TTFT as a sample; False if it gave none."""
        seen = self._tracked.pop(request_id, None)
        if seen is None or not 0 < ttft_ms <= MAX_LATENCY_MS or not self.params.calibrate:
            return False
        self.observe(seen[0], seen[1], ttft_ms)
        return True

    def observe(self, tokens_ahead: int, batch: int, ttft_ms: float) -> None:
        """One calibration sample: ``tokens_ahead`` prefill tokens took ``ttft_ms``. A sample no
        real prefill could produce (not finite, over a day, more tokens than any cache) is
        dropped: the Router refuses such completions, and the fit does not rely on it."""
        if not (0 < tokens_ahead <= _MAX_SAMPLE_TOKENS and 0 < ttft_ms <= MAX_LATENCY_MS
                and batch <= _MAX_SAMPLE_BATCH):
            return
        if self.params.prefill_model == "linear":
            self._fit.update([tokens_ahead / 1000.0, 1.0], ttft_ms)
        else:
            batch = max(batch, 1)
            self._fit.update([1.0, math.log(batch), math.log(tokens_ahead / batch)], math.log(ttft_ms))


class CalibratedRoutingPolicy(RoutingPolicyBase):
    """A routing policy that keeps a LatencyModel current from its own dispatches and the
    TTFT each Complete reports (min_ttft, preble): the hooks every such policy needs alike."""

    latency: LatencyModel

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        worker = self.dispatched_worker(decision, ctx)
        if worker is not None:
            self.latency.on_dispatch(worker, ctx.request.request_id, ctx.uncached_tokens(worker), ctx.now)

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        self.latency.observe_completion(completion.request_id, completion.ttft_ms)

    def on_worker_removed(self, worker: Worker) -> None:
        self.latency.forget_worker(worker.id)
