"""``on_removed_many`` (one hook call for an engine event's removals) leaves every eviction policy
exactly where ``on_removed`` per block does, with the index dropping each block after its call.

Two caches get the same random stores, accesses and removals, one removing block by block, the
other through ``drop_blocks``; their eviction orders must agree after every step, including
removals of a parent before, after or together with its children. CI runs this on the native
index and with ``KVROUTERD_PURE_PYTHON=1``.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.policies.base import AccessInfo, EvictionContext, drop_blocks

from .conftest import Cache

POLICIES = [
    "lru",
    "lfu",
    {"name": "hybrid", "length": "prefix"},
    "hybrid",
    {"name": "rlt", "capacity_blocks": 6},
    # small budgets, so conversations' tails are trimmed and tips move as blocks go
    {"name": "tlru", "latency_threshold_ms": 3.2, "prefill_ms_per_block": 1.6},
    "unicache",
]

store_op = st.tuples(st.just("store"), st.integers(0, 1 << 16), st.integers(1, 4), st.integers(0, 3), st.integers(0, 4))
access_op = st.tuples(st.just("access"), st.integers(0, 1 << 16), st.integers(0, 3), st.integers(0, 4))
remove_op = st.tuples(st.just("remove"), st.lists(st.integers(0, 1 << 16), min_size=1, max_size=8))
ops = st.lists(st.one_of(store_op, store_op, access_op, remove_op), min_size=1, max_size=30)


def held(c: Cache) -> list[int]:
    return sorted(b.key for b in c.index.blocks_of(0))


def info(session: int, task: int, offset: int) -> AccessInfo:
    return AccessInfo(session_id=f"s{session}" if session else "", task=task, first_offset=offset)


def depth(c: Cache, key: int) -> int:
    d, b = 0, c.index.get(key).parent
    while b is not None and b.holders & 1:
        d, b = d + 1, b.parent
    return d


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), script=ops)
def test_removing_an_events_blocks_at_once_matches_removing_them_one_by_one(policy, script):
    one, many = Cache(policy, seed=3), Cache(policy, seed=3)
    next_key, now = 1, 0.0
    for op in script:
        now += 1.0
        keys = held(one)
        assert keys == held(many)
        if op[0] == "store":
            _, pick, n, session, task = op
            parent = keys[pick % len(keys)] if keys and pick % 3 else None
            new = list(range(next_key, next_key + n))
            next_key += n
            offset = 0 if parent is None else depth(one, parent) + 1
            for c in (one, many):
                c.store(new, now, parent=parent, info=info(session, task, offset))
        elif op[0] == "access" and keys:
            _, pick, session, task = op
            chain, b = [], one.index.get(keys[pick % len(keys)])
            while b is not None and b.holders & 1:
                chain.append(b.key)
                b = b.parent
            for c in (one, many):
                c.access(chain[::-1], now, info=info(session, task, 0))
        elif op[0] == "remove" and keys:
            # distinct held blocks in any order: parents before, after or without their children
            doomed = list(dict.fromkeys(keys[i % len(keys)] for i in op[1]))
            one.evict(doomed)
            drop_blocks(many.policy, many.index, 0, [many.index.get(k) for k in doomed])
        assert one.rank(10_000, now) == many.rank(10_000, now)
        # and the order the hooks keep stays whole: rank would fall back to listing the index's
        # leaves and hide a leaf the batch hook missed
        assert sorted_leaves(one) == sorted_leaves(many)
        assert sorted_leaves(many) is not None or not held(many)
    assert held(one) == held(many)


def sorted_leaves(c: Cache) -> list[tuple[object, int]] | None:
    view = c.policy._leaves.sorted_view(EvictionContext(c.index, 0, 0.0))
    return None if view is None else [(prio, key) for prio, key, _ in view]


def test_every_policy_has_the_batch_hook():
    for spec in POLICIES:
        assert callable(getattr(Cache(spec).policy, "on_removed_many", None)), spec


def test_a_chain_removed_leaf_first_leaves_its_parent_a_leaf_once(cache_of):
    """The usual engine eviction: a prompt's tail, leaf first. The parent it stops at is the
    worker's newest leaf; nothing of the removed chain is left in the order."""
    c = cache_of("lru")
    c.store([1, 2, 3, 4, 5], now=1.0)
    c.store([9], now=2.0)
    c.access([1, 2], now=3.0)
    drop_blocks(c.policy, c.index, 0, [c.index.get(k) for k in (5, 4, 3)])
    assert c.rank(10, now=4.0) == [9, 2, 1]
