"""``hybrid``: leaf eviction by usage, length and recency (systematic study, section 3.3 and
Algorithm 2).

Each leaf gets

    value = usage * length / (1 + recency)

and the lowest value is evicted first: blocks that are reused often, end a long prefix and
were used recently are kept. As in the paper's trie, ``usage`` is the block's access count
(1 when stored, +1 per later access), ``length`` the length of the prefix the block ends, in
blocks (its depth in the tree), and ``recency`` the time since its last access on that
worker, in units of ``age_unit_s``. Ties go to the least recently used block, then the
smaller key. Only leaves are evictable; a parent joins once its last cached child is chosen.

Parameters (``HybridParams``):
    age_unit_s = 1.0   seconds that count as one unit of ``recency`` in the score

The value drifts with the clock, so leaves cannot be kept pre-sorted: each call scores the
worker's L leaves, O(L + k log L). Depths are remembered from the hooks so scoring does not
walk to the root.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...index.radix import Block, RadixIndex
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from ..registry import register
from ._leaves import rank_leaves_by

__all__ = ["HybridEviction", "HybridParams", "hybrid_value"]

_hits = RadixIndex.hits
_recency = RadixIndex.recency


@dataclass(frozen=True)
class HybridParams:
    age_unit_s: float = field(default=1.0, metadata={"help": "seconds that count as one unit of recency in the score"})

    def validate(self) -> None:
        if not self.age_unit_s > 0:
            raise ValueError(f"age_unit_s must be > 0, got {self.age_unit_s}")


def hybrid_value(usage: int, length: int, age: float) -> float:
    """The paper's score: usage * length / (1 + recency)."""
    return usage * length / (1.0 + age)


@register("eviction", "hybrid", HybridParams)
class HybridEviction(EvictionPolicyBase):
    params: HybridParams

    def __init__(self, params: HybridParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self._depth: dict[int, dict[int, int]] = {}

    def _length(self, block: Block, slot: int) -> int:
        d = self._depth.get(slot, {}).get(block.key)
        return d if d is not None else block.depth()

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        slot, now, unit = ctx.slot, ctx.now, self.params.age_unit_s

        def priority(b: Block) -> tuple[float, float]:
            last = _recency(b, slot)
            age = max(0.0, now - last) / unit
            return (hybrid_value(1 + _hits(b, slot), self._length(b, slot), age), last)

        return rank_leaves_by(ctx, count, pinned, priority)

    def on_stored(self, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        if not blocks:
            return
        depths = self._depth.setdefault(slot, {})
        parent = blocks[0].parent
        d = 0 if parent is None else depths.get(parent.key) or parent.depth()
        for b in blocks:
            d += 1
            depths[b.key] = d

    def on_removed(self, slot: int, block: Block) -> None:
        depths = self._depth.get(slot)
        if depths is not None:
            depths.pop(block.key, None)

    def on_cleared(self, slot: int) -> None:
        self._depth.pop(slot, None)
