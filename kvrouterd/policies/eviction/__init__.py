"""Eviction policies: ``POLICIES`` lists every one by the name configs and the registry use.

``kvrouterd/policies/__init__.py`` hands this list to the registry; a policy module does not
register itself. A new policy is one module here and one line below. ``SIMULATOR_ONLY`` names
the policies only the simulator can run, which the registry reserves so that a daemon naming
one is told why it cannot.
"""

from __future__ import annotations

from ..base import NoParams
from .hybrid import HybridEviction, HybridParams
from .lfu import LFUEviction
from .lru import LRUEviction
from .rlt import RLTEviction, RLTParams
from .tlru import TLRUEviction, TLRUParams
from .unicache import UniCacheEviction, UniCacheParams

__all__ = ["POLICIES", "SIMULATOR_ONLY"]

#: (name, policy class, Params dataclass), one per eviction policy
POLICIES: tuple[tuple[str, type, type], ...] = (
    ("hybrid", HybridEviction, HybridParams),
    ("lfu", LFUEviction, NoParams),
    ("lru", LRUEviction, NoParams),
    ("rlt", RLTEviction, RLTParams),
    ("tlru", TLRUEviction, TLRUParams),
    ("unicache", UniCacheEviction, UniCacheParams),
)

#: (name, why a daemon cannot build it), one per eviction policy only ``kvrouterd sim`` runs
SIMULATOR_ONLY: tuple[tuple[str, str], ...] = (
    ("belady", "is the simulator's clairvoyant bound (it evicts by each block's next use in a workload "
               "known in advance, which a daemon cannot see): run it with `kvrouterd sim cluster --eviction belady`"),
)
