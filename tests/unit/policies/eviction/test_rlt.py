"""RLT (LBGR paper, Algorithm 1): random unmarked leaves, marks reset every B+1 blocks."""

from __future__ import annotations

import gc
from collections import Counter

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.index import native
from kvrouterd.policies import registry


def five_leaves(cache_of, seed=0):
    c = cache_of({"name": "rlt", "capacity_blocks": 3}, seed=seed)
    for k in range(1, 6):
        c.store([k], now=float(k))
    # B = 3: marking 1, 2, 3 fills the phase; 4 is the (B+1)-th block, so only 4 stays marked; then 5
    assert c.policy.marked(0) == {4, 5}
    return c


def test_never_evicts_a_marked_leaf_while_unmarked_leaves_exist(cache_of):
    for seed in range(30):
        c = five_leaves(cache_of, seed)
        assert set(c.rank(3, now=10.0)) == {1, 2, 3}


def test_choice_among_unmarked_leaves_is_random_and_seeded(cache_of):
    firsts = Counter(five_leaves(cache_of, seed).rank(1, now=10.0)[0] for seed in range(300))
    assert set(firsts) == {1, 2, 3}
    assert min(firsts.values()) > 60  # uniform: ~100 each
    assert five_leaves(cache_of, 5).rank(3, now=10.0) == five_leaves(cache_of, 5).rank(3, now=10.0)


def test_a_new_phase_starts_when_no_unmarked_leaf_is_left(cache_of):
    c = five_leaves(cache_of)
    order = c.rank(5, now=10.0)
    # after the unmarked 1-3, a new phase unmarks 4; 5, the newest access, goes last
    assert set(order[:3]) == {1, 2, 3}
    assert order[3:] == [4, 5]


def test_access_marks_blocks(cache_of):
    c = five_leaves(cache_of)
    c.access([2], now=6.0)
    assert set(c.rank(2, now=10.0)) == {1, 3}


def test_parent_becomes_candidate_after_its_children(cache_of):
    c = cache_of({"name": "rlt", "capacity_blocks": 2})
    c.store([1, 2], now=1.0)   # marks 1, 2
    c.store([3], now=2.0)      # third distinct block: phase resets to {3}
    assert c.policy.marked(0) == {3}
    order = c.rank(3, now=3.0)
    assert order[:2] == [2, 1] and order[2] == 3


def test_learns_capacity_from_the_worker_when_not_set(cache_of):
    c = cache_of("rlt")
    for k in range(1, 5):
        c.store([k], now=float(k))
    assert c.policy.marked(0) == {1, 2, 3, 4}  # no bound known yet: nothing resets
    c.rank(1, now=5.0)  # the worker holds 4 blocks: B = 4; all leaves marked: new phase {4}
    assert c.policy.marked(0) == {4}
    for k in range(5, 9):
        c.store([k], now=float(k + 1))
    assert c.policy.marked(0) == {8}  # 4, 5, 6, 7 and then 8: B + 1 marks start a phase


def test_rejects_negative_capacity():
    with pytest.raises(ConfigError, match="capacity_blocks"):
        registry.build("eviction", {"name": "rlt", "capacity_blocks": -1})


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_marks_are_not_walked_by_the_garbage_collector(cache_of):
    # a phase marks up to B blocks: held as Python ints, every full collection visited each one
    # (~33 ms on the routing loop at 400k marked blocks); the native table holds no objects
    c = cache_of({"name": "rlt", "capacity_blocks": 0}, seed=0)
    for k in range(1, 2_001):
        c.store([k], now=float(k))
    assert len(c.policy.marked(0)) == 2_000
    marks = c.policy._phases[0].marked
    assert not gc.is_tracked(marks)
    assert not any(isinstance(r, int) for r in gc.get_referents(marks))
