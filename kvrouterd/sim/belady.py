"""``belady``: clairvoyant eviction for the simulator, the furthest next use first (an upper bound on reuse).

Belady's MIN evicts the block whose next use lies furthest in the future; with unit-size blocks
and demand caching nothing hits more often. It is UniCache's upper bound on prefix reuse (section
4.3, "The Optimal Eviction Policy", OPT-Offline in its figures) and, capped at a latency
threshold, T-LRU's hindsight optimum (section 3, Tail-Optimized Belady): a policy that reaches it
has no reuse left to find. It needs the future, so only the
simulator, which holds the whole workload before the run, can run it; the policy registry
reserves the name so that a daemon naming it (config ``eviction``, an ``EvictHint``) is told why
it cannot (``policies.eviction.SIMULATOR_ONLY``).

The algorithm, per engine (one policy object per ``SimEngine``, one cache slot):

- **Uses.** ``NextUse`` lists, for every block key, the indices of the workload's requests whose
  prompt chain contains it, ascending; requests are in arrival order, so an index is a time.
- **The present** is the index of the latest request the engine admitted (``admitting``, which
  the engine calls once the request's room is made, before touching its prefix): a use at or
  before it is consumed. An engine
  admits first come first served, so with one worker the next use after the present is exactly
  the next request to touch the block there, requests still waiting in its queue included.
- **Order.** Only leaves are evicted (a block with no cached child; its parent becomes one once
  the leaf is gone), by ``-next use``, ties to the smaller key; a block used by no later request
  goes first. A parent's next use is never later than its children's (a request holding a child
  holds the parent), so leaf order is the Belady order of the whole cache. The leaves are kept
  sorted by ``_leaves.SortedLeaves`` as LRU's are, and a leaf whose recorded next use the present
  has passed without it being touched (the request went to another worker, or was shed) is
  re-scored before each ranking (``_catch_up``, from a heap of recorded next uses).

With several workers the next use is the fleet's, not the engine's: a later request containing
the block counts as this engine's use even when the router sends it elsewhere, and a request
another engine already admitted still counts until this engine's present passes it. So it is
exact for one worker and a per-fleet approximation with routing (it keeps what the fleet will
want; a per-engine oracle would need the routing decisions of the future too).

No parameters. Build it with ``build`` (the simulator's ``policy_specs.build_eviction``).
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Generator, Sequence

from ..index.radix import Block, RadixIndex
from ..policies.base import EvictionContext, NoParams
from ..policies.eviction._leaves import LeafOrderPolicy
from .workloads import Workload

__all__ = ["NAME", "BeladyEviction", "NextUse"]

#: the policy's name (``--eviction belady``); reserved in the registry, built only here
NAME = "belady"


class NextUse:
    """Block key -> the ascending indices of the requests whose prompt chain holds it."""

    def __init__(self, uses: dict[int, list[int]]) -> None:
        self._uses = uses

    @classmethod
    def of(cls, workload: Workload, keys: Callable[[Sequence[int]], list[int]]) -> NextUse:
        """The uses of ``workload``'s requests, whose block ids ``keys`` turns into the block keys
        the engines cache (``cluster._Keys.keys``)."""
        uses: dict[int, list[int]] = {}
        for n, req in enumerate(workload.requests):
            for key in keys(req.block_ids):
                uses.setdefault(key, []).append(n)
        return cls(uses)

    def after(self, key: int, present: int) -> float:
        """The index of the first request after ``present`` that holds ``key``; inf if none."""
        uses = self._uses.get(key)
        if uses is None:
            return math.inf
        i = bisect_right(uses, present)
        return float(uses[i]) if i < len(uses) else math.inf


class BeladyEviction(LeafOrderPolicy):
    """Furthest next use first over leaves; see the module docstring. One per engine."""

    name = NAME

    def __init__(self, params: NoParams, rng: random.Random, future: NextUse) -> None:
        super().__init__(params, rng, self._priority, numeric=True)
        self._future = future
        #: index of the latest request admitted (-1: none yet)
        self._present = -1
        #: (recorded next use, key) of scored leaves, earliest first, and each key's latest record
        self._due: list[tuple[float, int]] = []
        self._recorded: dict[int, float] = {}

    def admitting(self, request_index: int) -> None:
        """The engine admits request ``request_index``: uses up to it are consumed."""
        if request_index > self._present:
            self._present = request_index

    def _priority(self, index: RadixIndex, block: Block, slot: int) -> float:
        key = block.key
        nxt = self._future.after(key, self._present)
        if nxt != math.inf and self._recorded.get(key) != nxt:
            self._recorded[key] = nxt
            heapq.heappush(self._due, (nxt, key))
        return -nxt

    def _catch_up(self, ctx: EvictionContext) -> None:
        """Re-score the leaves whose recorded next use the present has passed untouched."""
        due, recorded, present = self._due, self._recorded, self._present
        stale = []
        while due and due[0][0] <= present:
            nxt, key = heapq.heappop(due)
            if recorded.get(key) == nxt:
                del recorded[key]
                stale.append(key)
        if stale:
            self._leaves.rescore(ctx.index, ctx.slot, stale)

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        self._catch_up(ctx)
        return super().rank(ctx, count, pinned)

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        self._catch_up(ctx)
        return super().rank_steps(ctx, count, pinned, step)
