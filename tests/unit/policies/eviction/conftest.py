"""A one-worker cache driven the way the router drives it: index first, then the policy hook."""

from __future__ import annotations

import itertools
import random

import pytest

from kvrouterd.index.radix import Block, RadixIndex
from kvrouterd.policies import registry
from kvrouterd.policies.base import AccessInfo, EvictionContext

UNLABELLED = AccessInfo()


class Cache:
    def __init__(self, policy: str | dict, seed: int = 0, slots: int = 1) -> None:
        self.index = RadixIndex()
        for s in range(slots):
            self.index.add_slot(s)
        self.policy = registry.build("eviction", policy, random.Random(seed))

    def store(self, keys: list[int], now: float, parent: int | None = None, slot: int = 0,
              info: AccessInfo = UNLABELLED) -> list[Block]:
        blocks = self.index.store(slot, parent, keys, now)
        self.policy.on_stored(self.index, slot, blocks, info, now)
        return blocks

    def access(self, keys: list[int], now: float, slot: int = 0, info: AccessInfo = UNLABELLED) -> None:
        """A routed request reusing ``keys``: a held chain from where the slot's chain starts."""
        blocks = [self.index.get(k) for k in keys]
        top = blocks[0].parent
        assert top is None or not top.holders >> slot & 1, "access a whole held prefix"
        assert all(b.parent is a for a, b in itertools.pairwise(blocks)) and all(b.holders >> slot & 1 for b in blocks)
        self.index.touch_path(slot, blocks, now)
        self.policy.on_accessed(self.index, slot, blocks, info, now)

    def rank(self, count: int, now: float, pinned: frozenset[int] = frozenset(), slot: int = 0) -> list[int]:
        ctx = EvictionContext(self.index, slot, now)
        return [b.key for b in self.policy.rank(ctx, count, pinned)]

    def evict(self, keys: list[int], slot: int = 0) -> None:
        for k in keys:
            self.policy.on_removed(self.index, slot, self.index.get(k))
            self.index.remove(slot, k)


@pytest.fixture
def cache_of():
    return Cache
