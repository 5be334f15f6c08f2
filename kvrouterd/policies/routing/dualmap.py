"""``dualmap``: two hash-chosen candidates per prefix, SLO-aware choice between them.

Follows DualMap (Yuan et al., ``papers/dualmap-cache-affinity-load-balancing.txt``), with
departures measured on issue #27, each a parameter (``dualmap_paper`` is the paper's rule
throughout):

- **Candidate pair** (sections 3.2, 3.4, A.1.3): the request's hash key goes through two
  independent hash functions onto a dual consistent-hash ring (``hash_ring``), giving two
  distinct workers (Eq. 5 when both coincide). The pair depends only on the key and the
  worker ids, so router replicas with the same workers agree without sharing state.
- **Adaptive hash-key length** (section 3.2, A.1.1): the key is the prompt's first
  ``base_segments`` segments of ``segment_tokens`` tokens (the paper's 2 x 512); a prefix
  whose sliding-window traffic share exceeds 2/n gets one more segment, and loses it when
  its share falls below 1/n (``prefix_hotness``). Segments are counted in the router's
  blocks: ``segment_tokens / block_size`` blocks per segment (at least 1).
- **Cold prompts** (beyond the paper, ``cold_placement=fleet``): a prompt no eligible worker
  holds any block of goes to the worker with the lowest estimated TTFT in the whole fleet
  (not overloaded first), as the baselines place it (tool/agent: capacity 24 -> 26+ req/s;
  Mooncake, where few prompts are cold: unchanged at 7.5), instead of the lighter of its pair
  (``cold_placement=pair``, the paper). The choice is remembered (``placement_memory``:
  prefix key -> worker, longest prefix within the base key, ``placement_memory_entries``,
  ``placement_memory_ttl_s`` after last use, dropped when the worker leaves), and a later
  request with that prefix takes the remembered worker and the first of its hash pair as
  its two candidates, the remembered one preferred when their reuse ties (in events mode
  the cache is invisible until the engine's Stored). A hot (extended) key is never pinned:
  its pair spreads it. Without the memory, follow-ups looked in the pair and found nothing
  (17.5% hits on the issue's held-out trace). The memory is each replica's own.
- **SLO-aware selection** (section 3.2, A.1.1): prefer the candidate with more cached reuse
  (``rule=cache_affinity``); with equal reuse, the less loaded (``rule=equal_reuse``). When
  the preferred one is overloaded, ``slo_switch=paper`` switches (``rule=slo_switch``) to the
  candidate with the lower estimated TTFT, queueing plus its own uncached prefill
  (``switch_to=min_ttft``, A.5, A.6) or to the one with fewer pending tokens
  (``switch_to=less_loaded``, 3.2's summary, which ignores that the other may hold none of
  the prompt). Near saturation both candidates are over the SLO and each switch turns a hit
  into a full recompute, adding the load that triggers the next switch (issue #27: switched
  requests met the SLO 17.5% of the time at +10% past capacity). ``slo_switch=guarded``
  (opt-in) switches only to a candidate that is predicted to meet the SLO with
  ``switch_headroom`` to spare and whose TTFT saving exceeds the extra prefill the switch
  costs the fleet, divided by 1 + the requests with the same hash key in the hotness
  window (the recompute puts the prefix on both candidates, and a prefix many requests
  share then splits between them: on the tool/agent workload, charging it in full to one
  request held hot tool prompts on one worker and cut capacity from 24 to 20-22 req/s);
  otherwise it stays (``rule=slo_hold``). It is not the default: on the tool/agent workload
  (DualMap's Table 1 shape) it cut capacity from 24 to 22 req/s, with fleet placement from
  26+ to 20. There both candidates of a warm tool prompt are often over the threshold, and
  the paper's switch, recomputing the prompt once on the other, lets the pair share it. The two thresholds (leave above
  the SLO budget, arrive only below ``1 - switch_headroom`` of it) are a hysteresis band: a
  switch cannot push its target to the edge where it would start switching in turn. On the
  Mooncake trace (8 workers, 30% cache, ``sim cluster``) the guard alone raised capacity
  from 7.5 to 8.0 req/s and attainment at 10 req/s from 40% to 67%; the band's width (0 or
  0.2) moved no rate by more than 1.5 points there.
  Load is pending prefill tokens as the latency model estimates them (``pending_model``).
  "Overloaded" is, with ``slo_test=static_threshold`` (the paper's implementation), pending
  tokens plus the request's uncached tokens above the *ttft_slo_threshold*: the tokens a
  worker prefills within the SLO under the configured (uncalibrated) model, or
  ``slo_threshold_tokens`` when set; with ``slo_test=latency_model``, the TTFT estimate
  above the SLO. The guard's "meets the SLO" uses the same test.
- **Load and threshold from the profiled GPU** (3.2): the ttft_slo_threshold and the drain
  rate of the pending-token estimate come from the configured prefill model; online
  calibration (``calibrate: true``) is opt-in: in ``sim cluster`` on Mooncake the online fit,
  fed TTFTs of cached requests stuck behind long queues, diverged (5.4e6 ms per 1k tokens)
  and SLO attainment fell to 66% (fixed model: 100%).
- **Decode bottleneck** (A.7, ``decode_bottleneck``): a worker with requests waiting for
  prefill that has completed none for ``decode_bottleneck_s`` is overloaded, and its TTFT
  estimates include the interval. It also fires on a worker prefilling one very long prompt
  (issue #27: 213 such moves at 90% load). ``decode_bottleneck_gate=guarded`` ignores those:
  it also requires reported KV use >= ``decode_bottleneck_kv`` from a worker that reports
  load, and an interval beyond T plus the modelled prefill of its longest prompt in flight.
  It is not the default: on the Mooncake trace (8 workers, ``sim cluster``) it cut flagged
  decisions by two thirds and capacity from 7.5 to 6.0 req/s. The "false" moves are right
  for another reason: the queue behind a long prefill waits for it (first come, first
  served), and the pending-token load prices that prompt's attention over its earlier
  chunks at nothing, so only the stall shows the wait.
- **Hotspot rebalancing** (3.3, A.1.2) needs waiting requests; it lives in
  ``kvrouterd.admission``. A decision whose two candidates are both overloaded says so
  (``both_overloaded=1``) so the host can run a migration round; ``queued_ttft_ms`` gives
  the admission queue the A.7-corrected estimates. A worker's load includes the prefill
  tokens waiting for it in that queue (``Worker.queued_prefill_tokens``).

Parameters (defaults from the paper unless noted; latency-model ones in ``policies.latency``):

- ``segment_tokens`` = 512, ``base_segments`` = 2: the base hash key.
- ``max_key_segments`` = 64: cap on key growth (not in the paper; bounds the tree).
- ``virtual_nodes`` = 128: ring points per worker (the paper uses one anchor; more points
  even out arc lengths without changing the 1/n remapping).
- ``hotness_window_s`` = 60, ``hotness_buckets`` = 12, ``hotness_min_requests`` = 50: the
  sliding window (the paper gives no sizes).
- ``default_ttft_slo_ms`` = 5000: SLO for requests without one (the paper's 5 s).
- ``slo_test`` = "static_threshold"; ``slo_threshold_tokens`` = 0 (derive from the model).
- ``switch_to`` = "min_ttft": the paper switch's target (above).
- ``slo_switch`` = "paper" (see above); ``switch_headroom`` = 0.2 (guarded only): the band
  below the SLO a switch target must be in.
- ``cold_placement`` = "fleet" (paper: "pair"); ``placement_memory_entries`` = 65536,
  ``placement_memory_ttl_s`` = 600.
- ``decode_bottleneck_s`` = 3.0: A.7's T (0 disables); ``decode_bottleneck_gate`` =
  "paper" (see above); ``decode_bottleneck_kv`` = 0.95 (guarded only).

``counters()`` counts, over dispatched decisions, those with a candidate flagged by A.7
(``decode_bottleneck_decisions``), those the flag sent to another worker than the rule
would have chosen without it (``decode_bottleneck_moves``), SLO switches and holds
(``slo_switches``, ``slo_holds``) and fleet-wide cold placements (``cold_placements``,
``remembered_placements``); the daemon exports them as ``kvrouter.policy.rule_fired``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from heapq import nsmallest

from ...bounds import MAX_LATENCY_MS
from ...index import native
from ...index.workers import Worker
from ...protocols import Completion, Decision, RouteRequest
from ..base import RoutingContext, RoutingPolicyBase
from ..latency import LatencyModel
from .decode_bottleneck import DecodeBottleneck
from .dualmap_params import DualMapPaperParams, DualMapParams
from .hash_ring import DualHashRing
from .placement_memory import PlacementMemory
from .prefix_hotness import PrefixHotness, key_path

__all__ = ["DualMapPaperParams", "DualMapPaperPolicy", "DualMapParams", "DualMapPolicy"]


@dataclass(slots=True)
class _View:
    """One candidate as DualMap judges it."""

    worker: Worker
    reuse: int
    load: int
    uncached: int
    ttft_ms: float
    #: the request's own prefill here (T_c), ms
    own_ms: float
    bottleneck_ms: float
    #: over the SLO threshold by load alone (section 3.2)
    over_load: bool
    #: overloaded, or decode-bottlenecked (A.7)
    overloaded: bool
    #: within (1 - switch_headroom) of the SLO by load alone: a guarded switch may come here
    roomy: bool


def _cold_order(view: _View) -> tuple[bool, float, int, int]:
    """A fleet-wide (cold) placement's preference: not overloaded, then the lowest TTFT, the
    least load, the lowest slot."""
    return view.overloaded, view.ttft_ms, view.load, view.worker.slot


class DualMapPolicy(RoutingPolicyBase):
    params: DualMapParams

    def __init__(self, params: DualMapParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self.ring = DualHashRing(params.virtual_nodes)
        self.hotness = PrefixHotness(params.hotness_window_s, params.hotness_buckets, params.hotness_min_requests)
        self.latency = LatencyModel(params)
        self._static = LatencyModel(replace(params, calibrate=False))
        self.memory = PlacementMemory(params.placement_memory_entries, params.placement_memory_ttl_s)
        self.a7 = DecodeBottleneck(params.decode_bottleneck_s, params.decode_bottleneck_gate,
                                   params.decode_bottleneck_kv, lambda u, c: self._static.ttft_ms(u, 0, 0, c))
        self._counts = {"decode_bottleneck_decisions": 0, "decode_bottleneck_moves": 0, "slo_switches": 0,
                        "slo_holds": 0, "cold_placements": 0, "remembered_placements": 0}
        #: the last candidate list seen and its workers by id (``_by_id``)
        self._ids: tuple[Sequence[Worker], dict[str, Worker]] = ((), {})

    # ---- pure helpers -------------------------------------------------------------------
    def segment_blocks(self, block_size: int) -> int:
        return max(1, round(self.params.segment_tokens / block_size))

    def key_path(self, keys: Sequence[int], block_size: int) -> list[tuple[int, int]]:
        seg = self.segment_blocks(block_size)
        p = self.params
        return key_path(keys, p.base_segments * seg, seg, self.hotness.extended, p.max_key_segments * seg)

    def candidate_pair(self, request: RouteRequest, block_size: int, allowed: set[str] | None = None) -> tuple[str, str | None]:
        """The two hashed candidates of ``request`` among ``allowed`` (all ring members if None)."""
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
        """A.7: the prefill interval of a decode-bottlenecked worker, else 0 (``decode_bottleneck``)."""
        return self.a7.stall_ms(worker, now, queued)

    def queued_ttft_ms(self, worker: Worker, uncached_tokens: int, tokens_ahead: int, requests_ahead: int, now: float) -> float:
        """TTFT of a request waiting behind ``tokens_ahead`` prefill tokens on ``worker``
        (A.7-corrected: the request itself makes the queue non-empty)."""
        return self.latency.ttft_ms(uncached_tokens, tokens_ahead, requests_ahead) + self.bottleneck_ms(worker, now, True)

    def _view(self, ctx: RoutingContext, w: Worker, slo: float, threshold: int,
              owns: dict[int, float] | None = None) -> _View:
        """``owns``: a Route's TTFTs of its prompt on an idle worker by uncached tokens, kept
        while it prices the fleet (cold placement): most workers hold none of a cold prompt,
        so it is one model call, not one per worker."""
        uncached = ctx.uncached_tokens(w)
        # requests waiting for w in the router's admission queue are its pending work as much
        # as those waiting inside the engine (3.2); 0 without admission queue mode
        load = self.latency.pending_tokens(w, ctx.now) + w.queued_prefill_tokens
        stall = self.bottleneck_ms(w, ctx.now)
        own = None if owns is None else owns.get(uncached)
        if own is None:
            own = self.latency.ttft_ms(uncached, 0)
            if owns is not None:
                owns[uncached] = own
        requests = w.inflight_requests + w.queued_requests
        # nothing ahead: ttft_ms(uncached, 0, 0) is the idle TTFT, own
        ttft = (own if not load and not requests else self.latency.ttft_ms(uncached, load, requests)) + stall
        room = 1.0 - self.params.switch_headroom
        if self.params.slo_test == "static_threshold":
            over, roomy = load + uncached > threshold, load + uncached <= room * threshold
        else:
            over, roomy = ttft - stall > slo, ttft - stall <= room * slo
        return _View(w, ctx.overlap(w), load, uncached, ttft, own, stall, over, over or stall > 0, roomy)

    # ---- candidates -----------------------------------------------------------------------
    def _by_id(self, candidates: Sequence[Worker]) -> dict[str, Worker]:
        """``candidates`` by id, kept while the same list comes back: the router hands every
        Route its eligible workers as one list per membership (``router.selector``), so the
        dict is built once per membership, where building it was ~43 us a Route at 1,024
        workers. Kept by identity with the list held, as ``ListScans`` keeps lists; a worker's
        id is fixed for its life."""
        kept = self._ids
        if kept[0] is not candidates:
            kept = self._ids = (candidates, {w.id: w for w in candidates})
        return kept[1]

    def _hash_pair(self, by_id: dict[str, Worker], path: list[tuple[int, int]]) -> tuple[str, str | None] | None:
        if len(by_id) < 2 or not path:
            return None
        try:
            return self.ring.pair(path[-1][1], by_id.__contains__)
        except LookupError:
            return None

    def _plan(self, ctx: RoutingContext, by_id: dict[str, Worker],
              path: list[tuple[int, int]]) -> tuple[str, tuple[str, str | None] | None]:
        """How the request finds its candidates: ("hash", its pair), ("remembered", (the
        remembered worker, the first other of its pair)), ("cold", None) for a fleet-wide
        placement, or ("", None) when it has no pair."""
        pair = self._hash_pair(by_id, path)
        if pair is None:
            return "", None
        if self.params.cold_placement == "pair":
            return "hash", pair
        if len(path) == 1:  # an extended (hot) key is spread by its pair, never pinned
            hit = self.memory.lookup(ctx.request.keys, path[0][0], ctx.now, by_id.__contains__)
            if hit is not None:
                home = hit[1]
                return "remembered", (home, pair[0] if pair[0] != home else pair[1])
        # a walk with no entry holds nothing for anyone: no pass over the fleet to say so
        if not ctx.match.overlaps or not any(ctx.overlap(w) for w in ctx.candidates):
            return "cold", None
        return "hash", pair

    def candidate_ids(self, ctx: RoutingContext) -> list[str]:
        """The hashed pair DualMap would choose between for ``ctx`` (every candidate when it
        has none), for a policy that scores them instead (``compose``). The pair, not a
        fleet-wide placement: compose's decisions are its own, so this policy never sees
        them to remember a placement."""
        by_id = self._by_id(ctx.candidates)
        pair = self._hash_pair(by_id, self.key_path(ctx.request.keys, ctx.block_size))
        if pair is None:
            return list(by_id)
        return [wid for wid in pair if wid is not None]

    # ---- selection ----------------------------------------------------------------------
    def select(self, ctx: RoutingContext) -> Decision:
        slo = self.slo_ms(ctx.request)
        threshold = self.threshold_tokens(slo)
        by_id = self._by_id(ctx.candidates)
        path = self.key_path(ctx.request.keys, ctx.block_size)
        how, pair = self._plan(ctx, by_id, path)
        if how == "cold":
            if not ctx.explain and native.module is not None:
                # one native pass over the loads by slot (~2 us a view here: ~2 ms at 1,024
                # workers); the explained placement below, which lists every view, is its reference
                picked = native.module.dualmap_cold_pick(
                    *self.latency.pricing_args(ctx), slo, threshold if self.params.slo_test == "static_threshold" else -1,
                    self.bottleneck_ms if self.a7.limit_s > 0 else None)
                if picked is not NotImplemented and picked[1] >= 0:  # a cold plan has two workers at least
                    best, other = (self._view(ctx, ctx.candidates[i], slo, threshold) for i in picked)
                    return self._decision(ctx, best, other, "cold_fleet", [best, other], path, slo, threshold, how)
            owns: dict[int, float] = {}
            priced = (self._view(ctx, w, slo, threshold, owns) for w in ctx.candidates)
            # the record lists every view in order; unrecorded, only the best two are read, and
            # nsmallest is sorted()[:2] without sorting the fleet (~10,000 tuple comparisons at 1,024)
            views = sorted(priced, key=_cold_order) if ctx.explain else nsmallest(2, priced, key=_cold_order)
            return self._decision(ctx, views[0], views[1], "cold_fleet", views if ctx.explain else views[:2],
                                  path, slo, threshold, how)
        if pair is None:
            # one worker, no full block to hash, or the candidates are not on the ring yet
            views = [self._view(ctx, w, slo, threshold) for w in ctx.candidates]
            chosen = min(views, key=lambda v: (v.overloaded, v.load, v.worker.slot))
            rule = "single_candidate" if len(by_id) == 1 else ("no_prefix" if not path else "not_on_ring")
            return self._decision(ctx, chosen, None, rule, views, path, slo, threshold, how)
        first = self._view(ctx, by_id[pair[0]], slo, threshold)
        second = self._view(ctx, by_id[pair[1]], slo, threshold) if pair[1] is not None else None
        if second is None:
            return self._decision(ctx, first, None, "single_candidate", [first], path, slo, threshold, how)
        home = first if how == "remembered" else None
        # requests with this key in the hotness window: the traffic a switched prefix serves
        reuses = self.hotness.count(path[-1][1])
        chosen, rule = self._choose(first, second, home, reuses, stalls=True)
        # A.7's effect: what the rule would have chosen with no worker flagged
        flagged = int(first.bottleneck_ms > 0) + int(second.bottleneck_ms > 0)
        moved = int(flagged > 0 and self._choose(first, second, home, reuses, stalls=False)[0] is not chosen)
        other = second if chosen is first else first
        return self._decision(ctx, chosen, other, rule, [first, second], path, slo, threshold, how,
                              decode_bottlenecked=flagged, decode_bottleneck_moved=moved)

    def _choose(self, first: _View, second: _View, home: _View | None, reuses: int,
                stalls: bool) -> tuple[_View, str]:
        """Section 3.2's choice between the pair; ``home`` (a remembered placement) is preferred
        when reuse ties; ``reuses`` is the key's recent traffic; ``stalls=False`` ignores A.7's flags."""
        def stalled(v: _View) -> bool:
            return stalls and v.bottleneck_ms > 0

        def ttft(v: _View) -> float:
            return v.ttft_ms if stalls else v.ttft_ms - v.bottleneck_ms

        lighter = min((first, second), key=lambda v: (stalled(v), v.load, v is second))
        if first.reuse == second.reuse and home is None:
            return lighter, "equal_reuse"
        if first.reuse == second.reuse:
            preferred = home
        else:
            preferred = first if first.reuse > second.reuse else second
        assert preferred is not None
        if not (preferred.over_load or stalled(preferred)):
            return preferred, "cache_affinity"
        other = second if preferred is first else first
        if self.params.slo_switch == "guarded":
            # only to a candidate with room under the SLO, and only if the TTFT it saves
            # exceeds the extra prefill the fleet does for it (a cache hit recomputed), shared
            # by the key's recent requests: the prefix then sits on both candidates and later
            # requests split between them, so a shared tool prompt repays it, a one-off not
            extra = (other.own_ms - preferred.own_ms) / (1 + reuses)
            if other.roomy and not stalled(other) and ttft(preferred) - ttft(other) > extra:
                return other, "slo_switch"
            return preferred, "slo_hold"
        if self.params.switch_to == "min_ttft":
            return min((first, second), key=lambda v: (ttft(v), v is second)), "slo_switch"
        return lighter, "slo_switch"

    def _decision(self, ctx: RoutingContext, chosen: _View, other: _View | None, rule: str, views: list[_View],
                  path: list[tuple[int, int]], slo: float, threshold: int, placement: str,
                  decode_bottlenecked: int = 0, decode_bottleneck_moved: int = 0) -> Decision:
        scored = [
            ctx.candidate(
                v.worker, score=-v.ttft_ms, candidate=float(i + 1), reuse_blocks=float(v.reuse),
                load_tokens=float(v.load), uncached_tokens=float(v.uncached), est_ttft_ms=round(v.ttft_ms, 3),
                overloaded=float(v.overloaded), bottleneck_ms=round(v.bottleneck_ms, 3),
            )
            for i, v in enumerate(views)
        ]
        attrs: dict[str, float | int | str] = {
            "rule": rule, "slo_ms": slo, "threshold_tokens": threshold, "placement": placement or "none",
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
        worker = self.dispatched_worker(decision, ctx)
        if worker is None:
            return
        a = decision.attributes
        uncached = ctx.uncached_tokens(worker)
        self.a7.on_dispatch(worker, ctx.request.request_id, uncached, ctx.prompt_tokens - uncached, ctx.now)
        if a.get("decode_bottlenecked"):
            self._counts["decode_bottleneck_decisions"] += 1
            self._counts["decode_bottleneck_moves"] += int(a.get("decode_bottleneck_moved", 0))
        rule = a.get("rule")
        if rule in ("slo_switch", "slo_hold"):
            self._counts["slo_switches" if rule == "slo_switch" else "slo_holds"] += 1
        self.latency.on_dispatch(worker, ctx.request.request_id, uncached, ctx.now)
        path = self.key_path(ctx.request.keys, ctx.block_size)
        if path:
            self._remember(a.get("placement"), ctx, worker, path)
            limit = min(len(ctx.request.keys), self.params.max_key_segments * self.segment_blocks(ctx.block_size))
            self.hotness.record(path, ctx.now, max(len(self.ring), 1), can_extend=path[-1][0] < limit)

    def _remember(self, placement: object, ctx: RoutingContext, worker: Worker, path: list[tuple[int, int]]) -> None:
        if placement == "cold":
            self._counts["cold_placements"] += 1
            self.memory.remember(path[-1][1], worker.id, ctx.now)
        elif placement == "remembered":
            # refresh the entry the decision used; it keeps its worker even when a switch
            # sent this request elsewhere (that worker still holds the prefix)
            self._counts["remembered_placements"] += 1
            hit = self.memory.lookup(ctx.request.keys, path[0][0], ctx.now, lambda _: True)
            if hit is not None:
                self.memory.remember(hit[0], hit[1], ctx.now)

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        self.latency.observe_completion(completion.request_id, completion.ttft_ms)
        if worker is None:
            return
        # the first token came e2e - ttft before the completion; it dates the prefill (a
        # duration no request takes, or no number at all, dates it at the completion)
        e2e, ttft = completion.e2e_ms, completion.ttft_ms
        decode_s = max(0.0, e2e - ttft) / 1000.0 if 0 < e2e <= MAX_LATENCY_MS and 0 <= ttft <= e2e else 0.0
        self.a7.on_complete(worker.id, completion.request_id, now - decode_s)

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def on_worker_added(self, worker: Worker) -> None:
        self.ring.add(worker.id)

    def on_worker_removed(self, worker: Worker) -> None:
        self.ring.remove(worker.id)
        self.latency.forget_worker(worker.id)
        self.a7.forget_worker(worker.id)
        self.memory.forget_worker(worker.id)

    def tick(self, now: float) -> None:
        self.hotness.cool(now, max(len(self.ring), 1))
        self.memory.expire(now)


class DualMapPaperPolicy(DualMapPolicy):
    """``dualmap_paper``: DualMap with the paper's rules only (``DualMapPaperParams``)."""
