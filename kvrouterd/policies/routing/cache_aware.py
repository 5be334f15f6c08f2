"""``cache_aware``: SGLang router's cache-aware policy (sgl-router / SGLang model gateway).

Per request:
1. The cluster is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` **and**
   ``max_load > balance_rel_threshold * min_load`` over the eligible workers. Then the
   least-loaded worker wins (reason ``imbalanced``).
2. Otherwise the worker with the longest cached prefix wins if its match rate
   (matched prompt tokens / prompt tokens) exceeds ``cache_threshold`` (reason
   ``prefix_match``; ties go to the less loaded worker).
3. Otherwise the least-loaded worker wins (reason ``low_match``); ties go to the worker
   holding fewer cached blocks, which has the most room for a new prefix (SGLang picks the
   smallest tree).

Parameters (defaults are SGLang's current ones):
- ``cache_threshold`` = 0.3: minimum match rate for cache affinity, in [0, 1].
- ``balance_abs_threshold`` = 64: absolute load spread that can mark imbalance.
- ``balance_rel_threshold`` = 1.5: relative load spread that can mark imbalance (>= 1).
- ``load_metric`` = "requests": load is in-flight requests, as in SGLang; "prefill_tokens"
  uses pending uncached prefill tokens instead (then size the absolute threshold in tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...protocols import Decision
from .._scan import scan_candidates
from ..base import RoutingContext, RoutingPolicyBase


@dataclass(frozen=True)
class CacheAwareParams:
    cache_threshold: float = field(default=0.3, metadata={"help": "minimum prefix match rate for cache affinity"})
    balance_abs_threshold: float = field(default=64, metadata={"help": "load spread (absolute) that can mark imbalance"})
    balance_rel_threshold: float = field(default=1.5, metadata={"help": "load spread (max/min) that can mark imbalance"})
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


class CacheAwarePolicy(RoutingPolicyBase):
    params: CacheAwareParams

    def select(self, ctx: RoutingContext) -> Decision:
        p = self.params
        candidates = ctx.candidates
        load_attr = "inflight_requests" if p.load_metric == "requests" else "pending_prefill_tokens"
        overlaps = ctx.match.overlaps
        # longest match, ties to the less loaded, then the lower slot (candidates are slot-ordered);
        # and the load spread: one pass, in C where the extension is built (policies/_scan.py)
        best_i, best_depth, min_i, min_load, max_load = scan_candidates(candidates, overlaps, load_attr)
        imbalanced = (max_load - min_load) > p.balance_abs_threshold and max_load > p.balance_rel_threshold * min_load
        prompt_tokens = max(ctx.request.prompt_tokens, 1)
        match_rate = min(1.0, best_depth * ctx.block_size / prompt_tokens)

        loads: list[int] = []
        if ctx.explain or not (imbalanced or match_rate > p.cache_threshold):
            loads = [getattr(w, load_attr) for w in candidates]
        if imbalanced:
            chosen, reason = candidates[min_i], "imbalanced"
        elif match_rate > p.cache_threshold:
            chosen, reason = candidates[best_i], "prefix_match"
        else:
            i = min(range(len(candidates)), key=lambda i: (loads[i], ctx.cached_blocks(candidates[i]), i))
            chosen, reason = candidates[i], "low_match"
        if not ctx.explain:
            # nobody will read the record (an unsampled trace): the choice alone. Its attributes
            # are for the span only, and rounding a float is a decimal conversion (~0.5 us)
            return Decision(chosen.id, self.name, reason, [], overlaps.get(chosen.slot, 0))
        scored = [
            ctx.candidate(w, score=overlaps.get(w.slot, 0) * ctx.block_size / prompt_tokens, load=float(loads[i]))
            for i, w in enumerate(candidates)
        ]
        return self.decide(ctx, chosen, reason, scored, match_rate=round(match_rate, 4), imbalanced=int(imbalanced))
