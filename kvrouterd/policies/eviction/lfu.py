"""``lfu``: leaf LFU (systematic study, section 3.3).

Evicts the leaf with the lowest access count. A block's count is 1 when it is stored and
grows by one on every later access (a routed request reusing it, a re-store), as the paper's
"counters are incremented on each lookup". Ties, which the paper leaves open, go to the
least recently used block, then the smaller key, so the order is deterministic. As in every
leaf policy only leaves are evictable and a parent joins once its last cached child is
chosen. No parameters.

Counts and recency change only when a hook fires, so the leaves are kept sorted by the hooks
(see ``_leaves.SortedLeaves``) and ranking k blocks costs O(k log L).
"""

from __future__ import annotations

import random

from ...index.radix import Block, RadixIndex
from ._leaves import LeafOrderPolicy

__all__ = ["LFUEviction", "lfu_priority"]


def lfu_priority(index: RadixIndex, block: Block, slot: int) -> tuple[int, float]:
    """(uses, last access): lowest first."""
    return (1 + index.hits(block, slot), index.recency(block, slot))


class LFUEviction(LeafOrderPolicy):
    def __init__(self, params: object, rng: random.Random) -> None:
        super().__init__(params, rng, lfu_priority)
