"""``lru``: leaf LRU, as SGLang's radix cache evicts (systematic study, section 3.3).

Only leaves are evictable (blocks with no cached child on that worker); the least recently
used leaf goes first, and a parent joins the candidates once its last cached child has been
chosen. Recency is the router's per-(worker, block) last access: when the block was stored
or last reused by a request routed to that worker. Ties break on the smaller key so the
order is deterministic. No parameters.

The policy keeps each worker's leaves sorted by recency, updated by the hooks, so ranking k
blocks costs O(k log L) for L leaves (in the extension's ``LeafOrder`` where it is built, the
stored hook one C call per event: ``_leaves.SortedLeaves``); without the hooks (a policy built just for one
``EvictHint``) it heapifies the leaves instead (``_leaves.rank_leaves_by``). Either way
``rank`` does not change the index.
"""

from __future__ import annotations

import random

from ...index.radix import RadixIndex
from ._leaves import LeafOrderPolicy, rank_leaves_by

__all__ = ["LRUEviction", "rank_leaves_by"]


#: a leaf's priority ``(index, block, slot)``: RadixIndex.recency itself, unbound (no extra call per leaf)
_recency = RadixIndex.recency


class LRUEviction(LeafOrderPolicy):
    def __init__(self, params: object, rng: random.Random) -> None:
        super().__init__(params, rng, _recency, numeric=True)  # a float: kept natively (LeafOrder)
