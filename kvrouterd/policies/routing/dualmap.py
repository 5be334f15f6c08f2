"""``dualmap``: two hash-chosen candidates per prefix, SLO-aware choice between them.

Follows DualMap (Yuan et al., ``papers/dualmap-cache-affinity-load-balancing.txt``):

- **Candidate pair** (sections 3.2, 3.4, A.1.3): the request's hash key goes through two
  independent hash functions onto a dual consistent-hash ring (``hash_ring``), giving two
  distinct workers (Eq. 5 when both coincide). The pair depends only on the key and the
  worker ids, so router replicas with the same workers agree without sharing state. (The
  key's length for a *hot* prefix comes from each replica's own traffic window; replicas
  behind a balanced load balancer see the same shares, but nothing forces them to agree.)
- **Adaptive hash-key length** (section 3.2, A.1.1): the key is the prompt's first
  ``base_segments`` segments of ``segment_tokens`` tokens (the paper's 2 x 512); a prefix
  whose sliding-window traffic share exceeds 2/n gets one more segment, and loses it when
  its share falls below 1/n (``prefix_hotness``). Segments are counted in the router's
  blocks: ``segment_tokens / block_size`` blocks per segment (at least 1).
- **SLO-aware selection** (section 3.2, A.1.1): prefer the candidate with more cached reuse
  (``rule=cache_affinity``); when that one is overloaded, switch (``rule=slo_switch``) to the
  candidate with the lower estimated TTFT, queueing plus its own uncached prefill
  (``switch_to=min_ttft``: the paper's appendix says DualMap "chooses between its two
  candidates using a TTFT estimation function that jointly considers the cache-reuse benefit
  and queuing delay", A.6, and "only requires an estimated TTFT for each candidate", A.5), or
  to the one with fewer pending tokens (``switch_to=less_loaded``, section 3.2's summary "selects
  the less loaded instance", which ignores that the other candidate may hold none of the
  prompt: on the Mooncake trace at 19 req/s it sent conversations to the candidate without
  their history, hit ratio 29% -> 20%, SLO 95.5% -> 54.5%); with equal reuse, take the less
  loaded (``rule=equal_reuse``). Load
  is pending prefill tokens, as the latency model estimates them (``pending_model``). "Overloaded" is, with ``slo_test=static_threshold`` (the
  paper's implementation), pending tokens plus the request's uncached tokens above the
  *ttft_slo_threshold*: the tokens a worker prefills within the request's TTFT SLO under
  the configured (uncalibrated) latency model, or ``slo_threshold_tokens`` when set; with
  ``slo_test=latency_model`` (beyond the paper), the calibrated TTFT estimate above the SLO.
- **Load and threshold from the profiled GPU** (3.2): both the ttft_slo_threshold and the
  drain rate of the pending-token estimate come from the configured prefill model
  (``prefill_ms_per_1k_tokens``), as the paper computes them from a profiled GPU; online
  calibration (``calibrate: true``, shared with min_ttft) is opt-in. Measured in ``sim
  cluster`` on the Mooncake trace capped at 20,480 tokens (8 workers, 28 req/s): the online
  fit, fed TTFTs of fully cached requests stuck behind long queues, diverged to 5.4e6 ms per
  1k tokens, so every worker looked overloaded; at the moment of each SLO switch the
  estimated pending load of the preferred worker was 2.8x its true queue (316k vs 114k
  tokens), the switches threw away cached history and SLO attainment fell to 66%
  (``calibrate: false``: 100%).
- **Decode bottleneck** (A.7): a worker with a non-empty queue that has completed no
  prefill for ``decode_bottleneck_s`` is overloaded, and its TTFT estimates include the
  observed interval. The queue is the admission queue (``queued_ttft_ms``; at selection,
  ``Worker.queued_requests``) or the engine's reported waiting requests (``ReportLoad``);
  without either the
  rule cannot tell waiting from decoding requests and stays quiet. Prefill completions are
  learned from ``Complete`` (its TTFT dates the first token), so they are seen late: a
  worker with a real queue and only long decodes in flight can be flagged early.
- **Hotspot rebalancing** (3.3, A.1.2) needs waiting requests; it lives in
  ``kvrouterd.admission``. A decision whose two candidates are both overloaded says so
  (``both_overloaded=1``) so the host can run a migration round, and
  ``queued_ttft_ms`` gives the admission queue the A.7-corrected estimates. A worker's load
  includes the prefill tokens of requests waiting for it in that queue
  (``Worker.queued_prefill_tokens``): there they are its pending work, as in the engine.

Parameters (defaults from the paper unless noted; latency-model ones in ``policies.latency``):

- ``segment_tokens`` = 512, ``base_segments`` = 2: the base hash key.
- ``max_key_segments`` = 64: cap on key growth (not in the paper; bounds the tree).
- ``virtual_nodes`` = 128: ring points per worker (the paper uses one anchor; more points
  even out arc lengths without changing the 1/n remapping).
- ``hotness_window_s`` = 60, ``hotness_buckets`` = 12, ``hotness_min_requests`` = 50: the
  sliding window (the paper gives no sizes).
- ``default_ttft_slo_ms`` = 5000: SLO for requests without one (the paper's 5 s).
- ``slo_test`` = "static_threshold"; ``slo_threshold_tokens`` = 0 (derive from the model).
- ``decode_bottleneck_s`` = 3.0: A.7's T (0 disables).
- ``switch_to`` = "min_ttft": the SLO switch's target (above).

``counters()`` counts, over dispatched decisions, those with a candidate flagged by A.7
(``decode_bottleneck_decisions``) and those the flag sent to another worker than the rule
would have chosen without it (``decode_bottleneck_moves``); the daemon exports them as
``kvrouter.policy.rule_fired``, ``sim reproduce`` per run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ...bounds import MAX_LATENCY_MS
from ...index.workers import Worker
from ...protocols import Completion, Decision, RouteRequest
from ..base import RoutingContext, RoutingPolicyBase
from ..latency import LatencyModel, LatencyParams
from .hash_ring import DualHashRing
from .prefix_hotness import PrefixHotness, key_path

__all__ = ["DualMapParams", "DualMapPolicy"]


@dataclass(frozen=True)
class DualMapParams(LatencyParams):
    # the paper profiles the GPU once (3.2); online calibration is opt-in (see the docstring)
    calibrate: bool = field(default=False, metadata={"help": "fit the prefill model online from observed TTFT"})
    segment_tokens: int = field(default=512, metadata={"help": "tokens per hash-key segment"})
    base_segments: int = field(default=2, metadata={"help": "segments in a cold prefix's hash key"})
    max_key_segments: int = field(default=64, metadata={"help": "longest hash key, in segments"})
    virtual_nodes: int = field(default=128, metadata={"help": "points per worker on each hash ring"})
    hotness_window_s: float = field(default=60.0, metadata={"help": "sliding window for prefix traffic shares, s"})
    hotness_buckets: int = field(default=12, metadata={"help": "buckets the hotness window is split into"})
    hotness_min_requests: int = field(default=50, metadata={"help": "requests in the window before hotness is judged"})
    default_ttft_slo_ms: float = field(default=5000.0, metadata={"help": "TTFT SLO for requests that carry none, ms"})
    slo_test: Literal["static_threshold", "latency_model"] = field(
        default="static_threshold",
        metadata={"help": "overload test: token threshold from the static model, or the calibrated TTFT estimate"},
    )
    slo_threshold_tokens: int = field(
        default=0, metadata={"help": "pending-token threshold for static_threshold (0 = derive from the SLO)"}
    )
    decode_bottleneck_s: float = field(
        default=3.0, metadata={"help": "no prefill completed for this long with work queued = overloaded (0 = off)"}
    )
    switch_to: Literal["min_ttft", "less_loaded"] = field(
        default="min_ttft",
        metadata={"help": "SLO switch target: the candidate with the lower estimated TTFT, its cache hit included "
                          "(A.5, A.6), or the one with fewer pending tokens (3.2's summary)"},
    )

    def validate(self) -> None:
        super().validate()
        for name in ("segment_tokens", "base_segments", "max_key_segments", "virtual_nodes",
                     "hotness_buckets", "hotness_min_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_key_segments < self.base_segments:
            raise ValueError(f"max_key_segments must be >= base_segments, got {self.max_key_segments}")
        if self.hotness_window_s <= 0:
            raise ValueError(f"hotness_window_s must be > 0, got {self.hotness_window_s}")
        if self.default_ttft_slo_ms <= 0:
            raise ValueError(f"default_ttft_slo_ms must be > 0, got {self.default_ttft_slo_ms}")
        if self.slo_threshold_tokens < 0:
            raise ValueError(f"slo_threshold_tokens must be >= 0, got {self.slo_threshold_tokens}")
        if self.decode_bottleneck_s < 0:
            raise ValueError(f"decode_bottleneck_s must be >= 0, got {self.decode_bottleneck_s}")


@dataclass(slots=True)
class _View:
    """One candidate as DualMap judges it."""

    worker: Worker
    reuse: int
    load: int
    uncached: int
    ttft_ms: float
    bottleneck_ms: float
    #: over the SLO threshold by load alone (section 3.2)
    over_load: bool
    #: over_load, or decode-bottlenecked (A.7)
    overloaded: bool


class DualMapPolicy(RoutingPolicyBase):
    params: DualMapParams

    def __init__(self, params: DualMapParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self.ring = DualHashRing(params.virtual_nodes)
        self.hotness = PrefixHotness(params.hotness_window_s, params.hotness_buckets, params.hotness_min_requests)
        self.latency = LatencyModel(params)
        self._static = LatencyModel(replace(params, calibrate=False))
        self._last_prefill: dict[str, float] = {}
        self._busy_since: dict[str, float] = {}
        #: dispatched decisions with a candidate flagged decode-bottlenecked (A.7), and those
        #: the flag sent to another worker than the rule without it would have
        self._a7 = {"decode_bottleneck_decisions": 0, "decode_bottleneck_moves": 0}

    # ---- pure helpers -------------------------------------------------------------------
    def segment_blocks(self, block_size: int) -> int:
        return max(1, round(self.params.segment_tokens / block_size))

    def key_path(self, keys: Sequence[int], block_size: int) -> list[tuple[int, int]]:
        seg = self.segment_blocks(block_size)
        p = self.params
        return key_path(keys, p.base_segments * seg, seg, self.hotness.extended, p.max_key_segments * seg)

    def candidate_pair(self, request: RouteRequest, block_size: int, allowed: set[str] | None = None) -> tuple[str, str | None]:
        """The two candidates of ``request`` among ``allowed`` (all ring members if None)."""
        path = self.key_path(request.keys, block_size)
        if not path:
            raise LookupError("the prompt has no full block to hash")
        return self.ring.pair(path[-1][1], allowed.__contains__ if allowed is not None else None)

    def slo_ms(self, request: RouteRequest | None) -> float:
        return request.ttft_slo_ms if request is not None and request.ttft_slo_ms > 0 else self.params.default_ttft_slo_ms

    def threshold_tokens(self, slo_ms: float) -> int:
        """DualMap's ttft_slo_threshold: pending prefill tokens a worker clears within the SLO."""
        return self.params.slo_threshold_tokens or self._static.tokens_within(slo_ms)

    def bottleneck_ms(self, worker: Worker, now: float, queued: bool | None = None) -> float:
        """A.7: the prefill interval of a decode-bottlenecked worker, else 0.

        The rule needs a non-empty queue of requests waiting for prefill: ``queued`` when the
        caller knows (the admission queue), else the engine's reported queue (ReportLoad).
        In-flight requests alone do not count: most of them are decoding, and ``Complete``
        reports their prefill only when they finish.
        """
        limit = self.params.decode_bottleneck_s
        waiting = (worker.reported_queue > 0 or worker.queued_requests > 0) if queued is None else queued
        if limit <= 0 or not waiting or worker.inflight_requests <= 0:
            return 0.0
        # the clock starts when the worker last went busy or last finished a prefill
        since = max(self._last_prefill.get(worker.id, float("-inf")), self._busy_since.get(worker.id, now))
        interval = now - since
        return interval * 1000.0 if interval > limit else 0.0

    def queued_ttft_ms(self, worker: Worker, uncached_tokens: int, tokens_ahead: int, requests_ahead: int, now: float) -> float:
        """TTFT of a request waiting behind ``tokens_ahead`` prefill tokens on ``worker``
        (A.7-corrected: the request itself makes the queue non-empty)."""
        return self.latency.ttft_ms(uncached_tokens, tokens_ahead, requests_ahead) + self.bottleneck_ms(worker, now, True)

    def _view(self, ctx: RoutingContext, w: Worker, slo: float, threshold: int) -> _View:
        uncached = ctx.uncached_tokens(w)
        # requests waiting for w in the router's admission queue are its pending work as much
        # as those waiting inside the engine (3.2); 0 without admission queue mode
        load = self.latency.pending_tokens(w, ctx.now) + w.queued_prefill_tokens
        stall = self.bottleneck_ms(w, ctx.now)
        ttft = self.latency.ttft_ms(uncached, load, w.inflight_requests + w.queued_requests) + stall
        if self.params.slo_test == "static_threshold":
            over = load + uncached > threshold
        else:
            over = ttft > slo
        return _View(w, ctx.overlap(w), load, uncached, ttft, stall, over, over or stall > 0)

    # ---- selection ----------------------------------------------------------------------
    def _pair(self, ctx: RoutingContext, by_id: dict[str, Worker],
              path: list[tuple[int, int]]) -> tuple[str, str | None] | None:
        if len(by_id) > 1 and path:
            try:
                return self.ring.pair(path[-1][1], by_id.__contains__)
            except LookupError:
                return None
        return None

    def candidate_ids(self, ctx: RoutingContext) -> list[str]:
        """The workers DualMap would choose between for ``ctx`` (its pair; every candidate
        when it has no pair), for a policy that scores them instead (``compose``)."""
        by_id = {w.id: w for w in ctx.candidates}
        pair = self._pair(ctx, by_id, self.key_path(ctx.request.keys, ctx.block_size))
        if pair is None:
            return list(by_id)
        return [wid for wid in pair if wid is not None]

    def select(self, ctx: RoutingContext) -> Decision:
        slo = self.slo_ms(ctx.request)
        threshold = self.threshold_tokens(slo)
        by_id = {w.id: w for w in ctx.candidates}
        path = self.key_path(ctx.request.keys, ctx.block_size)
        pair = self._pair(ctx, by_id, path)
        if pair is None:
            # one worker, no full block to hash, or the candidates are not on the ring yet
            views = [self._view(ctx, w, slo, threshold) for w in ctx.candidates]
            chosen = min(views, key=lambda v: (v.overloaded, v.load, v.worker.slot))
            rule = "single_candidate" if len(by_id) == 1 else ("no_prefix" if not path else "not_on_ring")
            return self._decision(ctx, chosen, None, rule, views, path, slo, threshold)
        first = self._view(ctx, by_id[pair[0]], slo, threshold)
        second = self._view(ctx, by_id[pair[1]], slo, threshold) if pair[1] is not None else None
        if second is None:
            return self._decision(ctx, first, None, "single_candidate", [first], path, slo, threshold)
        chosen, rule = self._choose(first, second, stalls=True)
        # A.7's effect: what the rule would have chosen with no worker flagged
        flagged = int(first.bottleneck_ms > 0) + int(second.bottleneck_ms > 0)
        moved = int(flagged > 0 and self._choose(first, second, stalls=False)[0] is not chosen)
        other = second if chosen is first else first
        return self._decision(ctx, chosen, other, rule, [first, second], path, slo, threshold,
                              decode_bottlenecked=flagged, decode_bottleneck_moved=moved)

    def _choose(self, first: _View, second: _View, stalls: bool) -> tuple[_View, str]:
        """Section 3.2's choice between the pair; ``stalls=False`` ignores A.7's flags."""
        def stalled(v: _View) -> bool:
            return stalls and v.bottleneck_ms > 0

        def over(v: _View) -> bool:
            return v.over_load or stalled(v)

        def ttft(v: _View) -> float:
            return v.ttft_ms if stalls else v.ttft_ms - v.bottleneck_ms

        lighter = min((first, second), key=lambda v: (stalled(v), v.load, v is second))
        if first.reuse == second.reuse:
            return lighter, "equal_reuse"
        preferred = first if first.reuse > second.reuse else second
        if not over(preferred):
            return preferred, "cache_affinity"
        if self.params.switch_to == "min_ttft":
            return min((first, second), key=lambda v: (ttft(v), v is second)), "slo_switch"
        return lighter, "slo_switch"

    def _decision(self, ctx: RoutingContext, chosen: _View, other: _View | None, rule: str, views: list[_View],
                  path: list[tuple[int, int]], slo: float, threshold: int, decode_bottlenecked: int = 0,
                  decode_bottleneck_moved: int = 0) -> Decision:
        scored = [
            ctx.candidate(
                v.worker, score=-v.ttft_ms, candidate=float(i + 1), reuse_blocks=float(v.reuse),
                load_tokens=float(v.load), uncached_tokens=float(v.uncached), est_ttft_ms=round(v.ttft_ms, 3),
                overloaded=float(v.overloaded), bottleneck_ms=round(v.bottleneck_ms, 3),
            )
            for i, v in enumerate(views)
        ]
        attrs: dict[str, float | int | str] = {
            "rule": rule, "slo_ms": slo, "threshold_tokens": threshold,
            "key_blocks": path[-1][0] if path else 0, "key_extended": int(len(path) > 1),
            "both_overloaded": int(other is not None and chosen.overloaded and other.overloaded),
            "decode_bottlenecked": decode_bottlenecked, "decode_bottleneck_moved": decode_bottleneck_moved,
        }
        for i, v in enumerate(views[:2] if other is not None else [chosen]):
            attrs[f"candidate_{i + 1}"] = v.worker.id
            attrs[f"reuse_{i + 1}"] = v.reuse
            attrs[f"load_{i + 1}"] = v.load
            attrs[f"ttft_{i + 1}_ms"] = round(v.ttft_ms, 3)
        decision = self.decide(ctx, chosen.worker, rule, scored, **attrs)
        decision.estimated_ttft_ms = chosen.ttft_ms
        if other is not None:
            decision.alternative_worker_id = other.worker.id
        return decision

    # ---- hooks --------------------------------------------------------------------------
    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        worker = next((w for w in ctx.candidates if w.id == decision.worker_id), None)
        if worker is None:
            return
        if worker.inflight_requests <= 1:  # the host committed this one: the worker was idle
            self._busy_since[worker.id] = ctx.now
        if decision.attributes.get("decode_bottlenecked"):
            self._a7["decode_bottleneck_decisions"] += 1
            self._a7["decode_bottleneck_moves"] += int(decision.attributes.get("decode_bottleneck_moved", 0))
        self.latency.on_dispatch(worker, ctx.request.request_id, ctx.uncached_tokens(worker), ctx.now)
        path = self.key_path(ctx.request.keys, ctx.block_size)
        if path:
            limit = min(len(ctx.request.keys), self.params.max_key_segments * self.segment_blocks(ctx.block_size))
            self.hotness.record(path, ctx.now, max(len(self.ring), 1), can_extend=path[-1][0] < limit)

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        self.latency.observe_completion(completion.request_id, completion.ttft_ms)
        if worker is None:
            return
        # the first token came e2e - ttft before the completion; it dates the prefill (a
        # duration no request takes, or no number at all, dates it at the completion)
        e2e, ttft = completion.e2e_ms, completion.ttft_ms
        decode_s = max(0.0, e2e - ttft) / 1000.0 if 0 < e2e <= MAX_LATENCY_MS and 0 <= ttft <= e2e else 0.0
        first_token = now - decode_s
        if first_token > self._last_prefill.get(worker.id, float("-inf")):
            self._last_prefill[worker.id] = first_token

    def counters(self) -> dict[str, int]:
        return dict(self._a7)

    def on_worker_added(self, worker: Worker) -> None:
        self.ring.add(worker.id)

    def on_worker_removed(self, worker: Worker) -> None:
        self.ring.remove(worker.id)
        self.latency.forget_worker(worker.id)
        self._last_prefill.pop(worker.id, None)
        self._busy_since.pop(worker.id, None)

    def tick(self, now: float) -> None:
        self.hotness.cool(now, max(len(self.ring), 1))
