"""The leaf tracker's containers: the native ``LeafOrder`` (``_native.c``) and its reference
``PyLeafOrder`` (``_leaves.py``), alone and under every policy that keeps its leaves in them.

A container is driven by random puts, drops and reads against a plain model (a dict and
``sorted``), with enough leaves that the native one splits and merges its runs. Every policy is
driven by random stores, accesses, removals, clears and rankings (at once and in parts with
events between the parts) on two caches, one on the native index (lru's leaves in a
``LeafOrder``) and one on ``RadixIndex(pure=True)`` (PyBlocks, the reference containers): they
must rank alike and keep the same order. With ``KVROUTERD_PURE_PYTHON=1`` both caches and
containers are the reference, and the tests hold it against the model and itself.
"""

from __future__ import annotations

import gc
import math
import random
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.index import native
from kvrouterd.index.radix import Block, RadixIndex
from kvrouterd.policies import registry
from kvrouterd.policies.base import AccessInfo, EvictionContext, drop_blocks
from kvrouterd.policies.eviction._leaves import LeafOrder, PyLeafOrder, leaf_order

CONTAINERS = [PyLeafOrder] if LeafOrder is None else [PyLeafOrder, LeafOrder]


def _blocks(n: int) -> list[Block]:
    # keys spread over the whole uint64 range (the order compares them unsigned)
    return [Block((0x9E3779B97F4A7C15 * (i + 1)) % 2**64, None) for i in range(n)]


class _Model:
    """What a container must hold: block -> priority, ordered by (priority, key)."""

    def __init__(self) -> None:
        self.prio: dict[Block, float] = {}

    def entries(self) -> list[tuple[float, int, Block]]:
        return sorted(((p, b.key, b) for b, p in self.prio.items()), key=lambda e: (e[0], e[1]))

    def part(self, after: tuple[float, int] | None, n: int) -> list[tuple[float, int, Block]]:
        return [e for e in self.entries() if after is None or (e[0], e[1]) > after][:n]


def _check(order, model: _Model, blocks: list[Block], rng: random.Random) -> None:  # type: ignore[no-untyped-def]
    want = model.entries()
    assert len(order) == len(want)
    assert [(p, k) for p, k, _ in order] == [(p, k) for p, k, _ in want]
    assert all(got[2] is w[2] for got, w in zip(order, want))
    for b in rng.sample(blocks, min(8, len(blocks))):
        assert order.holds(b) == (b in model.prio)
        assert order.get(b, "none") == model.prio.get(b, "none")
    cursor = None if not want or rng.random() < 0.3 else (lambda e: (e[0], e[1]))(rng.choice(want))
    n = rng.randrange(0, 40)
    got = order.part(cursor, n)
    assert [(p, k) for p, k, _ in got] == [(p, k) for p, k, _ in model.part(cursor, n)]


@pytest.mark.parametrize("container", CONTAINERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), pool=st.sampled_from([5, 60, 1500]), ties=st.sampled_from([3, 1000]),
       ops=st.sampled_from([1, 40, 700, 2500]))
def test_a_container_holds_what_the_model_holds(container, seed, pool, ties, ops):
    """put (new or re-scored, the same priority again), drop (held or not), holds, get, len,
    iteration and part, on few or many leaves (the native runs split past 512 and merge below
    64), with priorities drawn from few values (ties broken by key) or many."""
    rng = random.Random(seed)
    blocks = _blocks(pool)
    order, model = container(), _Model()
    for i in range(ops):
        b = rng.choice(blocks)
        if rng.random() < 0.6:
            p = float(rng.randrange(ties)) if rng.random() < 0.9 else model.prio.get(b, 0.5)
            order.put(b, p)
            model.prio[b] = p
        else:
            order.drop(b)
            model.prio.pop(b, None)
        if i % 500 == 0 or i == ops - 1:
            _check(order, model, blocks, rng)
    order.clear()
    assert len(order) == 0 and list(order) == [] and not order.holds(blocks[0])


@pytest.mark.parametrize("container", CONTAINERS)
def test_a_container_through_many_runs_and_back(container):
    """5,000 leaves put in random order (the native runs split many times), half re-scored,
    then dropped in random order down to none (runs merge and go)."""
    rng = random.Random(12)
    blocks = _blocks(5000)
    order, model = container(), _Model()
    for b in rng.sample(blocks, len(blocks)):
        p = float(rng.randrange(100))
        order.put(b, p)
        model.prio[b] = p
    _check(order, model, blocks, rng)
    for b in blocks[::2]:
        p = model.prio[b] + rng.choice([-0.5, 0.0, 250.0])
        order.put(b, p)
        model.prio[b] = p
    _check(order, model, blocks, rng)
    for i, b in enumerate(rng.sample(blocks, len(blocks))):
        order.drop(b)
        del model.prio[b]
        if i in (2500, 4500, 4990):
            _check(order, model, blocks, rng)
    _check(order, model, blocks, rng)


@pytest.mark.skipif(LeafOrder is None, reason="no native LeafOrder (KVROUTERD_PURE_PYTHON=1 or not built)")
def test_the_native_container_refuses_what_it_cannot_keep():
    order = LeafOrder()
    b = _blocks(1)[0]
    with pytest.raises(TypeError, match="native Blocks"):
        order.put(object(), 1.0)
    with pytest.raises(TypeError, match="real numbers"):
        order.put(b, (1, 2.0))  # lfu's kind of priority stays in a PyLeafOrder
    with pytest.raises(ValueError, match="NaN"):
        order.put(b, math.nan)
    assert len(order) == 0 and not order.holds(b)
    order.put(b, 3)  # an int is a real number: kept as 3.0
    assert order.get(b) == 3.0 and list(order) == [(3.0, b.key, b)]
    with pytest.raises(TypeError, match="native Blocks, not str"):
        order.stored(RadixIndex(), 0, [b, "not a Block"], lambda *a: 0.0)
    assert list(order) == [(3.0, b.key, b)]  # refused before any change
    it = iter(order)
    order.drop(b)
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(it)


@pytest.mark.skipif(LeafOrder is None, reason="no native LeafOrder (KVROUTERD_PURE_PYTHON=1 or not built)")
def test_the_native_container_is_no_collector_object_and_leaks_no_block():
    """400k leaves in a dict and a SortedList of tuples are ~800k objects every full collection
    visits; the native container holds Blocks only (outside the collector too) and is not tracked.
    Its references to the Blocks go when they leave it, when it is cleared and when it is freed."""
    blocks = _blocks(3000)
    before = [sys.getrefcount(b) for b in blocks]
    order = LeafOrder()
    for i, b in enumerate(blocks):
        order.put(b, float(i % 7))
    assert not gc.is_tracked(order) and gc.get_referents(order) == []
    for b in blocks[::2]:
        order.put(b, 10.0)  # re-scored: still one reference
    del b  # the loop's own reference
    assert [sys.getrefcount(b) for b in blocks] == [n + 1 for n in before]
    for b in blocks[::3]:
        order.drop(b)
    del b
    order.clear()
    assert [sys.getrefcount(b) for b in blocks] == before
    for b in blocks:
        order.put(b, 1.0)
    del b, order
    assert [sys.getrefcount(b) for b in blocks] == before


def test_lru_keeps_a_slots_leaves_natively_where_the_index_is_native():
    index = RadixIndex()
    index.add_slot(0)
    policy = registry.build("eviction", "lru", random.Random(0))
    policy.on_stored(index, 0, index.store(0, None, [1, 2, 3], 1.0), AccessInfo(), 1.0)
    kept = policy._leaves._slots[0]
    assert type(kept) is (PyLeafOrder if native.module is None else LeafOrder)
    assert [k for _, k, _ in kept] == [3]
    pure = RadixIndex(pure=True)
    assert type(leaf_order(pure, True)) is PyLeafOrder and type(leaf_order(index, False)) is PyLeafOrder


@pytest.mark.skipif(LeafOrder is None, reason="the native LeafOrder (KVROUTERD_PURE_PYTHON=1 or no extension)")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=st.lists(st.tuples(st.sampled_from(["store", "store", "again", "access"]), st.sampled_from((0, 1)),
                                 st.integers(0, 1 << 16), st.integers(1, 4)), min_size=1, max_size=40))
def test_stored_works_out_recency_as_radix_index_does(script):
    """``LeafOrder.stored`` works ``RadixIndex.recency`` out itself where it can (``_native.c``:
    leaf_recency); the method is its reference. Fed alike, a container given the method and one
    given a wrapper of it (which it calls every time) keep the same leaves at the same
    priorities, with accesses pending, blocks several slots hold (stored again by the other
    slot: their stats by slot) and leaves with children."""
    index = RadixIndex()
    for slot in (0, 1):
        index.add_slot(slot)
    native_way = {slot: LeafOrder() for slot in (0, 1)}
    called = {slot: LeafOrder() for slot in (0, 1)}
    wrapped = lambda i, b, slot: RadixIndex.recency(i, b, slot)  # noqa: E731
    fresh, now = 1, 0.0
    for op, slot, pick, n in script:
        now += 1.0
        held = sorted(b.key for b in index.blocks_of(slot))
        every = sorted({*held, *(b.key for b in index.blocks_of(1 - slot))})
        if op == "store" or (op == "again" and every):
            parent = None if not every or pick % 3 == 0 else every[pick % len(every)]
            keys: list[int] = list(range(fresh, fresh + n))
            fresh += n
            if op == "again":  # a chain the index has, from its root: either slot's blocks
                b, keys, parent = index.get(every[pick % len(every)]), [], None
                while b is not None:
                    keys.append(b.key)
                    b = b.parent
                keys.reverse()
            blocks = index.store(slot, parent, keys, now)
            native_way[slot].stored(index, slot, blocks, RadixIndex.recency)
            called[slot].stored(index, slot, blocks, wrapped)
        elif op == "access" and held:  # a matched prefix of the slot's: its accesses stay pending on its last block
            path, b = [], index.get(held[pick % len(held)])
            while b is not None and b.holders >> slot & 1:
                path.append(b)
                b = b.parent
            index.touch_path(slot, path[::-1], now)
        for s in (0, 1):
            assert [(p, k) for p, k, _ in native_way[s]] == [(p, k) for p, k, _ in called[s]]


# ---- every SortedLeaves policy: the native index and containers against the pure ones --------------

POLICIES = [
    "lru",
    "lfu",
    {"name": "hybrid", "length": "prefix"},
    {"name": "rlt", "capacity_blocks": 6},
    {"name": "tlru", "latency_threshold_ms": 3.2, "prefill_ms_per_block": 1.6},
    "unicache",
]
SLOTS = (0, 70)  # a slot past 63: its bit is no machine word


class _Cache:
    def __init__(self, policy: str | dict, pure: bool) -> None:
        self.index = RadixIndex(pure=pure)
        for s in SLOTS:
            self.index.add_slot(s)
        self.policy = registry.build("eviction", policy, random.Random(7))

    def held(self, slot: int) -> list[int]:
        return sorted(b.key for b in self.index.blocks_of(slot))

    def order(self, slot: int) -> list[tuple[object, int]] | None:
        view = self.policy._leaves.sorted_view(EvictionContext(self.index, slot, 0.0))
        return None if view is None else [(p, k) for p, k, _ in view]


store_op = st.tuples(st.just("store"), st.sampled_from(SLOTS), st.integers(0, 1 << 16), st.integers(1, 5),
                     st.integers(0, 3))
access_op = st.tuples(st.just("access"), st.sampled_from(SLOTS), st.integers(0, 1 << 16), st.integers(0, 3))
remove_op = st.tuples(st.just("remove"), st.sampled_from(SLOTS), st.lists(st.integers(0, 1 << 16), min_size=1,
                                                                           max_size=6))
clear_op = st.tuples(st.just("clear"), st.sampled_from(SLOTS))
rank_op = st.tuples(st.just("rank"), st.sampled_from(SLOTS), st.integers(1, 40), st.sampled_from([None, 1, 2, 5]))
any_op = st.one_of(store_op, store_op, store_op, access_op, remove_op, rank_op, rank_op, clear_op)


def _apply(caches: list[_Cache], op: tuple, now: float, fresh: list[int]) -> None:  # type: ignore[type-arg]
    """One event, alike on every cache (index first, then the hook, as the router does)."""
    slot = op[1]
    keys = caches[0].held(slot)
    info = lambda session, offset: AccessInfo(session_id=f"s{session}" if session else "", first_offset=offset)  # noqa: E731
    if op[0] == "store":
        _, _, pick, n, session = op
        # from the root, under a block the slot holds, or under one only the other slot holds,
        # or again over blocks it holds (a re-store touches them)
        every = sorted({*caches[0].held(SLOTS[0]), *caches[0].held(SLOTS[1])})
        parent = None if not every or pick % 4 == 0 else every[pick % len(every)]
        chain = list(range(fresh[0], fresh[0] + n))
        fresh[0] += n
        if keys and pick % 5 == 1:  # the slot's own chain again, from its top
            b, chain = caches[0].index.get(keys[pick % len(keys)]), []
            while b is not None:
                chain.append(b.key)
                b = b.parent
            chain.reverse()
            parent = None
        for c in caches:
            blocks = c.index.store(slot, parent, chain, now)
            c.policy.on_stored(c.index, slot, blocks, info(session, 0), now)
    elif op[0] == "access" and keys:
        _, _, pick, session = op
        chain, b = [], caches[0].index.get(keys[pick % len(keys)])
        while b is not None and b.holders >> slot & 1:
            chain.append(b.key)
            b = b.parent
        for c in caches:
            blocks = [c.index.get(k) for k in reversed(chain)]
            c.index.touch_path(slot, blocks, now)
            c.policy.on_accessed(c.index, slot, blocks, info(session, 0), now)
    elif op[0] == "remove" and keys:
        doomed = list(dict.fromkeys(keys[i % len(keys)] for i in op[2]))
        for c in caches:
            if len(doomed) == 1:
                c.policy.on_removed(c.index, slot, c.index.get(doomed[0]))
                c.index.remove(slot, doomed[0])
            else:
                drop_blocks(c.policy, c.index, slot, [c.index.get(k) for k in doomed])
    elif op[0] == "clear":
        for c in caches:
            c.index.clear(slot)
            c.policy.on_cleared(slot)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), script=st.lists(any_op, min_size=1, max_size=40),
       between=st.lists(any_op, max_size=8))
def test_every_leaf_policy_ranks_alike_on_native_and_pure_containers(policy, script, between):
    caches = [_Cache(policy, pure=False), _Cache(policy, pure=True)]
    fresh, now = [1], 0.0
    for op in script:
        now += 1.0
        if op[0] != "rank":
            _apply(caches, op, now, fresh)
        else:
            _, slot, count, step = op
            if step is None:
                ranks = [c.policy.rank(EvictionContext(c.index, slot, now), count, frozenset()) for c in caches]
            else:
                # in parts, the events of `between` applied between them (alike on both caches)
                runs = [c.policy.rank_steps(EvictionContext(c.index, slot, now), count, frozenset(), step)
                        for c in caches]
                ranks, pending = [None, None], list(between)
                while ranks[0] is None:
                    done = []
                    for i, run in enumerate(runs):
                        try:
                            next(run)
                        except StopIteration as end:
                            ranks[i] = end.value
                        done.append(ranks[i] is not None)
                    assert done[0] == done[1]
                    if pending and ranks[0] is None:
                        now += 1.0
                        _apply(caches, pending.pop(0), now, fresh)
            assert [b.key for b in ranks[0]] == [b.key for b in ranks[1]]
        for slot in SLOTS:
            assert caches[0].held(slot) == caches[1].held(slot)
            assert caches[0].order(slot) == caches[1].order(slot)
