"""Deadline admission: refuse, at routing time, a request predicted to miss its TTFT SLO everywhere.

Past capacity a router that admits everything builds queues until *every* request waits
longer than its SLO: goodput (requests within SLO per second) collapses although the GPUs
are busy. Serving fewer requests on time beats serving all of them late, so admission
predicts each request's TTFT before it commits it, and refuses the ones that cannot make it.

**The prediction.** ``TTFT(r, w) = T_q + T_c`` (DualMap section 3.2, Eq. 7), priced by the
shared model of ``policies/latency.py`` (``LatencyModel.ttft_ms``, ``admission.latency``):
``T_c`` is the request's own prefill, with its attention to its cached prefix and earlier
chunks; ``T_q`` is the worker's *backlog*, the modelled prefill time of every request routed
to it (each priced the same way when dispatched) drained as time passes, plus the requests
waiting for it in the router's admission queue. The backlog is kept in milliseconds, not
tokens: a 100k-token prompt costs 2-3x its tokens' linear price (attention), and a backlog
of tokens drained at the linear rate hid exactly the prompts that cause the collapse. The
guard keeps this state itself, fed by the host's dispatches and completions, so it works
behind any routing policy, including those that estimate no time (cache_aware, llm_d).

The model prices prefill alone; an engine also spends its steps decoding and may preempt,
so every prediction (and the drain rate) is scaled by ``scale``, a moving geometric mean
(weight 0.05 per completion) of observed over predicted TTFT. Without it predictions ran
5-10x short past capacity on Mooncake and nothing was shed; an online refit of the power
law's coefficients (``calibrate``, which the guard turns off) instead overshot and shed 45%.

**The margin.** The corrections are learned over every completion; past capacity the requests
that matter are those admitted right at the SLO, and the queues they join go on growing after
the prediction (GSP at 1.5x capacity: admitted TTFTs p50 4.8 s, p90 5.4 s, 60% within SLO).
So admission also asks each request to fit its SLO ``margin`` times over, a controller on the
outcome itself: raised while more than ``1 - quantile`` of the requests admitted as meeting
their SLO miss it, back to 1 once they meet it (goodput at 1.5x capacity on GSP 64 -> 96 req/s,
peak ~99, with first-token reports). It learns only from TTFTs heard within two SLOs of their
request's admission.

**When it learns.** A Complete reports the TTFT when the last token is out: on tool/agent
(182 output tokens) half a minute after the queue that caused it, by when admission has let
the KV caches fill and every queued request stall behind the decodes. So a host reports each
first token as it comes (``on_first_token``: a ``prefill_done`` Complete with ``ttft_ms``, or
ext_proc's first response chunk), and the corrections learn then; goodput at 1.5x capacity on
tool/agent went from 15.5 to 18.8 req/s.

**The rule** (``check``): if the chosen worker is predicted to meet the request's SLO
(``ttft_slo_ms``, else ``default_ttft_slo_ms``), the decision stands. (A request whose
prefill alone exceeds its SLO is held to that prefill time instead: served where it can
start at once, refused for the fleet's load, never for its size alone.) Else the request is
re-decided among the eligible workers predicted to meet it (the policy still chooses, so
cache affinity is kept among them); if there are none it is shed with ``SloUnreachable``
(RESOURCE_EXHAUSTED, the message giving predicted TTFT against the SLO, and a
``retry-after-ms`` hint: the predicted excess, the time the backlog needs to drain that far).

**Modes** (``admission.deadline``):

- ``shed`` (the default): decide once, at routing time. The shed request costs nothing; the
  admitted ones keep their whole SLO as slack for the model's errors. A request that declared
  no SLO of its own is steered by ``default_ttft_slo_ms`` but not refused (unless
  ``admission.shed_without_slo``).
- ``defer`` (needs admission queues, ``admission.max_inflight``): as ``shed`` at routing
  time, and a request waiting in an admission queue is dropped (``SloUnreachable``) the
  moment its time waited plus its predicted TTFT from its place in the queue passes its SLO
  (``AdmissionQueues.drop_late``, every tick), so a queue the model under-estimated stops
  spending GPU time on requests already lost.
- ``off``: admit everything.

Why shed rather than hold everything: a request queued past its deadline is lost work for
the request *and* delays every one behind it, which is how the collapse happens; a request
shed at once lets the gateway answer 429 immediately (or retry elsewhere) and costs the
fleet nothing. Holding a request the model says can still make it (defer) only pays when
the model errs, which is what ``defer`` adds on top. Measured (``sim cluster``, Mooncake
conversation, 4,000 requests, 8 workers, cache 30%, SLO 5 s, hardware speed 2, DualMap at
26.5 req/s, 1.5x its capacity without admission): off 0.85 req/s within SLO, shed 15.4
(99 requests refused), defer with ``max_inflight`` 16: 15.9 (1,182 refused). Defer buys 3%
goodput for twelve times the refusals, so ``shed`` is the recommended mode.

**Prior art.** DualMap (section 3.3, A.1.2) keeps an admission queue per instance and
migrates queued requests that would miss their SLO, but never refuses one: past capacity
its queues grow without bound. The Gateway API Inference Extension / llm-d endpoint picker
holds requests in a flow-control queue while its *saturation detector* (queue depth and KV
utilisation over thresholds, or a concurrency cap) says the pool is full, and drops
"sheddable" ones when saturated; NVIDIA Dynamo's frontend answers 503 when every worker is
over its busy threshold. Both judge load by thresholds on utilisation; this guard judges
each request by its own predicted TTFT against its own SLO, so a short prompt can still be
admitted where a long one is refused, and no threshold needs tuning per workload.

This module holds no clock, lock or future; the host (``server.admission``, ``sim.cluster``)
drives it as it drives ``kvrouterd.admission``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

from .bounds import MAX_LATENCY_MS
from .errors import ConfigError, SloUnreachable
from .index import native
from .policies.base import NONE_CLAIMED
from .policies.latency import LatencyModel, LatencyParams

if TYPE_CHECKING:
    from .index.workers import Worker
    from .policies.base import RoutingContext, RoutingPolicy
    from .protocols import Decision, RouteRequest
    from .router import Router

__all__ = ["DEADLINE_MODES", "DeadlineGuard", "DeadlineMode", "Pricing", "Verdict", "admit_priced", "nothing_queued"]

DeadlineMode = Literal["off", "shed", "defer"]
DEADLINE_MODES: tuple[str, ...] = ("off", "shed", "defer")
#: the shortest retry hint: a backlog drains in steps of an engine's prefill chunk, not faster
MIN_RETRY_AFTER_MS = 100.0
#: weight of one completion in the moving mean of log(observed / predicted TTFT)
_SCALE_WEIGHT = 0.05
#: the correction stays within e^+-3 (x0.05 to x20)
_LOG_SCALE_RANGE = 3.0
#: step of the online quantile of observed / predicted TTFT, in log units per completion
_TAIL_STEP = 0.05
#: load levels the correction is kept for: reported running requests 0, 1, 2-3, ..., 64+
_LOAD_LEVELS = 8
#: step of the admission margin, in log units per admitted request's outcome
_MARGIN_STEP = 0.005
#: the quantile deadline admission judges by (``admission.deadline_quantile``)
DEFAULT_QUANTILE = 0.9
#: weight of one completion in the moving mean of a request's time holding KV after its first token
_HOLD_WEIGHT = 0.05
#: predictions shorter than this are mostly the engine's step granularity: no sample
_MIN_SAMPLE_MS = 50.0
#: dispatched requests whose prediction awaits its completion; beyond, the oldest are forgotten
_MAX_TRACKED = 200_000
#: requests queued for a worker in the router (requests, prefill tokens), by worker id
Queued = Callable[[str], tuple[int, int]]
#: what admission priced on the worker it admitted a request to, handed to ``on_dispatch`` when
#: the decision commits in the same step, so the commit does not price it again: (the worker,
#: now, uncached and cached prompt tokens, its backlog drained to now, and the larger of that
#: and its wait for KV room, model ms). Valid for that step only: any dispatch, completion or
#: load report in between changes what it priced.
Pricing = tuple["Worker", float, int, int, float, float]
#: what ``_kv_wait`` reads besides the worker, as ``check`` hands it to the native verdict:
#: (hold_ms, its spread, the router's block size, MAX_LATENCY_MS, uncached tokens and count of
#: the requests waiting per worker, and each worker's flight)
KvInputs = tuple[float, float, int, float, dict[str, int], dict[str, int],
                 dict[str, OrderedDict[str, tuple[float, float, int, float]]]]


def nothing_queued(_: str) -> tuple[int, int]:
    """``Queued`` of a host that keeps no admission queues: ``check`` then asks it nothing (a
    host's own queue count, called for each of 1,024 workers, was a third of a check)."""
    return (0, 0)


def _load_level(worker: Worker) -> int:
    """``worker``'s reported running requests in powers of two: 0, 1, 2-3, 4-7, ..., 64+."""
    return min(worker.reported_running.bit_length(), _LOAD_LEVELS - 1)


if native.module is not None:  # what the native passes of a Route's books (deadline_price, ...) read
    native.module.deadline_constants(_SCALE_WEIGHT, _LOG_SCALE_RANGE, _TAIL_STEP, _MARGIN_STEP, _HOLD_WEIGHT,
                                     _MIN_SAMPLE_MS, MAX_LATENCY_MS, _MAX_TRACKED, _LOAD_LEVELS)

#: ``DeadlineGuard.admit_chosen`` in one native call (None: no extension)
_deadline_admit = native.module.deadline_admit if native.module is not None else None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What deadline admission found for one decision."""

    slo_ms: float
    #: predicted TTFT on the chosen worker
    predicted_ms: float
    #: predicted TTFT on the eligible worker where it overshoots its budget least
    best_ms: float
    #: the budget there: the SLO, or the request's TTFT on that worker idle when that is longer
    budget_ms: float
    #: eligible workers predicted to meet the budget, in the context's order (empty = shed)
    meets: tuple[str, ...]

    @property
    def shed(self) -> bool:
        return not self.meets

    @property
    def retry_after_ms(self) -> float:
        """How long the best worker's predicted backlog needs to drain for the request to fit."""
        return max(MIN_RETRY_AFTER_MS, math.ceil(self.best_ms - self.budget_ms))


class DeadlineGuard:
    """Predicts a request's TTFT per eligible worker and says whether it can meet its SLO.

    ``shed``, ``rerouted`` and ``expired`` count what it did; ``expired`` counts the requests
    ``AdmissionQueues.drop_late`` dropped (``late_refusal`` counts one).
    """

    # members, not a dict: the native passes (index/_native.c, attr_get) read and write them
    # in place, where the generic lookup was ~190 instructions each
    __slots__ = (
        "_anchored", "_backlog", "_flight", "_hold_sq_ms", "_judged", "_last_prefill", "_levels", "_log_margin",
        "_margin", "_predicted", "_samples", "_scales", "_tails", "_waiting_count", "_waiting_tokens", "_where",
        "block_size", "expired", "hold_ms", "latency", "mode", "quantile", "rerouted", "shed", "spared",
    )

    def __init__(self, mode: DeadlineMode, params: LatencyParams | None = None, quantile: float = DEFAULT_QUANTILE,
                 block_size: int = 0) -> None:
        if mode not in DEADLINE_MODES:
            raise ConfigError(f"deadline: expected one of {', '.join(DEADLINE_MODES)}, got {mode!r}")
        if not 0.0 < quantile < 1.0:
            raise ConfigError(f"deadline quantile: expected a number in (0, 1), got {quantile!r}")
        self.mode = mode
        #: the share of admitted requests the guard aims to see meet their SLO: it admits a
        #: request when this quantile of observed / predicted TTFT, times the prediction, fits
        self.quantile = quantile
        #: that quantile and the geometric mean (``on_complete``), one of each per load level:
        #: a worker's reported running requests, in powers of two (``_load_level``). Decode
        #: steps share the GPU with prefill, so the same queue takes longer on a worker with
        #: more requests decoding: on the tool/agent workload past capacity observed /
        #: predicted TTFT had a p90 of 1.1-1.4 below 50 running requests and 3.4 above, and one
        #: correction for all workers admitted floods onto the busiest while shedding at idle ones
        self._tails = [1.0] * _LOAD_LEVELS
        self._scales = [1.0] * _LOAD_LEVELS
        #: how much longer than its prediction a request must still fit its SLO in, log units:
        #: a controller on the outcome itself (``on_complete``), raised when more than
        #: ``1 - quantile`` of the requests admitted as meeting their SLO missed it. The ratio's
        #: quantile is learned over every completion; past capacity the requests that matter are
        #: those admitted right at the SLO, and there the queues they join keep growing after
        #: the prediction (GSP at 1.5x capacity: admitted TTFTs p50 4.8 s, p90 5.4 s, 60% met)
        self._log_margin = 0.0
        #: request id -> (the SLO it was admitted against as predicted to meet it, admitted at)
        self._judged: OrderedDict[str, tuple[float, float]] = OrderedDict()
        #: completions seen per level; a level with none borrows the nearest quieter one's
        self._samples = [0] * _LOAD_LEVELS
        #: (scale, tail) per level as ``_level_value`` reads them, redone whenever a sample
        #: changes them (``_learn``): every Route reads them two to five times
        self._levels = self._level_corrections()
        #: ``exp(_log_margin)``, redone whenever the margin moves
        self._margin = 1.0
        params = params or LatencyParams()
        try:
            params.validate()
        except ValueError as exc:
            raise ConfigError(f"admission.latency: {exc}") from None
        # prices prefill only; ``scale`` is the online correction (a refit of the power law
        # on queue-dominated samples overshot: see the module docstring)
        self.latency = LatencyModel(dataclasses.replace(params, calibrate=False))
        #: ((uncached, cached) tokens, ms): the last ``prefill_ms`` priced. The model never
        #: calibrates, so a price stays right; a Route asks for its own twice (admission, dispatch)
        self._last_prefill: tuple[tuple[int, int], float] = ((-1, -1), 0.0)
        #: request id -> (its modelled TTFT when dispatched, its worker's load level then)
        self._predicted: OrderedDict[str, tuple[float, int]] = OrderedDict()
        #: worker id -> (modelled ms of prefill routed to it and not yet done, as of time)
        self._backlog: dict[str, tuple[float, float]] = {}
        #: worker id -> its uncompleted dispatches in order, request id -> (own modelled
        #: prefill ms, dispatched at, uncached prompt tokens (the KV it adds), first token at
        #: or 0): what a load report re-anchors the backlog to
        self._flight: dict[str, OrderedDict[str, tuple[float, float, int, float]]] = {}
        #: worker id -> uncached prompt tokens and count of the requests waiting there, the newest of
        #: ``_flight`` (``kv_wait_ms``)
        self._waiting_tokens: dict[str, int] = {}
        self._waiting_count: dict[str, int] = {}
        #: the router's block size: a worker's KV capacity in tokens is its capacity_blocks times
        #: its own block size, or this one (0 with neither: the KV turnover wait is not modelled)
        self.block_size = block_size
        #: moving mean of ms a request holds its KV after its first token (its decode), from
        #: Completes that report both times; 0 until one does
        self.hold_ms = 0.0
        #: moving mean of its square (``_hold_spread``)
        self._hold_sq_ms = 0.0
        #: request id -> the worker it was dispatched to (to find it in ``_flight``)
        self._where: dict[str, str] = {}
        #: worker id -> the load report its backlog was last anchored to (its ``reported_at``)
        self._anchored: dict[str, float] = {}
        self.shed = 0
        self.rerouted = 0
        self.expired = 0
        #: requests predicted to miss everywhere but admitted: they declared no SLO (``spare``)
        self.spared = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    # ---- prediction -------------------------------------------------------------------
    def prefill_ms(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Modelled time of one request's own prefill, its attention to its prefix included."""
        tokens = (uncached_tokens, cached_tokens)
        last = self._last_prefill
        if last[0] == tokens:
            return last[1]
        ms = self.latency.ttft_ms(uncached_tokens, 0, 0, cached_tokens)
        self._last_prefill = (tokens, ms)
        return ms

    def backlog_ms(self, worker: Worker, now: float) -> float:
        """Modelled prefill time routed to ``worker`` and not yet done: each dispatch adds its
        own prefill time (long prompts' attention included, which a backlog counted in tokens
        would drain far too fast), drained as time passes at ``1 / scale``."""
        if not worker.inflight_requests:
            return 0.0
        self._sync(worker)
        return self._drained(worker, now, self._corrections(worker)[0])

    def _drained(self, worker: Worker, now: float, scale: float) -> float:
        """``backlog_ms`` of a worker with requests in flight, its books synced, at ``scale``."""
        ms, at = self._backlog.get(worker.id, (0.0, now))
        return max(0.0, ms - (now - at) * 1000.0 / scale)

    def kv_wait_ms(self, worker: Worker, now: float, tokens: int = 0) -> float:
        """Real ms until ``worker`` has KV room for the requests waiting there and ``tokens``
        more, from its last load report.

        An engine starts a queued request only when its KV blocks fit beside the running
        requests'; once they do not, the queue moves as decodes finish and free theirs, not at
        the prefill rate the model prices. A running request frees its prompt's blocks about
        ``hold_ms`` after its first token (its decode, learned from Completes), the oldest
        first, so the wait is until enough of them have: on tool/agent past capacity the caches
        filled about 15 s in, and requests the prefill model gave 4.5 s waited 12 s behind 90
        decoding requests that had all started within the last 15 s."""
        self._sync(worker)
        return self._kv_wait(worker, now, tokens)

    def _kv_wait(self, worker: Worker, now: float, tokens: int) -> float:
        """``kv_wait_ms`` with ``worker``'s books synced."""
        bs = worker.spec.block_size or self.block_size
        capacity = worker.spec.capacity_blocks * bs
        used = worker.kv_utilization
        if not capacity or not self.hold_ms or used <= 0.0:
            return 0.0
        deficit = self._waiting_tokens.get(worker.id, 0) + tokens - (1.0 - used) * capacity
        if deficit <= 0:
            return 0.0
        # two limits, weighed by how much decode times vary (their squared coefficient of
        # variation): equal decodes free the oldest requests' blocks first, ``hold_ms`` after
        # their first tokens (tool/agent: 182 output tokens each); memoryless ones free any
        # running request's at the same rate, so ``d`` tokens of ``u`` in use take ``d / u``
        # of a hold (Mooncake's outputs vary several-fold)
        spread = self._hold_spread()
        # bounded: a subnormal reported use would make it infinite, and the retry hint an error
        turnover = min(deficit / (used * capacity) * self.hold_ms, MAX_LATENCY_MS)
        if spread >= 1.0:
            return turnover
        flight = self._flight.get(worker.id)
        # the oldest tracked requests run, the newest that many wait; one that ended before a
        # load report said it had started is still counted waiting until the next, hence the floor
        running = max(0, len(flight) - self._waiting_count.get(worker.id, 0)) if flight else 0
        freed = 0
        oldest_first = self.hold_ms  # more than every running request holds: a full turnover at least
        for _, dispatched_at, held, first_at in islice(flight.values(), running) if flight else ():
            freed += held
            if freed >= deficit:
                oldest_first = min(max(0.0, (first_at or dispatched_at) * 1000.0 + self.hold_ms - now * 1000.0),
                                   MAX_LATENCY_MS)
                break
        return spread * turnover + (1.0 - spread) * oldest_first

    def _hold_spread(self) -> float:
        """Squared coefficient of variation of decode times, within [0, 1]."""
        if not self.hold_ms:
            return 1.0
        return min(1.0, max(0.0, self._hold_sq_ms / (self.hold_ms * self.hold_ms) - 1.0))

    def ahead_ms(self, worker: Worker, now: float, tokens: int = 0, queued: tuple[int, int] = (0, 0)) -> float:
        """Model ms before a request of ``tokens`` uncached prompt tokens routed to ``worker``
        now starts: its backlog, or the wait for KV room when that is longer (``kv_wait_ms``,
        in real ms, brought to model ms by ``scale``, which every prediction is multiplied by),
        then ``queued`` (requests, tokens) waiting for it in the router's admission queue."""
        ahead = 0.0
        if worker.inflight_requests:
            # _waits' second part, written out: check calls this for every eligible worker, and
            # the call and its pair cost a check at 1,024 workers ~6%
            self._sync(worker)
            scale = self._corrections(worker)[0]
            ahead = max(self._drained(worker, now, scale), self._kv_wait(worker, now, tokens) / scale)
        if queued[1]:
            ahead += self.latency.ttft_ms(queued[1], 0, queued[0] - 1)
        return ahead

    def _waits(self, worker: Worker, now: float, tokens: int, scale: float) -> tuple[float, float]:
        """``(backlog_ms, the larger of it and kv_wait_ms in model ms)`` of a worker with requests
        in flight, its books synced, at ``scale``: each read once, as every Route asks for both."""
        drained = self._drained(worker, now, scale)
        return drained, max(drained, self._kv_wait(worker, now, tokens) / scale)

    # ---- the online correction ------------------------------------------------------------
    @property
    def scale(self) -> float:
        """Observed / predicted TTFT on an idle worker, a moving geometric mean: what the model
        leaves out (decode steps sharing the GPU, preemption)."""
        return self._levels[0][0]

    @property
    def tail(self) -> float:
        """The ``quantile`` of observed / predicted TTFT on an idle worker."""
        return self._level_value(self._tails, 0)

    def _level_value(self, values: list[float], level: int) -> float:
        for at in range(level, -1, -1):  # an unseen level: the nearest quieter one seen
            if self._samples[at]:
                return values[at]
        return values[level]

    def _level_corrections(self) -> list[tuple[float, float]]:
        return [(self._level_value(self._scales, level), self._level_value(self._tails, level))
                for level in range(_LOAD_LEVELS)]

    def _corrections(self, worker: Worker) -> tuple[float, float]:
        """(scale, tail) for ``worker`` at its reported load."""
        return self._levels[_load_level(worker)]

    def _sync(self, worker: Worker) -> None:
        """Anchor ``worker``'s books to its engine's last load report if one came since."""
        if worker.reported_at > self._anchored.get(worker.id, 0.0):
            self._anchor(worker)

    def _anchor(self, worker: Worker) -> None:
        """Re-anchor ``worker``'s backlog to its engine's last load report.

        Drained at a modelled rate alone, the backlog integrates every error of the model,
        and ``scale`` (which also sets the drain rate) chases them a full decode late: on the
        tool/agent workload past capacity it swung from 0.4 to 10 and back, shedding nearly
        everything, then admitting a flood (a p90 TTFT of 10 s among admitted requests). An
        engine's report says how many requests are still waiting for their first token
        (``queued_requests``; vLLM's ``num_requests_waiting``, first come first served): the
        newest that many of the requests routed there before the report. Their own modelled
        prefill, plus everything routed since, is the backlog as of the report."""
        reported_at, queued = worker.reported_at, worker.reported_queue
        self._anchored[worker.id] = reported_at
        flight = self._flight.get(worker.id)
        if flight is None:
            return
        while len(flight) > worker.inflight_requests:  # the oldest ended unheard (expired in flight)
            self._where.pop(flight.popitem(last=False)[0], None)
        before: list[tuple[float, int]] = []
        after = 0.0
        after_tokens = 0
        for ms, at, tokens, _ in flight.values():
            if at <= reported_at:
                before.append((ms, tokens))
            else:
                after += ms
                after_tokens += tokens
        waiting = before[max(0, len(before) - queued):] if 0 < queued else []
        self._backlog[worker.id] = (sum(ms for ms, _ in waiting) + after, reported_at)
        self._waiting_tokens[worker.id] = sum(tokens for _, tokens in waiting) + after_tokens
        self._waiting_count[worker.id] = len(waiting) + len(flight) - len(before)

    def predict_ms(self, worker: Worker, uncached_tokens: int, cached_tokens: int, now: float,
                   queued: tuple[int, int] = (0, 0)) -> float:
        """TTFT of a request with ``uncached_tokens`` to prefill (after ``cached_tokens`` of
        cached prefix) on ``worker``, behind its backlog and ``queued`` (requests, tokens)
        waiting for it in the router."""
        ahead = self.ahead_ms(worker, now, uncached_tokens, queued)
        return (ahead + self.prefill_ms(uncached_tokens, cached_tokens)) * self._corrections(worker)[0]

    def price_chosen(self, ctx: RoutingContext, chosen: Worker, slo_ms: float,
                     queued: Queued = nothing_queued) -> Pricing | None:
        """Whether the policy's own choice is predicted to meet the SLO (``check``'s rule for
        one worker): what it priced there when it does (for ``on_dispatch`` of the same
        decision), None when it does not. The common case, answered without pricing every
        eligible worker, which at 1,024 workers would cost the decision a millisecond."""
        uncached, cached = ctx.uncached_tokens(chosen), ctx.overlap(chosen) * ctx.block_size
        if queued is nothing_queued and native.module is not None:
            priced = native.module.deadline_price(self, chosen, uncached, cached, ctx.now, slo_ms)
            if priced is not NotImplemented:
                return priced
        return self._price_py(chosen, uncached, cached, ctx.now, slo_ms, queued)

    def admit_chosen(self, ctx: RoutingContext, chosen: Worker, request_id: str, slo_ms: float,
                     queued: Queued = nothing_queued) -> Pricing | None:
        """``price_chosen``, and ``on_admitted`` for a choice that meets the SLO: natively
        ``deadline_admit`` in one call with nothing queued (``_admit_py``, its reference)."""
        if queued is nothing_queued and _deadline_admit is not None:
            priced = _deadline_admit(self, ctx, chosen, request_id, slo_ms, NONE_CLAIMED)
            if priced is not NotImplemented:
                return priced  # type: ignore[no-any-return]
        return self._admit_py(ctx, chosen, request_id, slo_ms, queued)

    def _admit_py(self, ctx: RoutingContext, chosen: Worker, request_id: str, slo_ms: float,
                  queued: Queued = nothing_queued) -> Pricing | None:
        """``admit_chosen``'s reference, of the native ``deadline_admit`` (``index/_native.c``)."""
        priced = self.price_chosen(ctx, chosen, slo_ms, queued)
        if priced is not None:
            self.on_admitted(request_id, slo_ms, ctx.now)
        return priced

    def _price_py(self, chosen: Worker, uncached: int, cached: int, now: float, slo_ms: float,
                  queued: Queued) -> Pricing | None:
        """``price_chosen`` once the prompt's tokens on ``chosen`` are known: the reference of
        the native ``deadline_price`` (``index/_native.c``), which runs it with nothing queued."""
        drained = waited = 0.0
        level = _load_level(chosen)
        if chosen.inflight_requests:  # ahead_ms's, its two parts kept
            self._sync(chosen)
            drained, waited = self._waits(chosen, now, uncached, self._levels[level][0])
        priced = (chosen, now, uncached, cached, drained, waited)
        ahead = waited
        requests, tokens = queued(chosen.id)
        if tokens:
            ahead += self.latency.ttft_ms(tokens, 0, requests - 1)
        if ahead <= 0.0:  # nothing ahead of it: it starts at once, held to its own prefill at worst
            return priced
        own = self.prefill_ms(uncached, cached)
        tail = self._levels[level][1] * self._margin
        # check's rule for one worker: (ahead + own) * scale * tail / scale against the budget
        return priced if (ahead + own) * tail <= max(slo_ms, own * tail) else None

    def check(self, ctx: RoutingContext, chosen_id: str, slo_ms: float, queued: Queued = nothing_queued) -> Verdict:
        """The verdict on routing ``ctx``'s request to ``chosen_id``: side-effect free.

        A request whose prefill alone takes longer than its SLO (on that worker, idle) is held
        to that time instead: it is served where it would start at once, and refused while
        every such worker has work queued. Refusing it for its size would refuse it at any
        load, for ever; letting it queue like the rest spends seconds of GPU on a request
        that misses its SLO whatever happens, ahead of requests that could have met theirs."""
        args = self._verdict_args(ctx, chosen_id, slo_ms, queued)
        priced = NotImplemented if native.module is None else native.module.deadline_verdict(*args)
        if priced is NotImplemented:
            priced = self._verdict_py(*args)
        predicted, best, budget, meets = priced
        return Verdict(slo_ms, predicted, best, budget, tuple(meets))

    def _verdict_args(self, ctx: RoutingContext, chosen_id: str, slo_ms: float, queued: Queued) -> tuple[Any, ...]:
        """``_verdict_py``'s arguments (the native ``deadline_verdict``'s) for ``check``."""
        prompt_tokens = ctx.request.prompt_tokens
        # a worker holding none of the prompt, with nothing speculative, prefills all of it
        own_bare = self.prefill_ms(max(0, prompt_tokens), 0)
        # _kv_wait's inputs; it is 0 until a Complete taught the decode time
        kv = ((self.hold_ms, self._hold_spread(), self.block_size, MAX_LATENCY_MS, self._waiting_tokens,
               self._waiting_count, self._flight) if self.hold_ms else None)
        # most workers share an overlap (none, or the fleet-wide system prompt): their own
        # prefill is priced once per check, memoised by (uncached, cached) tokens in the new dict
        return (ctx.candidates, ctx.match.overlaps, ctx.claimed, prompt_tokens, ctx.block_size, ctx.now, chosen_id,
                slo_ms, self._margin, self._levels, own_bare, {}, self.prefill_ms, self._backlog, self._anchored,
                self._anchor, None if queued is nothing_queued else queued, self.latency.ttft_ms, kv)

    def _verdict_py(self, candidates: Sequence[Worker], overlaps: Mapping[int, int], claimed: Mapping[int, int],
                    prompt_tokens: int, block_size: int, now: float, chosen_id: str, slo_ms: float, margin: float,
                    levels: list[tuple[float, float]], own_bare: float, own_by_tokens: dict[tuple[int, int], float],
                    prefill: Callable[[int, int], float], backlog: dict[str, tuple[float, float]],
                    anchored: dict[str, float], anchor: Callable[[Worker], None], queued: Queued | None,
                    queue_ttft: Callable[[int, int, int], float],
                    kv: KvInputs | None) -> tuple[float, float, float, list[str]]:
        """``check``'s pass over the eligible workers: ``(predicted, best, budget, meets)``, the
        chosen worker's prediction, the least overshoot's prediction and budget, and the ids of
        the workers that meet theirs. The reference of the native ``deadline_verdict``
        (``index/_native.c``), which takes the same arguments and runs wherever the extension
        is built: past capacity every Route's chosen worker misses, so every Route prices every
        eligible worker, and at 1,024 workers this loop was ~1.3 ms of each. ``anchor``,
        ``prefill``, ``queued`` and ``queue_ttft`` are the guard's own (``_anchor``,
        ``prefill_ms``, the admission queues' count, ``latency.ttft_ms``); ``kv``: None until a
        Complete taught the decode time, else ``_kv_wait``'s inputs (read here through it)."""
        predicted = best = math.inf
        budget = slo_ms
        meets: list[str] = []
        top_level = len(levels) - 1
        bare = max(0, prompt_tokens)
        # ``uncached_tokens``, ``ahead_ms`` and the load level are written out in the loop
        # (their calls were 2.8 of the 3.4 us per worker)
        for w in candidates:
            wid, slot = w.id, w.slot
            overlap = overlaps.get(slot, 0)
            if overlap or claimed:
                cached = overlap - claimed.get(slot, 0) if claimed else overlap
                uncached = max(0, prompt_tokens - cached * block_size)
                tokens = (uncached, overlap * block_size)
                own = own_by_tokens.get(tokens)
                if own is None:
                    own = own_by_tokens[tokens] = prefill(*tokens)
            else:
                uncached, own = bare, own_bare
            scale, tail = levels[min(w.reported_running.bit_length(), top_level)]
            ahead = 0.0  # ahead_ms's
            if w.inflight_requests:
                if w.reported_at > anchored.get(wid, 0.0):  # _sync's
                    anchor(w)
                ms, at = backlog.get(wid, (0.0, now))
                ahead = max(0.0, ms - (now - at) * 1000.0 / scale)
                if kv is not None:
                    ahead = max(ahead, self._kv_wait(w, now, uncached) / scale)
            if queued is not None:
                waiting = queued(wid)
                if waiting[1]:
                    ahead += queue_ttft(waiting[1], 0, waiting[0] - 1)
            tail *= margin
            t = (ahead + own) * tail  # the prediction (ahead + own) * scale, at the quantile
            allowed = max(slo_ms, own * tail)
            if wid == chosen_id:
                predicted = (ahead + own) * scale
            if t - allowed < best - budget:
                best, budget = t, allowed
            if t <= allowed:
                meets.append(wid)
        return predicted, best, budget, meets

    def refusal(self, verdict: Verdict) -> SloUnreachable:
        """The error a shed request ends with (counted here)."""
        self.shed += 1
        over = (f"the {verdict.slo_ms:,.0f} ms SLO" if verdict.budget_ms <= verdict.slo_ms else
                f"the {verdict.budget_ms:,.0f} ms its prefill takes on an idle worker (its SLO: {verdict.slo_ms:,.0f} ms)")
        return SloUnreachable(
            f"shed: predicted TTFT {verdict.best_ms:,.0f} ms on the best eligible worker exceeds "
            f"{over}; retry after {verdict.retry_after_ms:,.0f} ms",
            verdict.best_ms, verdict.slo_ms, verdict.retry_after_ms,
        )

    def late_refusal(self, waited_ms: float, slo_ms: float) -> SloUnreachable:
        """The error a request dropped from an admission queue ends with (``defer``; counted)."""
        self.expired += 1
        return SloUnreachable(
            f"dropped from the admission queue after {waited_ms:,.0f} ms: it can no longer meet its "
            f"{slo_ms:,.0f} ms TTFT SLO", math.inf, slo_ms, MIN_RETRY_AFTER_MS,
        )

    def queue_estimator(self, router: Router, now: float) -> tuple[Mapping[str, tuple[int, int]],
                                                                   Callable[[str, int, int, int], float]]:
        """``(load, estimator)`` for ``AdmissionQueues.drop_late``, from this guard's model."""
        backlog = {w.id: self.backlog_ms(w, now) for w in router.workers}
        scales = {w.id: self._corrections(w)[0] for w in router.workers}
        load = {wid: (0, 0) for wid in backlog}

        def estimator(worker_id: str, uncached: int, tokens_ahead: int, requests_ahead: int) -> float:
            return ((backlog.get(worker_id, 0.0) + self.latency.ttft_ms(uncached, tokens_ahead, requests_ahead))
                    * scales.get(worker_id, self.scale))

        return load, estimator

    # ---- what the host tells it ---------------------------------------------------------
    def on_dispatch(self, worker: Worker, request_id: str, uncached_tokens: int, now: float,
                    cached_tokens: int = 0, priced: Pricing | None = None) -> None:
        """A request was committed to ``worker`` (after the router charged it); ``priced``:
        what admission priced there for it in this same step (``price_chosen``), if it did."""
        if native.module is None or native.module.deadline_dispatch(
                self, worker, request_id, uncached_tokens, now, cached_tokens, priced) is NotImplemented:
            self._dispatch_py(worker, request_id, uncached_tokens, now, cached_tokens, priced)

    def _dispatch_py(self, worker: Worker, request_id: str, uncached_tokens: int, now: float, cached_tokens: int,
                     priced: Pricing | None) -> None:
        """``on_dispatch``'s reference, of the native ``deadline_dispatch``."""
        self._sync(worker)  # before counting this request among those waiting
        # the worker's in-flight count already includes it: a first request finds no backlog
        first = worker.inflight_requests <= 1
        own = self.prefill_ms(uncached_tokens, cached_tokens)
        if first:
            predicted = backlog = own
        elif (priced is not None and priced[0] is worker and priced[1] == now and priced[2] == uncached_tokens
              and priced[3] == cached_tokens):  # ahead_ms (nothing queued) and backlog_ms as admission found them
            backlog = priced[4] + own
            predicted = priced[5] + own
        else:  # ahead_ms (nothing queued) plus its own, and backlog_ms plus its own
            backlog, waited = self._waits(worker, now, uncached_tokens, self._corrections(worker)[0])
            predicted = waited + own
            backlog += own
        self._backlog[worker.id] = (backlog, now)
        self._waiting_tokens[worker.id] = (0 if first else self._waiting_tokens.get(worker.id, 0)) + uncached_tokens
        self._waiting_count[worker.id] = (0 if first else self._waiting_count.get(worker.id, 0)) + 1
        if request_id:  # in model ms: what ``scale`` compares the observed TTFT with
            self._predicted[request_id] = (predicted, _load_level(worker))
            if len(self._predicted) > _MAX_TRACKED:
                self._predicted.popitem(last=False)
            flight = self._flight.get(worker.id)
            if flight is None:  # not setdefault: that built an OrderedDict on every dispatch
                flight = self._flight[worker.id] = OrderedDict()
            flight[request_id] = (own, now, uncached_tokens, 0.0)
            self._where[request_id] = worker.id
            if len(self._where) > _MAX_TRACKED:
                self._forget(next(iter(self._where)))

    def on_admitted(self, request_id: str, slo_ms: float, now: float) -> None:
        """``request_id`` was admitted as predicted to meet ``slo_ms``: its outcome will move the margin."""
        if request_id:
            self._judged[request_id] = (slo_ms, now)
            if len(self._judged) > _MAX_TRACKED:
                self._judged.popitem(last=False)

    @property
    def margin(self) -> float:
        """How much longer than predicted a request must still fit its SLO in (>= 1)."""
        return self._margin

    def on_first_token(self, request_id: str, ttft_ms: float, now: float) -> None:
        """``request_id``'s first token is out (a ``prefill_done`` Complete with its TTFT, or
        ext_proc's first response chunk): the corrections learn its TTFT now, a whole decode
        before its Complete would tell them (tool/agent past capacity, 182 output tokens:
        goodput at 1.5x capacity 15.5 -> 18.8 req/s). It stays in flight until its Complete,
        holding its KV, which it frees about ``hold_ms`` from now (``kv_wait_ms``)."""
        self._learn(request_id, ttft_ms, now)
        worker_id = self._where.get(request_id)
        flight = self._flight.get(worker_id) if worker_id is not None else None
        entry = flight.get(request_id) if flight is not None else None
        if entry is not None:
            flight[request_id] = (entry[0], entry[1], entry[2], now)

    def on_complete(self, request_id: str, ttft_ms: float, now: float | None = None, e2e_ms: float = 0.0) -> None:
        """A completion: its observed TTFT corrects the prediction (``_learn``) unless its first
        token already did, its time after the first token moves ``hold_ms``, and it leaves
        the backlog's bookkeeping."""
        if native.module is None or native.module.deadline_complete(self, request_id, ttft_ms, now,
                                                                    e2e_ms) is NotImplemented:
            self._complete_py(request_id, ttft_ms, now, e2e_ms)

    def _complete_py(self, request_id: str, ttft_ms: float, now: float | None, e2e_ms: float) -> None:
        """``on_complete``'s reference, of the native ``deadline_complete``."""
        self._forget(request_id)
        self._learn(request_id, ttft_ms, now)
        if 0 < ttft_ms and ttft_ms + 1.0 <= e2e_ms <= MAX_LATENCY_MS:  # a decode of 1 ms or more:
            held = e2e_ms - ttft_ms  # shorter ones are the clock's noise, and their squares underflow
            if not self.hold_ms:
                self.hold_ms, self._hold_sq_ms = held, held * held
            else:
                self.hold_ms += _HOLD_WEIGHT * (held - self.hold_ms)
                self._hold_sq_ms += _HOLD_WEIGHT * (held * held - self._hold_sq_ms)

    def _learn(self, request_id: str, ttft_ms: float, now: float | None) -> None:
        """An observed TTFT, once per request: corrects ``scale`` and ``tail`` and, for a
        request admitted as meeting its SLO, the margin (up by step * q on a miss, down by
        step * (1 - q) on a hit: it rests where a share 1 - q of those requests miss, and at 1
        while fewer do).

        The margin learns only from TTFTs heard within two SLOs of their request's admission
        (``now``, the host's clock): a Complete reports its TTFT when the last token is out,
        and a request that decoded for 30 s describes queues that are long gone. Learning from
        those (tool/agent past capacity, without first-token reports) raised the margin half a
        minute after the queues had built, and it went on shedding after they had drained."""
        judged = self._judged.pop(request_id, None)
        if (judged is not None and now is not None and 0 < ttft_ms <= MAX_LATENCY_MS
                and (now - judged[1]) * 1000.0 <= 2.0 * judged[0]):
            missed = 1.0 if ttft_ms > judged[0] else 0.0
            self._log_margin = min(max(self._log_margin + _MARGIN_STEP * (missed - (1.0 - self.quantile)), 0.0),
                                   _LOG_SCALE_RANGE)
            self._margin = math.exp(self._log_margin)
        dispatched = self._predicted.pop(request_id, None)
        if dispatched is None:
            return
        predicted, level = dispatched
        if predicted >= _MIN_SAMPLE_MS and 0 < ttft_ms <= MAX_LATENCY_MS:
            scale, tail = self._levels[level]  # as _level_value reads them: _levels is redone below
            self._samples[level] += 1
            # logs taken apart: a subnormal ttft_ms over predicted underflows to 0.0, a domain
            # error (the fuzz swarm's tiny floats found it); and one sample moves the estimates
            # at most as far as the correction may range, so a client reporting absurd TTFTs
            # cannot swing admission for everyone
            log_ratio = min(max(math.log(ttft_ms) - math.log(predicted), -_LOG_SCALE_RANGE), _LOG_SCALE_RANGE)
            log_scale = math.log(scale) + _SCALE_WEIGHT * (log_ratio - math.log(scale))
            self._scales[level] = math.exp(min(max(log_scale, -_LOG_SCALE_RANGE), _LOG_SCALE_RANGE))
            # stochastic approximation of the quantile: up by step * q on a sample above it,
            # down by step * (1 - q) below, so it rests where a share q of samples fall below
            log_tail = math.log(tail)
            log_tail += _TAIL_STEP * (self.quantile - (1.0 if log_ratio <= log_tail else 0.0))
            self._tails[level] = math.exp(min(max(log_tail, -_LOG_SCALE_RANGE), _LOG_SCALE_RANGE))
            self._relevel(level)

    def _relevel(self, level: int) -> None:
        """``_levels`` after ``level``, which has samples now, learned one: ``_level_corrections``
        for the levels that read it (itself and the unsampled ones above it, up to the next
        sampled level), a new list as that builds. Rebuilding all eight pairs was 3.4 of the
        5 us a learning Complete cost the loop."""
        levels = self._levels.copy()
        corrected = (self._scales[level], self._tails[level])
        samples = self._samples
        for at in range(level, _LOAD_LEVELS):
            if at > level and samples[at]:
                break
            levels[at] = corrected
        self._levels = levels

    def _forget(self, request_id: str) -> None:
        worker_id = self._where.pop(request_id, None)
        flight = self._flight.get(worker_id) if worker_id is not None else None
        if flight is not None:
            flight.pop(request_id, None)

    def on_expired(self, request_id: str) -> None:
        """``request_id`` was released unheard (no Complete within ``inflight_timeout_s``): it
        leaves the books without teaching the corrections or the margin anything. Unheard, it
        stayed in its worker's flight until a load report trimmed it (never, without reports)
        and its prediction until 200,000 newer ones pushed it out; and a request reusing its
        id on another worker left it there for good."""
        self._forget(request_id)
        self._predicted.pop(request_id, None)
        self._judged.pop(request_id, None)

    def forget_worker(self, worker_id: str) -> None:
        self._backlog.pop(worker_id, None)
        self._waiting_tokens.pop(worker_id, None)
        self._waiting_count.pop(worker_id, None)
        self._anchored.pop(worker_id, None)
        for request_id in self._flight.pop(worker_id, {}):
            self._where.pop(request_id, None)

    def counters(self) -> dict[str, int]:
        return {"deadline_shed": self.shed, "deadline_rerouted": self.rerouted, "deadline_expired": self.expired,
                "deadline_spared": self.spared}


def admit_priced(guard: DeadlineGuard, router: Router, req: RouteRequest,
                 decided: tuple[Decision, RoutingContext, RoutingPolicy], slo_ms: float,
                 queued: Queued = nothing_queued,
                 refuse: bool = True) -> tuple[tuple[Decision, RoutingContext, RoutingPolicy], Pricing | None]:
    """The decision to commit for ``req`` under deadline admission, as both hosts run it, and
    what admission priced on its worker when it admitted the policy's own choice
    (``on_dispatch`` takes it when the decision commits in the same step; None otherwise).

    ``decided`` is ``router.decide(req)``'s answer. Returns it if its worker meets the SLO,
    else the policy's decision among the workers that do (decided with
    ``req.candidate_workers`` narrowed to them, then given back what the client sent: the
    in-flight table keeps and charges a request's candidates, and at 1,024 workers the
    ~1,000 names meeting the SLO charged ~100 kB per rerouted request, so past capacity
    ``limits.max_inflight_bytes`` filled with names after ~2,500 of them); when none does,
    raises ``SloUnreachable``, or with ``refuse`` false
    (a request that declared no SLO of its own) returns ``decided``: such a request is
    steered by the default SLO but never refused by it. Changes no router state, but for the
    id an unnamed request takes here rather than at commit: its outcome is judged by that id
    (``on_admitted``), and a request the client did not name (the SDK's default, ext_proc
    without ``x-request-id``) otherwise never taught the margin anything."""
    if not req.request_id:
        req.request_id = router.new_request_id()
    decision, ctx, _ = decided
    chosen = router.workers.find(decision.worker_id)
    if chosen is not None:
        priced = guard.admit_chosen(ctx, chosen, req.request_id, slo_ms, queued)
        if priced is not None:
            return decided, priced
    verdict = guard.check(ctx, decision.worker_id, slo_ms, queued)
    if verdict.shed:
        if not refuse:
            guard.spared += 1
            return decided, None
        raise guard.refusal(verdict)
    guard.on_admitted(req.request_id, slo_ms, ctx.now)
    if decision.worker_id in verdict.meets:
        return decided, None
    guard.rerouted += 1
    sent = req.candidate_workers
    req.candidate_workers = verdict.meets
    try:
        # the request was checked as its client sent it; the names are the router's own, and
        # never kept: checked again, 896 of them cost ~60 us and their bytes could refuse it
        return router.decide(req, ctx.explain, validated=True), None
    finally:
        req.candidate_workers = sent
