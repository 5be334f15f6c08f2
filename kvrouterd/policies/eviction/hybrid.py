"""``hybrid``: leaf eviction by usage, length and recency (systematic study, section 3.3 and
Algorithm 2).

Each leaf gets

    value = usage * length / (1 + recency)

and the lowest value is evicted first: blocks that are reused often, are long and were used
recently are kept. ``usage`` is the block's access count (1 when stored, +1 per later
access), ``recency`` the time since its last access on that worker in units of
``age_unit_s``. ``length`` is the length of the trie node: in the paper's trie (and ours) a
node is one block, so by default it is 1 for every block (``length = "node"``); ``"prefix"``
uses the length of the whole prefix the block ends (its depth), which keeps deep
conversation tails longer. On the Mooncake conversation trace (``kvrouterd sim cache``),
"node" gives 4.48% / 11.98% / 22.14% at 1k / 5k / 10k blocks (LRU: 4.45 / 11.18 / 21.16;
the paper's hybrid: 4.45 / 11.22 / 21.19) and "prefix" 4.51% / 11.00% / 17.78%. Ties go to
the least recently used block, then the smaller key. Only leaves are evictable; a parent
joins once its last cached child is chosen.

Parameters (``HybridParams``):
    age_unit_s = 1.0       seconds that count as one unit of ``recency`` in the score
    length     = "node"    "node": every block has length 1; "prefix": its depth in blocks

The value drifts with the clock, but leaves with the same ``usage * length`` keep their
relative order (least recent first), so the hooks keep each worker's leaves sorted by
(usage * length, last access) and ``rank`` merges the oldest leaf of each such class by
value: O(C log L + k log C) for C classes and k blocks. A policy that has not seen every
hook (built for one ``EvictHint``) scores all leaves instead, O(L + k log L).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ...index.radix import Block, RadixIndex
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from ._leaves import SortedLeaves, run_steps
from ._release import release_steps

__all__ = ["HybridEviction", "HybridParams", "hybrid_value"]


@dataclass(frozen=True)
class HybridParams:
    age_unit_s: float = field(default=1.0, metadata={"help": "seconds that count as one unit of recency in the score"})
    length: Literal["node", "prefix"] = field(default="node", metadata={
        "help": "length in the score: 'node' (one block, always 1) or 'prefix' (depth in blocks)"})

    def validate(self) -> None:
        if not self.age_unit_s > 0:
            raise ValueError(f"age_unit_s must be > 0, got {self.age_unit_s}")
        if self.length not in ("node", "prefix"):
            raise ValueError(f"length must be 'node' or 'prefix', got {self.length!r}")


def hybrid_value(usage: int, length: int, age: float) -> float:
    """The paper's score: usage * length / (1 + recency)."""
    return usage * length / (1.0 + age)


class HybridEviction(EvictionPolicyBase):
    params: HybridParams

    def __init__(self, params: HybridParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self._depth: dict[int, dict[int, int]] = {}
        self._leaves = SortedLeaves(self._class)

    def _class(self, index: RadixIndex, block: Block, slot: int) -> tuple[int, float]:
        """(usage * length, last access): the order within which age cannot change."""
        length = self._length(block, slot) if self.params.length == "prefix" else 1
        return ((1 + index.hits(block, slot)) * length, index.recency(block, slot))

    def _length(self, block: Block, slot: int) -> int:
        d = self._depth.get(slot, {}).get(block.key)
        return d if d is not None else block.depth()

    def _priority(self, ctx: EvictionContext) -> Callable[[Block], tuple[float, float]]:
        slot, now, unit = ctx.slot, ctx.now, self.params.age_unit_s
        by_prefix = self.params.length == "prefix"
        recency, hits = ctx.index.recency, ctx.index.hits

        def priority(b: Block) -> tuple[float, float]:
            last = recency(b, slot)
            age = max(0.0, now - last) / unit
            length = self._length(b, slot) if by_prefix else 1
            return (hybrid_value(1 + hits(b, slot), length, age), last)

        return priority

    def leaf_priority(self, ctx: EvictionContext) -> Callable[[Block], tuple[float, float]] | None:
        return self._priority(ctx) if self._leaves.sorted_view(ctx) is None else None

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return run_steps(self.rank_steps(ctx, count, pinned, None))

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        return self._leaves.rank_steps(ctx, count, pinned, step, self._priority(ctx),
                                       lambda order: self._merged(order, ctx.now))

    def _merged(self, order, now: float) -> Iterator[tuple[tuple[float, float], int, Block]]:  # type: ignore[no-untyped-def]
        """Leaves by ascending (value, last access, key): a k-way merge of the classes."""
        unit = self.params.age_unit_s
        heap: list[tuple[float, float, int, int, int]] = []
        i, n = 0, len(order)
        while i < n:
            cls = order[i][0][0]
            end = order.bisect_left(((cls, math.inf),))
            (_, last), key, _ = order[i]
            heap.append((cls / (1.0 + max(0.0, now - last) / unit), last, key, i, end))
            i = end
        heapq.heapify(heap)
        while heap:
            value, last, key, i, end = heap[0]
            yield (value, last), key, order[i][2]
            if i + 1 < end:
                (cls, nlast), nkey, _ = order[i + 1]
                heapq.heapreplace(heap, (cls / (1.0 + max(0.0, now - nlast) / unit), nlast, nkey, i + 1, end))
            else:
                heapq.heappop(heap)

    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._record_depths(slot, blocks)
        self._leaves.stored(index, slot, blocks)

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._leaves.accessed(index, slot, blocks)

    def _record_depths(self, slot: int, blocks: Sequence[Block]) -> None:
        if not blocks or self.params.length != "prefix":
            return
        depths = self._depth.setdefault(slot, {})
        parent = blocks[0].parent
        d = 0 if parent is None else depths.get(parent.key) or parent.depth()
        for b in blocks:
            d += 1
            depths[b.key] = d

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        self.on_removed_many(index, slot, (block,))

    def on_removed_many(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        self._leaves.removed_many(index, slot, blocks)  # first: it re-scores parents, whose depths are kept
        depths = self._depth.get(slot)
        if depths is not None:
            for b in blocks:
                depths.pop(b.key, None)

    def on_cleared(self, slot: int) -> None:
        self._leaves.cleared(slot)
        self._depth.pop(slot, None)

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        return release_steps([*self._leaves.detach(slot), self._depth.pop(slot, {})], step)
