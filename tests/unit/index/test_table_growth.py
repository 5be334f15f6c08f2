"""The native tables grow incrementally and stay exact while they do (issue #16 item 1).

A growing ``U64Map``, ``BlockTable`` or ``LeafOrder`` keeps its smaller array beside the new
one and moves at most ``MIGRATE_SLOTS`` of its slots per insert or delete; lookups read both.
State machines drive each table against a dict through many growths with every operation
interleaved into the migrations (deletes, overwrites, iteration, clear), and structural tests
count the entries left to move (``growth_pending``) to show no call moves more than its share.
The pure-Python index uses dicts (CPython's growth), so these only run with the extension.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvrouterd.index import native
from kvrouterd.index.radix import Block

pytestmark = pytest.mark.skipif(native.module is None, reason="the native tables are not in use")

MIGRATE_SLOTS = native.module.MIGRATE_SLOTS if native.module is not None else 0


def _spread(n: int) -> int:
    # distinct keys over the whole uint64 range, some of them colliding in small tables
    return (0x9E3779B97F4A7C15 * (n + 1)) % 2**64


class U64MapMachine(RuleBasedStateMachine):
    """A U64Map against a dict, with runs of inserts that start a growth and operations in
    between while it migrates."""

    def __init__(self) -> None:
        super().__init__()
        self.m = native.module.U64Map()
        self.d: dict[int, int] = {}
        self.fresh = 0

    def _new_key(self) -> int:
        self.fresh += 1
        return _spread(self.fresh)

    @rule(n=st.integers(1, 40), value=st.integers(0, 2**64 - 1))
    def insert_new(self, n: int, value: int) -> None:
        for _ in range(n):
            k = self._new_key()
            self.m[k] = value
            self.d[k] = value

    @rule(value=st.integers(0, 2**64 - 1))
    def insert_until_growing(self, value: int) -> None:
        """Inserts until a growth starts: the operations that follow run during its migration."""
        while self.m.growth_pending == 0:
            k = self._new_key()
            self.m[k] = value
            self.d[k] = value
        assert 0 < self.m.growth_pending < len(self.m)

    @precondition(lambda self: self.d)
    @rule(pick=st.integers(0, 2**32), value=st.integers(0, 2**64 - 1))
    def overwrite(self, pick: int, value: int) -> None:
        k = list(self.d)[pick % len(self.d)]
        self.m[k] = value
        self.d[k] = value

    @precondition(lambda self: self.d)
    @rule(pick=st.integers(0, 2**32), count=st.integers(1, 30), how=st.sampled_from(["del", "pop"]))
    def delete(self, pick: int, count: int, how: str) -> None:
        keys = list(self.d)
        for i in range(count):
            k = keys[(pick + i * 7919) % len(keys)]
            if k not in self.d:
                continue
            if how == "del":
                del self.m[k]
            else:
                assert self.m.pop(k) == self.d[k]
            del self.d[k]

    @rule(n=st.integers(0, 2**20))
    def missing(self, n: int) -> None:
        k = _spread(2**40 + n)  # never inserted
        assert k not in self.m and self.m.get(k, "none") == "none" and self.m.pop(k, None) is None
        with pytest.raises(KeyError):
            del self.m[k]

    @precondition(lambda self: self.d)
    @rule(pick=st.integers(0, 2**32))
    def lookup(self, pick: int) -> None:
        k = list(self.d)[pick % len(self.d)]
        assert self.m[k] == self.d[k] and self.m.get(k) == self.d[k] and k in self.m

    @rule()
    def iterate(self) -> None:
        assert sorted(self.m.items()) == sorted(self.d.items())
        assert sorted(self.m) == sorted(self.d) and sorted(self.m.values()) == sorted(self.d.values())
        packed = memoryview(self.m.packed_items()).cast("Q")
        assert sorted(zip(packed[::2], packed[1::2])) == sorted(self.d.items())

    @rule()
    def clear(self) -> None:
        self.m.clear()
        self.d.clear()
        assert self.m.growth_pending == 0

    @rule(n=st.integers(1, 60))
    def map_pairs(self, n: int) -> None:
        sources = [self._new_key() for _ in range(n)]
        targets = [s ^ 1 for s in sources]
        assert self.m.map_pairs(sources, targets) == n
        self.d.update(zip(sources, targets))

    @invariant()
    def sized_alike(self) -> None:
        assert len(self.m) == len(self.d)
        assert 0 <= self.m.growth_pending <= len(self.d)

    def teardown(self) -> None:
        assert dict(self.m.items()) == self.d


TestU64MapGrowth = U64MapMachine.TestCase
TestU64MapGrowth.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class BlockTableMachine(RuleBasedStateMachine):
    """A BlockTable against a dict of the same Blocks, through growths and migrations; every
    reference the table takes is given back."""

    def __init__(self) -> None:
        super().__init__()
        self.t = native.module.BlockTable()
        self.d: dict[int, Block] = {}
        self.fresh = 0
        self.made: list[Block] = []

    def _new_block(self) -> Block:
        self.fresh += 1
        b = Block(_spread(self.fresh), None)
        b.holders = 1  # held by slot 0, for the walk
        self.made.append(b)
        return b

    def _put(self, b: Block) -> None:
        self.t[b.key] = b
        self.d[b.key] = b

    @rule(n=st.integers(1, 40))
    def insert_new(self, n: int) -> None:
        for _ in range(n):
            self._put(self._new_block())

    @rule()
    def insert_until_growing(self) -> None:
        while self.t.growth_pending == 0:
            self._put(self._new_block())
        assert 0 < self.t.growth_pending < len(self.t)

    @precondition(lambda self: self.d)
    @rule(pick=st.integers(0, 2**32))
    def replace(self, pick: int) -> None:
        k = list(self.d)[pick % len(self.d)]
        b = Block(k, None)  # another Block under the same key: the first is released
        b.holders = 1
        self.made.append(b)
        self._put(b)

    @precondition(lambda self: self.d)
    @rule(pick=st.integers(0, 2**32), count=st.integers(1, 30), how=st.sampled_from(["del", "pop"]))
    def delete(self, pick: int, count: int, how: str) -> None:
        keys = list(self.d)
        for i in range(count):
            k = keys[(pick + i * 7919) % len(keys)]
            if k not in self.d:
                continue
            if how == "del":
                del self.t[k]
            else:
                assert self.t.pop(k) is self.d[k]
            del self.d[k]

    @precondition(lambda self: self.d)
    @rule(pick=st.integers(0, 2**32))
    def lookup(self, pick: int) -> None:
        k = list(self.d)[pick % len(self.d)]
        assert self.t[k] is self.d[k] and self.t.get(k) is self.d[k] and k in self.t

    @rule(n=st.integers(0, 2**20))
    def missing(self, n: int) -> None:
        k = _spread(2**40 + n)
        assert k not in self.t and self.t.get(k) is None and self.t.pop(k, "none") == "none"

    @rule()
    def iterate(self) -> None:
        assert sorted(self.t.keys()) == sorted(self.d)
        assert dict(self.t.items()) == self.d
        assert sorted(map(id, self.t.values())) == sorted(map(id, self.d.values()))

    @rule()
    def walk(self) -> None:
        # the native match walk reads both arrays: every key is found, in order, up to a miss
        keys = list(self.d)[-50:]
        _, path = native.module.match_walk(self.t, keys + [_spread(2**41)] + keys[:1], 1)
        assert [b.key for b in path] == keys and all(b is self.d[b.key] for b in path)

    @rule()
    def clear(self) -> None:
        self.t.clear()
        self.d.clear()
        assert self.t.growth_pending == 0

    @invariant()
    def sized_alike(self) -> None:
        assert len(self.t) == len(self.d)
        assert 0 <= self.t.growth_pending <= len(self.d)

    def teardown(self) -> None:
        assert dict(self.t.items()) == self.d
        # the table's references are exactly one per Block it holds, and go with it
        held = {id(b) for b in self.d.values()}
        self.d.clear()
        counts = [sys.getrefcount(b) for b in self.made]
        del self.t
        assert [sys.getrefcount(b) for b in self.made] == [c - (id(b) in held) for b, c in zip(self.made, counts)]


TestBlockTableGrowth = BlockTableMachine.TestCase
TestBlockTableGrowth.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("entries", [5_000, 120_000])
def test_a_u64map_growth_moves_at_most_its_share_per_insert(entries):
    """The insert that crosses the load moves no more than any other (no re-insert of every
    entry), each later insert or delete moves at most MIGRATE_SLOTS slots' entries, and the
    migration is over before the next growth. 120k entries: arrays mapped (and the next one
    mapped ahead) rather than from the heap."""
    m = native.module.U64Map()
    k = 0
    growths = 0
    while len(m) < entries:
        before = len(m) - m.growth_pending  # entries already in the new array (all when not growing)
        pending_before = m.growth_pending
        m[_spread(k)] = k
        k += 1
        if pending_before == 0 and m.growth_pending:
            growths += 1
            # the growing insert moved at most MIGRATE_SLOTS slots' entries out of the old array
            assert m.growth_pending >= len(m) - 1 - MIGRATE_SLOTS
        elif pending_before:
            assert pending_before - m.growth_pending <= MIGRATE_SLOTS
            assert len(m) - m.growth_pending - before <= MIGRATE_SLOTS + 1
            if k % 3 == 0:  # deletes step the migration too, by as little
                victim = _spread(k - 2)
                pending = m.growth_pending
                del m[victim]
                assert 0 <= pending - m.growth_pending <= MIGRATE_SLOTS + 1
                m[victim] = k - 2
    assert growths >= 8
    assert all(m[_spread(i)] == i for i in range(k))


def test_a_block_table_growth_moves_at_most_its_share_per_store():
    """Through RadixIndex's native store (the ingest path): one 512-block stored chain moves at
    most 512 x MIGRATE_SLOTS slots' blocks of a growing table, and a growth is never done in
    one call. At 300k blocks the table's arrays are mapped (the old one released behind the walk)."""
    from kvrouterd.index.radix import RadixIndex

    index = RadixIndex()
    index.add_slot(0)
    table = index._blocks
    data = bytes(range(256)) * (512 * 16 * 4 // 256)
    growths = 0
    for n in range(600):
        pending = table.growth_pending
        size = len(table)
        index.store_hashed(0, None, data, 16, n + 1, 0.0)  # a distinct chain per seed
        assert len(table) == size + 512
        if pending == 0 and table.growth_pending:
            growths += 1
            assert table.growth_pending >= size - 512 * MIGRATE_SLOTS
        elif pending:
            assert pending - table.growth_pending <= 512 * MIGRATE_SLOTS
    assert growths >= 3 and len(table) == 600 * 512


def test_a_leaf_order_grows_its_table_incrementally():
    """LeafOrder's Block -> priority table (half full, doubling) migrates as the others do,
    and its order and lookups stay exact meanwhile."""
    order = native.module.LeafOrder()
    blocks = [Block(_spread(i), None) for i in range(3_000)]
    seen_growing = 0
    for i, b in enumerate(blocks):
        pending = order.growth_pending
        order.put(b, float(i % 97))
        if pending:
            assert pending - order.growth_pending <= MIGRATE_SLOTS
        if order.growth_pending:
            seen_growing += 1
            # during the migration: every leaf found, drops and re-scores exact
            j = i // 2
            assert order.get(blocks[j]) == float(j % 97)
            order.drop(blocks[j])
            assert not order.holds(blocks[j])
            order.put(blocks[j], float(j % 97))
    assert seen_growing > 0 and len(order) == len(blocks)
    entries = order.part(None, len(blocks))
    assert [(p, k) for p, k, _ in entries] == sorted((float(i % 97), b.key) for i, b in enumerate(blocks))


def _new_u64map():
    return native.module.U64Map(718)  # 898 slots: the walk's last step can leave one old slot


def _put_u64(table, key, i):
    table[key] = i


def _new_block_table():
    return native.module.BlockTable()


def _put_block(table, key, i):
    table[key] = native.module.Block(key, None)


def _one_entry_left_to_move(new, put, seeds=range(200)):
    """A table mid-migration with one entry left in its old array, the keys inserted and that
    entry's key: iteration lists the new array's entries, then the old one's."""
    import random

    for seed in seeds:
        rng = random.Random(seed)
        keys = [rng.getrandbits(64) for _ in range(3000)]
        table = new()
        for n, key in enumerate(keys, 1):
            put(table, key, n - 1)
            if table.growth_pending == 1 and n > 100:
                return table, keys[:n], list(table.keys())[-1]
    raise AssertionError("no insert sequence left one entry in the old array")


@pytest.mark.parametrize(("new", "put"), [(_new_u64map, _put_u64), (_new_block_table, _put_block)], ids=["U64Map", "BlockTable"])
def test_a_delete_that_empties_the_old_array_ends_the_migration(new, put):
    """Review of d617e8a: deleting the old array's last entry before the walk reached it left an
    empty old array behind, never freed, and the next growth then walked it forever with the GIL
    held (a publisher choosing engine hashes could do it on purpose). The delete now ends the
    migration, and the table keeps growing and answering exactly."""
    table, keys, last = _one_entry_left_to_move(new, put)
    growing = table.__sizeof__()
    table.pop(last)
    assert table.growth_pending == 0
    assert table.__sizeof__() < growing  # the emptied old array is released
    expected = {k: i for i, k in enumerate(keys) if k != last}
    n = len(keys)
    for i in range(n, n + 1500):  # past the next growth and into the one after
        key = (0x9E3779B97F4A7C15 * (i + 7)) % 2**64
        put(table, key, i)
        expected[key] = i
    assert len(table) == len(expected) and table.growth_pending >= 0
    assert sorted(table.keys()) == sorted(expected)
    if isinstance(table, native.module.U64Map):
        assert all(table[k] == v for k, v in expected.items())


@pytest.mark.parametrize("expected", [915_187_302_881_714_300, 2**62, 2**63 - 1])
def test_a_u64map_sized_past_memory_is_refused_not_wrapped(expected):
    """Review of d617e8a: U64Map(expected)'s byte count wrapped for expected near 2**60, so a
    2 KB table stood for 10**18 slots and the first insert wrote past it."""
    with pytest.raises((ValueError, MemoryError)):
        native.module.U64Map(expected)
