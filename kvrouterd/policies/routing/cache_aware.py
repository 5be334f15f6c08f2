"""``cache_aware``: SGLang's gateway cache-aware policy (sgl-router, now lightseekorg/smg).

Source: lightseekorg/smg ``model_gateway/src/policies/cache_aware.rs`` (``select_worker``,
``is_imbalanced``, ``select_worker_event_driven``, ``score_overlap``,
``select_worker_with_tokens``), defaults from the gateway's command line
(``model_gateway/src/main.rs``, what ``smg`` runs with unless told otherwise). Read to learn,
not copied. Per request, over the eligible workers, load being each worker's in-flight
requests:

1. *Imbalanced* when ``max_load - min_load > balance_abs_threshold`` **and**
   ``max_load > balance_rel_threshold * min_load``, or when reported KV use trips a trigger
   (hottest worker above ``overload_token_usage_threshold``, or hottest minus coolest above
   ``balance_token_usage_threshold``; both off at 1.0). Then the least-loaded worker wins
   (reason ``imbalanced``).
2. Otherwise, how the cache decides depends on what the gateway knows of it
   (``match_rule``):
   - ``overlap`` (SGLang's event-driven mode, KV events from the engines): the worker with
     the most cached prefix blocks wins whatever the match rate (reason ``prefix_match``;
     ties to the lower load, then the smaller cache), or, when no worker holds any block,
     the least-loaded (reason ``no_overlap``).
   - ``threshold`` (SGLang's approximate tree, no events): the worker with the longest
     cached prefix wins if its match rate (matched prompt tokens / prompt tokens) exceeds
     ``cache_threshold`` (reason ``prefix_match``; ties to the less loaded: SGLang takes the
     tenant that last touched the matched node, which the index does not record per
     request), else the least-loaded (reason ``low_match``).
   - ``auto`` (the default): ``overlap`` when every candidate's cache is known from engine
     events (``CacheMode.EVENTS``), ``threshold`` otherwise, as SGLang picks its mode.

"Least-loaded" is SGLang's ``min_load_idx``: the fewest in-flight requests, ties to the
worker this policy has sent fewer requests to (SGLang's ``processed`` count, issue #1714),
then the lower slot. The prefix tree is the router's index: SGLang's own approximate tree
(evicted every ``eviction_interval`` = 120 s down to ``max_tree_size`` = 67,108,864 nodes)
has no counterpart here, as the router keeps one index for every policy.

Parameters (SGLang's gateway defaults):

- ``cache_threshold`` = 0.3: minimum match rate for cache affinity (``threshold``), in [0, 1].
- ``balance_abs_threshold`` = 64: absolute load spread that can mark imbalance.
- ``balance_rel_threshold`` = 1.5: relative load spread that can mark imbalance (>= 1).
- ``balance_token_usage_threshold`` = 1.0, ``overload_token_usage_threshold`` = 1.0: the KV
  triggers on ``ReportLoad``'s kv_utilization, in [0, 1]; 1.0 never trips.
- ``match_rule`` = "auto": "auto", "overlap" or "threshold" (above).
- ``load_metric`` = "requests": load is in-flight requests, as in SGLang; "prefill_tokens"
  uses pending uncached prefill tokens instead (then size the absolute threshold in tokens).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal

from ...index import native
from ...index.workers import Worker
from ...protocols import CacheMode, CandidateScore, Decision
from .._scan import fewest_counted_at_load, scan_candidates, tied_candidates
from ..base import RoutingContext, RoutingPolicyBase

__all__ = ["CacheAwareParams", "CacheAwarePolicy"]

#: Decision built without the dataclass ``__init__`` (0.27 -> 0.13 us on every unexplained
#: decision), given every field in declaration order
_new_decision = native.positional_constructor(Decision)
#: ``_select_py`` of an unexplained decision in one native pass (None: no extension)
_cache_aware_pick = native.module.cache_aware_pick if native.module is not None else None


@dataclass(frozen=True)
class CacheAwareParams:
    cache_threshold: float = field(default=0.3, metadata={"help": "minimum prefix match rate for cache affinity"})
    balance_abs_threshold: float = field(default=64, metadata={"help": "load spread (absolute) that can mark imbalance"})
    balance_rel_threshold: float = field(default=1.5, metadata={"help": "load spread (max/min) that can mark imbalance"})
    balance_token_usage_threshold: float = field(
        default=1.0, metadata={"help": "reported KV-use spread that marks imbalance (1.0 = off)"}
    )
    overload_token_usage_threshold: float = field(
        default=1.0, metadata={"help": "reported KV use of the hottest worker that marks imbalance (1.0 = off)"}
    )
    match_rule: Literal["auto", "overlap", "threshold"] = field(
        default="auto", metadata={"help": "cache rule: most cached blocks (events), match-rate threshold, or by mode"}
    )
    load_metric: Literal["requests", "prefill_tokens"] = field(
        default="requests", metadata={"help": "what load means: in-flight requests or pending prefill tokens"}
    )

    def validate(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        for name in ("balance_token_usage_threshold", "overload_token_usage_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.match_rule not in ("auto", "overlap", "threshold"):
            raise ValueError(f"match_rule must be 'auto', 'overlap' or 'threshold', got {self.match_rule!r}")


def _match_rate(depth: int, block_size: int, prompt_tokens: int) -> float:
    """Matched prompt tokens / prompt tokens (``prompt_tokens`` >= 1), at most 1."""
    return min(1.0, depth * block_size / prompt_tokens)


#: a worker's cache mode, read in C over a narrowed candidate list (``_rule``)
_MODE = attrgetter("spec.mode")
_EVENTS_ONLY = frozenset((CacheMode.EVENTS,))


class CacheAwarePolicy(RoutingPolicyBase):
    params: CacheAwareParams

    def __init__(self, params: CacheAwareParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        #: requests this policy sent to each worker (SGLang's ``processed``: min-load ties)
        self._processed: dict[str, int] = {}
        #: the same counts by slot, for the native tie-break: ``_processed_by_slot[s]`` is
        #: ``_processed[w.id]`` wherever ``_processed_owner[s]`` is the Worker ``w`` (kept so by
        #: the hooks; a worker whose slot's owner is another worker, or None, is looked up by id,
        #: as after a slot move until its next dispatch). An idle fleet ties everywhere, and
        #: looking up 1,024 ids was ~15 us of a Route; ``_processed_at``: the one slot each
        #: worker's count is kept at
        self._processed_by_slot = array("q")
        self._processed_owner: list[Worker | None] = []
        self._processed_at: dict[str, int] = {}
        #: the worker the last ``select`` chose: ``on_dispatch`` reads its slot
        self._chosen: Worker | None = None
        #: the candidate list ``_auto_rule`` was worked out for (the router hands the same list
        #: while membership is unchanged): worked out per decision, it is a pass over every worker
        #: in Python (~10 us at 64 workers, ~100 at 1,024)
        self._rule_for: Sequence[Worker] | None = None
        self._auto_rule = ""
        #: the list before it and its rule: a disaggregated Route alternates two lists (its
        #: decode and its prefill workers), which one entry would work out anew every time
        self._rule_before: Sequence[Worker] | None = None
        self._rule_before_value = ""
        #: whether either KV-use trigger is on: off (the default), a decision reads no worker's use
        self._kv_triggers = (params.balance_token_usage_threshold < 1.0
                             or params.overload_token_usage_threshold < 1.0)
        #: what ``load_metric`` names, as the workers' attribute
        self._load_attr = "inflight_requests" if params.load_metric == "requests" else "pending_prefill_tokens"

    def _least_loaded(self, ctx: RoutingContext, min_i: int, min_load: int, load_attr: str) -> int:
        """SGLang's min_load_idx: fewest in-flight, then fewest processed, then lower slot.

        An idle or evenly loaded fleet ties everywhere: at 1,024 workers a pass in bytecode over
        the ties and their counts cost a decision 250 us, a native list of the ties and a pass
        over them ~80; one native pass reads the loads by slot and the ties' counts alone."""
        return fewest_counted_at_load(ctx.candidates, ctx.match.overlaps, load_attr, min_i, min_load, self._processed,
                                      ctx.candidate_slots, self._processed_by_slot, self._processed_owner)

    def _kv_imbalanced(self, candidates: Sequence[Worker]) -> bool:
        p = self.params
        usage = [w.kv_utilization for w in candidates]
        return max(usage) > p.overload_token_usage_threshold or max(usage) - min(usage) > p.balance_token_usage_threshold

    def _rule(self, candidates: Sequence[Worker]) -> str:
        rule = self.params.match_rule
        if rule != "auto":
            return rule
        if candidates is self._rule_before:
            self._rule_for, self._rule_before = candidates, self._rule_for
            self._auto_rule, self._rule_before_value = self._rule_before_value, self._auto_rule
        elif candidates is not self._rule_for:
            self._rule_before, self._rule_before_value = self._rule_for, self._auto_rule
            self._rule_for = candidates
            # a list narrowed for one request (a pool, candidate_workers) is new on every Route:
            # its modes are read in C (a bytecode pass was ~65 us at 1,024 workers)
            self._auto_rule = "overlap" if set(map(_MODE, candidates)) <= _EVENTS_ONLY else "threshold"
        return self._auto_rule

    def select(self, ctx: RoutingContext) -> Decision:
        # a decision nobody reads the record of (an unsampled trace), the KV triggers off (the
        # default): natively in one pass, ``cache_aware_pick`` (``_select_py`` its reference)
        if _cache_aware_pick is not None and not ctx.explain and not self._kv_triggers:
            p = self.params
            candidates = ctx.candidates
            rule = self._auto_rule if candidates is self._rule_for else self._rule(candidates)
            decision = _cache_aware_pick(self, ctx, rule == "overlap", p.balance_abs_threshold, p.balance_rel_threshold,
                                         p.cache_threshold, self._load_attr, _new_decision, self.name)
            if decision is not NotImplemented:
                return decision  # type: ignore[no-any-return]
        return self._select_py(ctx)

    def _select_py(self, ctx: RoutingContext) -> Decision:
        """``select``'s reference, of the native ``cache_aware_pick`` (``index/_native.c``)."""
        p = self.params
        candidates = ctx.candidates
        load_attr = self._load_attr
        overlaps = ctx.match.overlaps
        # longest match, ties to the less loaded, then the lower slot (candidates are slot-ordered);
        # and the load spread: one pass, in C where the extension is built (policies/_scan.py)
        best_i, best_depth, min_i, min_load, max_load = scan_candidates(candidates, overlaps, load_attr,
                                                                        ctx.candidate_slots)
        imbalanced = ((max_load - min_load) > p.balance_abs_threshold and max_load > p.balance_rel_threshold * min_load
                      ) or (self._kv_triggers and self._kv_imbalanced(candidates))
        prompt_tokens = ctx.request.prompt_tokens
        if prompt_tokens < 1:
            prompt_tokens = 1
        rule = self._auto_rule if candidates is self._rule_for else self._rule(candidates)

        if imbalanced:
            i, reason = self._least_loaded(ctx, min_i, min_load, load_attr), "imbalanced"
        elif rule == "overlap":  # the match rate does not count: worked out for the record only
            if best_depth > 0:
                i, reason = self._most_overlap(ctx, best_i, best_depth, load_attr), "prefix_match"
            else:
                i, reason = self._least_loaded(ctx, min_i, min_load, load_attr), "no_overlap"
        elif _match_rate(best_depth, ctx.block_size, prompt_tokens) > p.cache_threshold:
            i, reason = best_i, "prefix_match"
        else:
            i, reason = self._least_loaded(ctx, min_i, min_load, load_attr), "low_match"
        chosen = self._chosen = candidates[i]
        if not ctx.explain:
            # nobody will read the record (an unsampled trace): the choice alone. Its attributes
            # are for the span only, and rounding a float is a decimal conversion (~0.5 us)
            return _new_decision(chosen.id, self.name, reason, [], overlaps.get(chosen.slot, 0), "", 0.0, {}, "", "", None,
                                 "", 0, 0)
        match_rate = _match_rate(best_depth, ctx.block_size, prompt_tokens)
        return self.decide(ctx, chosen, reason, self._scored(ctx, chosen, prompt_tokens, load_attr),
                           match_rate=round(match_rate, 4), imbalanced=int(imbalanced), match_rule=rule)

    @staticmethod
    def _scored(ctx: RoutingContext, chosen: Worker, prompt_tokens: int, load_attr: str) -> list[CandidateScore]:
        """The candidates the record lists (``ctx.explained``) with their match rate and load
        (``select``'s variables read by this comprehension would be cells, made on every
        decision, explained or not)."""
        overlaps = ctx.match.overlaps
        return [
            ctx.candidate(w, score=overlaps.get(w.slot, 0) * ctx.block_size / prompt_tokens,
                          load=float(getattr(w, load_attr)))
            for w in ctx.explained(chosen)
        ]

    def _most_overlap(self, ctx: RoutingContext, best_i: int, best_depth: int, load_attr: str) -> int:
        """score_overlap: most cached blocks, then lower load, then the smaller cache."""
        candidates = ctx.candidates
        load = getattr(candidates[best_i], load_attr)
        # scan_candidates chose the first of the least loaded longest matches, so any other tie
        # lies after it: one pass over the rest (in C), where a bytecode pass over every
        # candidate costs ~100 us at 1,024 workers; given the candidates' slots, over the walk's
        # entries of that depth only
        ties = tied_candidates(candidates, ctx.match.overlaps, load_attr, best_i + 1, best_depth, load,
                               ctx.candidate_slots)
        # ties come in order after best_i: the first of the smallest caches wins (a plain loop:
        # min() with a key tuple per tie was ~1 us for the 4 ties of the 1,024-worker benchmark),
        # each cache's size read from the index's view (``ctx.cached_blocks`` is a call per tie)
        counts = ctx.index.counts
        chosen, fewest = best_i, counts[candidates[best_i].slot]
        for i in ties:
            cached = counts[candidates[i].slot]
            if cached < fewest:
                chosen, fewest = i, cached
        return chosen

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        worker_id = decision.worker_id
        count = self._processed[worker_id] = self._processed.get(worker_id, 0) + 1
        chosen = self._chosen
        if chosen is not None and chosen.id == worker_id:
            slot = chosen.slot
            owners = self._processed_owner
            if slot < len(owners) and owners[slot] is chosen:  # kept there already: the common case
                self._processed_by_slot[slot] = count
            else:
                self._keep_by_slot(chosen, count)
        else:  # chosen elsewhere (a prefill hop's context): its slot's copy is stale now
            self._drop_by_slot(worker_id)

    def on_worker_added(self, worker: Worker) -> None:
        # kept by slot from the start: a worker not sent anything yet is no lookup either
        self._keep_by_slot(worker, self._processed.get(worker.id, 0))

    def on_worker_removed(self, worker: Worker) -> None:
        self._processed.pop(worker.id, None)
        self._drop_by_slot(worker.id)

    def _keep_by_slot(self, worker: Worker, count: int) -> None:
        slot = worker.slot
        owners = self._processed_owner
        kept_at = self._processed_at.get(worker.id)
        if kept_at is not None and kept_at != slot and owners[kept_at] is worker:  # it moved slots
            owners[kept_at] = None
        if slot >= len(owners):
            grow = slot + 1 - len(owners)
            owners.extend([None] * grow)
            self._processed_by_slot.extend([0] * grow)
        self._processed_by_slot[slot] = count
        owners[slot] = worker
        self._processed_at[worker.id] = slot

    def _drop_by_slot(self, worker_id: str) -> None:
        kept_at = self._processed_at.pop(worker_id, None)
        if kept_at is not None:
            owner = self._processed_owner[kept_at]
            if owner is not None and owner.id == worker_id:
                self._processed_owner[kept_at] = None
