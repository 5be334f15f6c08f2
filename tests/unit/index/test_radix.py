"""RadixIndex against a naive reference model, over random event sequences."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrouterd.index.radix import Block, PyBlock, RadixIndex

# Small key universe: a tree of depth <= 4 and fan-out 3 over chained ids, so that random
# sequences collide, share prefixes and remove interior blocks often.
PATHS = [tuple(p) for d in range(1, 5) for p in __import__("itertools").product(range(3), repeat=d)]
KEY = {p: 1000 + i for i, p in enumerate(PATHS)}
PATH_OF = {v: k for k, v in KEY.items()}
SLOTS = 3


class Reference:
    """What the index must mean: per slot, a set of held paths."""

    def __init__(self) -> None:
        self.held: dict[int, set[tuple]] = {s: set() for s in range(SLOTS)}
        #: (slot, path) -> (last access, hits), every block of a touched path stamped
        self.stats: dict[tuple[int, tuple], tuple[float, int]] = {}

    def hold(self, slot: int, path: tuple, now: float) -> None:
        old = self.stats.get((slot, path)) if path in self.held[slot] else None
        self.stats[slot, path] = (now, 0) if old is None else (now, old[1] + 1)
        self.held[slot].add(path)

    def use(self, slot: int, path: tuple, now: float) -> None:
        self.stats[slot, path] = (now, self.stats[slot, path][1] + 1)

    def drop(self, slot: int, path: tuple) -> None:
        self.held[slot].discard(path)
        self.stats.pop((slot, path), None)

    def overlap(self, slot: int, path: tuple) -> int:
        n = 0
        for d in range(1, len(path) + 1):
            if path[:d] in self.held[slot]:
                n = d
            else:
                break
        return n

    def leaves(self, slot: int) -> set[tuple]:
        held = self.held[slot]
        return {p for p in held if not any(q[:-1] == p for q in held)}


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RadixIndex()
        for s in range(SLOTS):
            self.index.add_slot(s)
        self.ref = Reference()
        self.now = 0.0

    @rule(slot=st.integers(0, SLOTS - 1), path=st.sampled_from(PATHS), start=st.integers(0, 3))
    def store(self, slot, path, start):
        start = min(start, len(path) - 1)
        parent = KEY[path[:start]] if start else None
        if parent is not None and parent not in self.index:
            return  # the host never stores under an unknown parent (it counts an orphan)
        self.now += 1
        self.index.store(slot, parent, [KEY[path[:d]] for d in range(start + 1, len(path) + 1)], self.now)
        for d in range(start + 1, len(path) + 1):
            self.ref.hold(slot, path[:d], self.now)

    def held_path(self, slot: int, pick: int) -> tuple | None:
        held = sorted(self.ref.held[slot])
        return held[pick % len(held)] if held else None

    @rule(slot=st.integers(0, SLOTS - 1), path=st.sampled_from([p for p in PATHS if len(p) > 1]))
    def store_under_unheld(self, slot, path):
        # a replica importing a peer's index: the blocks above one it stores that nobody held
        # on the peer (an engine evicted a chain's first blocks) are put back held by no slot
        top = len(path) - 1
        while top > 0 and KEY[path[:top]] not in self.index:
            top -= 1
        for d in range(top + 1, len(path)):
            self.index.add_unheld(KEY[path[:d]], KEY[path[:d - 1]] if d > 1 else None)
        self.now += 1
        self.index.store(slot, KEY[path[:-1]], [KEY[path]], self.now)
        self.ref.hold(slot, path, self.now)

    @rule(slot=st.integers(0, SLOTS - 1), pick=st.integers(0, 1 << 16), dt=st.sampled_from([0.0, 1.0]))
    def touch_path(self, slot, pick, dt):
        # the held chain ending at a held block, from where the slot's chain starts (a
        # matched prefix when that is the root; a gap above it after interior removals)
        path = self.held_path(slot, pick)
        if path is None:
            return
        start = len(path)
        while start > 1 and path[:start - 1] in self.ref.held[slot]:
            start -= 1
        self.now += dt
        self.index.touch_path(slot, [self.index.get(KEY[path[:d]]) for d in range(start, len(path) + 1)], self.now)
        for d in range(start, len(path) + 1):
            self.ref.use(slot, path[:d], self.now)

    @rule(slot=st.integers(0, SLOTS - 1), pick=st.integers(0, 1 << 16))
    def touch_one(self, slot, pick):
        path = self.held_path(slot, pick)
        if path is None:
            return
        self.now += 1
        self.index.touch(slot, [self.index.get(KEY[path])], self.now)
        self.ref.use(slot, path, self.now)

    @rule(slot=st.integers(0, SLOTS - 1), path=st.sampled_from(PATHS))
    def remove(self, slot, path):
        # includes interior blocks and blocks the slot does not hold (a duplicate removal)
        changed = self.index.remove(slot, KEY[path])
        assert changed == (path in self.ref.held[slot])
        self.ref.drop(slot, path)

    @rule(slot=st.integers(0, SLOTS - 1), pick=st.integers(0, 1 << 16))
    def remove_held(self, slot, pick):
        path = self.held_path(slot, pick)
        if path is not None:
            assert self.index.remove(slot, KEY[path])
            self.ref.drop(slot, path)

    @rule(slot=st.integers(0, SLOTS - 1))
    def clear(self, slot):
        assert self.index.clear(slot) == len(self.ref.held[slot])
        for path in list(self.ref.held[slot]):
            self.ref.drop(slot, path)

    @precondition(lambda self: True)
    @rule(path=st.sampled_from(PATHS), mask=st.integers(1, 2**SLOTS - 1))
    def match(self, path, mask):
        keys = [KEY[path[:d]] for d in range(1, len(path) + 1)]
        result = self.index.match(keys, mask)
        for s in range(SLOTS):
            want = self.ref.overlap(s, path) if mask >> s & 1 else 0
            assert result.overlap(s) == want, (s, path)
        assert len(result.path) == max([result.overlap(s) for s in range(SLOTS)] + [0])

    @invariant()
    def counts_leaves_and_membership_agree(self):
        for s in range(SLOTS):
            assert self.index.count(s) == len(self.ref.held[s])
            # the view made once with the index follows every change (cache_aware's ties read it)
            assert self.index.counts[s] == len(self.ref.held[s])
            others = set().union(*(self.ref.held[t] for t in range(SLOTS) if t != s))
            assert self.index.count_alone(s) == len(self.ref.held[s] - others)
            assert {PATH_OF[b.key] for b in self.index.leaves(s)} == self.ref.leaves(s)
            assert {PATH_OF[b.key] for b in self.index.blocks_of(s)} == self.ref.held[s]

    @invariant()
    def stats_are_those_of_stamping_every_block(self):
        # touch_path stamps only the deepest block; every read must still see the full stamp
        for (slot, path), (last, hits) in self.ref.stats.items():
            block = self.index.get(KEY[path])
            assert (self.index.recency(block, slot), self.index.hits(block, slot)) == (last, hits), (slot, path)

    @invariant()
    def no_dead_blocks_linger(self):
        # every indexed block is held by someone or has a descendant that is
        for key in list(self.index._blocks):
            block = self.index.get(key)
            assert block.holders or block.children is not None
            parent = block.parent
            if parent is not None:
                assert any(c is block for c in parent.iter_children())

    @invariant()
    def unheld_counts_the_blocks_no_slot_holds(self):
        assert self.index.unheld == sum(not self.index.get(k).holders for k in list(self.index._blocks))

    @invariant()
    def pending_accesses_only_on_held_blocks(self):
        # the side table holds an entry only for an indexed block, for slots that hold it, and
        # in the shape of its stats (a scalar while one slot holds it)
        for block, up in self.index._pending.items():
            assert self.index.get(block.key) is block
            if type(up) is dict:
                assert up and type(block.last_access) is dict
                assert all(block.holders >> s & 1 for s in up)
            else:
                assert block.holders and block.holders & (block.holders - 1) == 0


TestIndexAgainstReference = IndexMachine.TestCase
TestIndexAgainstReference.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_per_worker_stats_survive_sharing_and_unsharing():
    index = RadixIndex()
    index.add_slot(0)
    index.add_slot(5)
    (b,) = index.store(0, None, [1], now=1.0)
    index.touch(0, [b], now=2.0)
    index.store(5, None, [1], now=3.0)
    assert index.recency(b, 0) == 2.0 and index.hits(b, 0) == 1
    assert index.recency(b, 5) == 3.0 and index.hits(b, 5) == 0
    index.touch(5, [b], now=4.0)
    index.remove(0, 1)
    assert index.recency(b, 5) == 4.0 and index.hits(b, 5) == 1


def test_match_stops_at_first_missing_block_per_worker():
    index = RadixIndex()
    index.add_slot(0)
    index.add_slot(1)
    index.store(0, None, [1, 2, 3, 4], now=0)
    index.store(1, None, [1, 2], now=0)
    index.remove(0, 2)  # interior removal: blocks 3 and 4 stay cached but are unreachable
    result = index.match([1, 2, 3, 4], 0b11)
    assert result.overlap(0) == 1 and result.overlap(1) == 2
    assert {b.key for b in index.leaves(0)} == {1, 4}


def test_the_counts_view_follows_slots_added_dropped_and_refilled_and_cannot_be_written():
    index = RadixIndex()
    counts = index.counts
    index.add_slot(0)
    index.add_slot(3)
    index.store(3, None, [1, 2, 3], now=0)
    assert (counts[0], counts[3]) == (0, 3)
    index.drop_slot(3)
    assert 3 not in counts
    index.add_slot(3)
    index.store(3, None, [7], now=0)
    assert counts[3] == 1 and index.counts is counts
    with pytest.raises(TypeError):
        counts[0] = 5  # type: ignore[index]


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=30, unique=True))
def test_drop_slot_frees_everything(keys):
    index = RadixIndex()
    index.add_slot(0)
    index.store(0, None, keys, now=0)
    assert index.drop_slot(0) == len(keys)
    assert len(index) == 0


@pytest.mark.parametrize("pure", [False, True])
def test_a_chain_naming_indexed_blocks_out_of_order_keeps_every_held_block_a_leaf_or_above_one(pure):
    # issue #28 item 2: Route stores the block keys a client sent for an approximate-mode
    # worker, and they need not chain. Block 2 hangs under 1 in the tree; a chain [9, 2] made
    # the new block 9 a parent's place holder and took it out of the slot's leaves, so clearing
    # the slot missed it and its bit outlived the slot: KeyError(1 << slot) from the next
    # store or removal of that block
    index = RadixIndex(pure=pure)
    for s in range(2):
        index.add_slot(s)
    index.store(0, None, [1, 2], now=0)
    index.store(1, None, [9, 2, 3], now=1)
    assert {b.key for b in index.leaves(1)} == {9, 3}
    assert index.drop_slot(1) == 3
    assert all(index.get(k).holders == 1 for k in (1, 2)) and 9 not in index and 3 not in index
    index.add_slot(1)
    index.store(1, None, [1], now=2)  # shared again, then alone again: the counts by bit agree
    assert index.remove(0, 1) and index.count_alone(1) == 1 and index.count_alone(0) == 1


def _pending_everywhere(index: RadixIndex, slots: range) -> None:
    """Stores shared and private chains, with gaps, and routes over every held chain."""
    now = 0.0
    for s in slots:
        index.store(s, None, [1, 2, 3, 4], now=now)
        index.store(s, 2, [10 + s, 20 + s], now=now)
    index.remove(0, 3)  # a gap: block 4 starts a chain of its own on slot 0
    for s in slots:
        for leaf in (4, 20 + s):
            now += 1.0
            chain, node = [], index.get(leaf)
            while node is not None and node.holders >> s & 1:
                chain.append(node)
                node = node.parent
            index.touch_path(s, chain[::-1], now)
    assert index._pending


def test_clearing_and_dropping_every_slot_leaves_no_pending_accesses():
    index = RadixIndex()
    for s in range(3):
        index.add_slot(s)
    _pending_everywhere(index, range(3))
    index.clear(1)
    index.clear(2)
    assert all(type(up) is not dict for up in index._pending.values())  # slot 0 alone is left
    assert index.drop_slot(0) > 0
    assert index._pending == {} and len(index) == 0


def test_removing_every_block_leaves_no_pending_accesses():
    index = RadixIndex()
    for s in range(3):
        index.add_slot(s)
    _pending_everywhere(index, range(3))
    for s in range(3):
        for key in (2, 4, 1, 20 + s, 10 + s, 3):  # interior blocks first, then what hangs under them
            index.remove(s, key)
    assert index._pending == {} and len(index) == 0


def test_a_block_is_as_small_as_its_six_fields_allow():
    # pending accesses live on the index, not the block: another field would move every block
    # to the next allocator size class (+16 bytes per indexed block, see ``kvrouterd bench``)
    class SixSlots:
        __slots__ = ("a", "b", "c", "d", "e", "f")

    assert len(PyBlock.__slots__) == 6
    assert sys.getsizeof(PyBlock(1, None)) == sys.getsizeof(SixSlots())
    if Block is not PyBlock:  # the C twin: header, inline key, parent, children, shared stats
        assert sys.getsizeof(Block(1, None)) == 48
