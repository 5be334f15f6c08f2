"""``touch_path`` stamps only the deepest block of a reused prefix; no eviction may notice.

Every policy is driven twice through the same random history of stores (under held blocks,
blocks another worker holds, or the root), reused prefixes, removals (interior blocks too,
as engines report them), partial evictions and clears: once on the index as it is, once on an
index that stamps every block of the prefix (what ``touch_path`` stands for). Every ranking,
with the hooks and from the index alone, and every block's recency and hits must agree.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.index.radix import Block, RadixIndex
from kvrouterd.policies import registry
from kvrouterd.policies.base import EvictionContext

from .conftest import Cache
from .test_eviction_rules import INFOS, POLICIES, VARIANTS

SLOTS = 2


class StampEveryBlock(RadixIndex):
    """The reference: a reused prefix stamps each of its blocks."""

    def touch_path(self, slot: int, path: Sequence[Block], now: float) -> None:
        self.touch(slot, path, now)


def caches(policy) -> tuple[Cache, Cache]:  # type: ignore[no-untyped-def]
    lazy, full = Cache(policy, seed=3, slots=SLOTS), Cache(policy, seed=3, slots=SLOTS)
    full.index = StampEveryBlock()
    for s in range(SLOTS):
        full.index.add_slot(s)
    return lazy, full


def held_chain(index: RadixIndex, slot: int, key: int) -> list[int]:
    """The held chain ending at ``key``, from where the slot's chain of held blocks starts."""
    node, path = index.get(key), []
    while node is not None and node.holders >> slot & 1:
        path.append(node.key)
        node = node.parent
    return path[::-1]


def same_state(lazy: Cache, full: Cache, now: float, policy) -> None:  # type: ignore[no-untyped-def]
    for slot in range(SLOTS):
        held = sorted(b.key for b in full.index.blocks_of(slot))
        assert sorted(b.key for b in lazy.index.blocks_of(slot)) == held
        for key in held:
            a, b = lazy.index.get(key), full.index.get(key)
            assert (lazy.index.recency(a, slot), lazy.index.hits(a, slot)) == \
                (full.index.recency(b, slot), full.index.hits(b, slot)), (slot, key)
        # ranking from the index alone (a policy that saw no hooks), every block
        fresh = [registry.build("eviction", policy, random.Random(5)) for _ in range(2)]
        answers = [[b.key for b in p.rank(EvictionContext(c.index, slot, now), len(held) + 1, frozenset())]
                   for p, c in zip(fresh, (lazy, full))]
        assert answers[0] == answers[1]


@st.composite
def histories(draw):  # type: ignore[no-untyped-def]
    kinds = ["store", "store", "access", "access", "access", "remove", "remove", "evict", "clear"]
    return [(draw(st.sampled_from(kinds)), draw(st.integers(0, SLOTS - 1)), draw(st.integers(0, 1 << 16)),
             draw(st.integers(1, 4)), draw(st.integers(0, len(INFOS) - 1)), draw(st.sampled_from([0.0, 0.5, 3.0, 90.0])))
            for _ in range(draw(st.integers(1, 40)))]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=histories(), policy=st.sampled_from([*POLICIES, *VARIANTS]))
def test_touching_the_deepest_block_ranks_as_touching_every_block(ops, policy):
    lazy, full = caches(policy)
    now, next_key = 0.0, 1
    for kind, slot, pick, n, info_i, dt in ops:
        now += dt  # never backwards, and often a tie
        info = INFOS[info_i]
        held = sorted(b.key for b in full.index.blocks_of(slot))
        anywhere = sorted(full.index._blocks)
        if kind == "store":
            # under one of its own blocks, under another worker's (a gap), or a new root
            choice = pick % 3
            parent = (held[pick % len(held)] if choice == 0 and held else
                      anywhere[pick % len(anywhere)] if choice == 1 and anywhere else None)
            keys = list(range(next_key, next_key + n))
            if pick % 5 < 2 and held:
                # re-store a block the index knows under its parent: one the slot holds (touched
                # one by one) or not (filling a gap above blocks it holds, after a removal)
                block = full.index.get((held if pick % 5 == 0 else anywhere)[pick % (len(held) if pick % 5 == 0 else len(anywhere))])
                keys = [block.key]
                parent = block.parent.key if block.parent is not None else None
            else:
                next_key += n
            for c in (lazy, full):
                c.store(keys, now, parent=parent, slot=slot, info=info)
        elif kind == "access" and held:
            path = held_chain(full.index, slot, held[pick % len(held)])
            for c in (lazy, full):
                c.access(path, now, slot=slot, info=info)
        elif kind == "remove" and held:  # any held block, as an engine may report it
            for c in (lazy, full):
                c.evict([held[pick % len(held)]], slot=slot)
        elif kind == "evict":
            pinned = frozenset(held[pick % len(held):][:n]) if held and pick % 2 else frozenset()
            out = lazy.rank(n, now, pinned, slot=slot)
            assert out == full.rank(n, now, pinned, slot=slot)
            for c in (lazy, full):
                c.evict(out[: max(1, len(out) // 2)], slot=slot)  # engines may follow part of a hint
        elif kind == "clear":
            for c in (lazy, full):
                c.policy.on_cleared(slot)
                c.index.clear(slot)
        same_state(lazy, full, now + 1.0, policy)
    for slot in range(SLOTS):
        count = full.index.count(slot) + 1
        assert lazy.rank(count, now + 1e4, slot=slot) == full.rank(count, now + 1e4, slot=slot)


def test_a_parent_ranks_with_the_uses_recorded_on_its_children(cache_of):
    c = cache_of("lfu")
    c.store([1, 2], now=0.0)
    c.store([3], now=0.0, parent=2)
    c.store([4], now=0.0, parent=2)
    c.store([10], now=0.0)
    for t, leaf in ((1.0, 3), (2.0, 3), (3.0, 4), (4.0, 4)):
        c.access([1, 2, leaf], now=t)  # recorded on the leaf only
    for t in (5.0, 6.0, 7.0):
        c.access([10], now=t)
    # uses: 3 and 4 three each, 10 four; 2 (promoted once 3 and 4 are chosen) and 1 five
    assert c.rank(5, now=8.0) == [3, 4, 10, 2, 1]
    c.evict([3, 4])
    assert [c.index.hits(c.index.get(k), 0) for k in (1, 2)] == [4, 4]
    assert c.rank(3, now=8.0) == [10, 2, 1]
