"""``lru``: leaf LRU, as SGLang's radix cache evicts.

Only leaves are evictable (blocks with no cached child on that worker); the least recently
used leaf goes first, and a parent joins the candidates once its last cached child has been
chosen. Recency is the router's per-(worker, block) last access: when the block was stored
or last reused by a request routed to that worker. Ties break on the smaller key so the
order is deterministic. No parameters.

The ranking runs on a heap over the worker's current leaves: O(L + k log L) for k blocks out
of L leaves, without touching the index.
"""

from __future__ import annotations

import heapq

from ...index.radix import Block
from ..base import EvictionContext, EvictionPolicyBase
from ..registry import register


def rank_leaves_by(ctx: EvictionContext, count: int, pinned: frozenset[int], priority) -> list[Block]:  # type: ignore[no-untyped-def]
    """Pop up to ``count`` leaves lowest ``priority(block)`` first, promoting parents as they empty.

    Shared by every leaf-ordered policy (LRU, LFU, hybrid): they differ only in ``priority``.
    """
    bit = 1 << ctx.slot
    heap = [(priority(b), b.key, b) for b in ctx.leaves() if b.key not in pinned]
    heapq.heapify(heap)
    chosen: list[Block] = []
    taken: set[int] = set()
    while heap and len(chosen) < count:
        _, key, block = heapq.heappop(heap)
        chosen.append(block)
        taken.add(key)
        parent = block.parent
        if parent is None or not parent.holders & bit or parent.key in pinned:
            continue
        if all(not (c.holders & bit) or c.key in taken for c in parent.iter_children()):
            heapq.heappush(heap, (priority(parent), parent.key, parent))
    return chosen


@register("eviction", "lru")
class LRUEviction(EvictionPolicyBase):
    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return rank_leaves_by(ctx, count, pinned, ctx.recency)
