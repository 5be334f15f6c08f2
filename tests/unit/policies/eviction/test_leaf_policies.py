"""LRU, LFU and hybrid order leaves by their formulas (systematic study, section 3.3)."""

from __future__ import annotations

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.base import EvictionContext
from kvrouterd.policies.eviction.hybrid import hybrid_value


def test_lru_evicts_least_recent_leaf_and_promotes_parent_after_its_children(cache_of):
    c = cache_of("lru")
    c.store([1, 2, 3], now=1.0)          # chain 1-2-3
    c.store([4], now=2.0, parent=2)      # branch 1-2-4
    c.store([10, 11], now=3.0)           # chain 10-11
    c.access([1, 2, 4], now=4.0)
    # leaves: 3 (t=1), 4 (t=4), 11 (t=3); 2 becomes a leaf only after 3 and 4 go
    assert c.rank(6, now=5.0) == [3, 11, 10, 4, 2, 1]


def test_lru_never_returns_pinned_blocks_or_their_ancestors(cache_of):
    c = cache_of("lru")
    c.store([1, 2, 3], now=1.0)
    c.store([10], now=2.0)
    assert c.rank(10, now=3.0, pinned=frozenset({3})) == [10]


def test_lru_hooks_and_stateless_fallback_agree(cache_of):
    c = cache_of("lru")
    c.store([1, 2, 3], now=1.0)
    c.store([4, 5], now=2.0, parent=1)
    c.store([6], now=3.0)
    c.access([1, 4], now=4.0)
    c.evict([5])
    fresh = registry.build("eviction", "lru")  # saw no hooks: must rank from the index alone
    expected = [b.key for b in fresh.rank(EvictionContext(c.index, 0, 5.0), 10, frozenset())]
    assert c.rank(10, now=5.0) == expected == [3, 2, 6, 4, 1]


def test_lfu_evicts_fewest_uses_first_ties_by_recency(cache_of):
    c = cache_of("lfu")
    c.store([1], now=1.0)
    c.store([2], now=2.0)
    c.store([3], now=3.0)
    c.access([1], now=4.0)
    c.access([1], now=5.0)
    c.access([3], now=6.0)
    # uses: 1 -> 3, 2 -> 1, 3 -> 2
    assert c.rank(3, now=7.0) == [2, 3, 1]
    c.store([4], now=8.0)
    c.store([5], now=9.0)
    # 4 and 5 tie on one use; the older goes first, before anything used more
    assert c.rank(3, now=10.0) == [2, 4, 5]


def test_lfu_keeps_a_frequently_used_old_leaf_that_lru_would_evict(cache_of):
    lfu, lru = cache_of("lfu"), cache_of("lru")
    for c in (lfu, lru):
        c.store([1], now=0.0)
        for t in range(1, 5):
            c.access([1], now=float(t))
        c.store([2], now=10.0)
        c.access([2], now=11.0)
        c.access([2], now=12.0)
        c.store([3], now=13.0)
        c.access([1], now=14.0)
    assert lfu.rank(1, now=20.0) == [3]
    assert lru.rank(1, now=20.0) == [2]


def test_hybrid_default_weighs_usage_against_age(cache_of):
    c = cache_of("hybrid")
    c.store([1, 2, 3], now=0.0)
    c.access([1, 2, 3], now=0.0)
    c.access([1, 2, 3], now=0.0)        # leaf 3: usage 3, length 1 (one node), age 10 -> 3/11
    c.store([7, 8, 9, 10, 11, 12], now=5.0)  # leaf 12: usage 1, age 5 -> 1/6, however deep
    assert c.rank(1, now=10.0) == [12]
    lru = cache_of("lru")
    lru.store([1, 2, 3], now=0.0)
    lru.store([7, 8, 9, 10, 11, 12], now=5.0)
    assert lru.rank(1, now=10.0) == [3]


def test_hybrid_prefix_length_orders_by_usage_times_depth_over_one_plus_age(cache_of):
    c = cache_of({"name": "hybrid", "length": "prefix"})
    c.store([1, 2, 3, 4], now=0.0)      # leaf 4: usage 1, length 4, age 10 -> 4/11
    c.store([20], now=5.0)              # leaf 20: usage 1, length 1, age 5 -> 1/6
    c.store([30], now=0.0)
    c.access([30], now=2.0)             # leaf 30: usage 2, length 1, age 8 -> 2/9
    c.store([40, 41], now=9.0)          # leaf 41: usage 1, length 2, age 1 -> 1
    values = {4: hybrid_value(1, 4, 10), 20: hybrid_value(1, 1, 5), 30: hybrid_value(2, 1, 8), 41: hybrid_value(1, 2, 1)}
    assert values == pytest.approx({4: 4 / 11, 20: 1 / 6, 30: 2 / 9, 41: 1.0})
    # 41 is worth more than 3 once 4 is gone (3/11), so the parent comes before it
    assert c.rank(3, now=10.0) == sorted(values, key=values.get)[:3] == [20, 30, 4]
    assert c.rank(4, now=10.0)[3] == 3
    # LRU would have evicted the long, old chain first; hybrid keeps it
    assert c.rank(1, now=10.0) == [20]


def test_hybrid_age_unit_scales_recency(cache_of):
    fast = cache_of({"name": "hybrid", "age_unit_s": 1.0, "length": "prefix"})
    slow = cache_of({"name": "hybrid", "age_unit_s": 10_000.0, "length": "prefix"})
    for c in (fast, slow):
        c.store([1], now=900.0)        # usage 1, length 1, age 100 s at t=1000
        c.store([2, 3], now=0.0)       # usage 1, length 2, age 1000 s
    # seconds: 1/101 > 2/1001, so the long old chain goes first
    assert fast.rank(1, now=1000.0) == [3]
    # 10,000 s units: 1/1.01 < 2/1.1, age barely matters and length wins
    assert slow.rank(1, now=1000.0) == [1]


def test_hybrid_rejects_bad_parameters():
    with pytest.raises(ConfigError, match="age_unit_s"):
        registry.build("eviction", {"name": "hybrid", "age_unit_s": 0})
    with pytest.raises(ConfigError, match="length"):
        registry.build("eviction", {"name": "hybrid", "length": "tokens"})
