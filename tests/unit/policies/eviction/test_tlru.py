"""T-LRU: blocks beyond a conversation's TEL-safe budget go first, then plain LRU."""

from __future__ import annotations

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.base import AccessInfo, EvictionContext

# xi / alpha = 10 blocks meet the threshold anyway; the next prompt adds 2 blocks
PARAMS = {"name": "tlru", "latency_threshold_ms": 10.0, "prefill_ms_per_block": 1.0, "next_prompt_blocks": 2.0}


def conv(session):
    return AccessInfo(session_id=session)


def test_trims_only_beyond_the_budget_before_touching_lru_order(cache_of):
    c = cache_of(PARAMS)
    c.store(list(range(101, 116)), now=0.0, info=conv("b"))  # L=15: budget 7, depth 8-15 trimmable
    c.store([201, 202, 203], now=0.5)                        # no session: plain LRU
    c.store(list(range(1, 21)), now=1.0, info=conv("a"))     # L=20: budget 12, depth 13-20 trimmable
    assert c.policy.budget(0, "a") == 12 and c.policy.budget(0, "b") == 7
    order = c.rank(17, now=2.0)
    # the 16 trimmable blocks first, least recently used conversation first ...
    assert order[:16] == [*range(115, 107, -1), *range(20, 12, -1)]
    # ... then LRU over what is left: b's budget part is the oldest
    assert order[16] == 107
    # plain LRU would have taken all of b, then the unlabelled chain
    lru = cache_of("lru")
    lru.store(list(range(101, 116)), now=0.0)
    lru.store([201, 202, 203], now=0.5)
    lru.store(list(range(1, 21)), now=1.0)
    assert lru.rank(17, now=2.0) == [*range(115, 100, -1), 203, 202]


def test_a_prefix_inside_another_conversations_budget_is_not_trimmed(cache_of):
    c = cache_of(PARAMS)
    c.store(list(range(1, 21)), now=1.0, info=conv("x"))      # budget 12 protects depth 1-12
    c.access([1, 2, 3], now=2.0, info=conv("y"))
    c.store([50, 51], now=2.0, parent=3, info=AccessInfo(session_id="y", first_offset=3))  # L=5: budget 0
    trim = c.policy.trimmable(EvictionContext(c.index, 0, 3.0))
    assert trim == {50, 51, *range(13, 21)}


def test_end_aware_trims_a_finished_conversation_first(cache_of):
    c = cache_of(PARAMS)
    c.store(list(range(1, 21)), now=1.0, info=conv("a"))
    c.store([30], now=0.0)
    c.policy.end_session("a")
    assert c.policy.budget(0, "a") == 0
    assert c.rank(20, now=2.0) == list(range(20, 0, -1))


def test_next_prompt_estimate_is_the_running_mean_of_prompt_growth(cache_of):
    c = cache_of({"name": "tlru"})
    c.store(list(range(1, 11)), now=1.0, info=conv("a"))                     # turn 1: 10 blocks
    assert c.policy.next_prompt_estimate() == 0.0
    c.access(list(range(1, 11)), now=2.0, info=conv("a"))                    # turn 2 grows by 4
    c.store([11, 12, 13, 14], now=2.0, parent=10, info=AccessInfo(session_id="a", first_offset=10))
    assert c.policy.next_prompt_estimate() == 4.0
    c.access(list(range(1, 15)), now=3.0, info=conv("a"))                    # turn 3 grows by 0... then 2
    c.store([15, 16], now=3.0, parent=14, info=AccessInfo(session_id="a", first_offset=14))
    assert c.policy.next_prompt_estimate() == 3.0


def test_evicting_a_conversation_tip_moves_it_back(cache_of):
    c = cache_of(PARAMS)
    c.store(list(range(1, 21)), now=1.0, info=conv("a"))
    c.evict([20, 19])
    assert c.policy.budget(0, "a") == 10  # history now 18 blocks cached: 18 + 2 - 10


def test_rejects_non_positive_prefill_cost():
    with pytest.raises(ConfigError, match="prefill_ms_per_block"):
        registry.build("eviction", {"name": "tlru", "prefill_ms_per_block": 0})


def test_the_conversation_map_has_a_byte_budget(cache_of):
    """Issue #16 item 3: session ids are client-chosen; conversations, their ids and their
    paths must not grow memory past max_session_bytes (as unicache's session map)."""
    from kvrouterd.policies.eviction.tlru import CONVERSATION_BYTES, PATH_BLOCK_BYTES

    one = CONVERSATION_BYTES + 200 + 3 * PATH_BLOCK_BYTES  # a 200-character id, a 3-block path
    budget = 40 * one
    c = cache_of({**PARAMS, "max_session_bytes": budget})
    for i in range(400):
        sid = f"{i:04d}" + "s" * 196
        c.store([10_000 + 3 * i, 10_001 + 3 * i, 10_002 + 3 * i], now=float(i + 1), info=conv(sid))
        assert c.policy.session_bytes <= budget
    convs = c.policy._convs[0]
    assert 20 <= len(convs) <= 40  # the count bound (65536) never came into play
    assert c.policy.session_bytes == sum(CONVERSATION_BYTES + len(s) + PATH_BLOCK_BYTES * v.length for s, v in convs.items())
    assert "0399" + "s" * 196 in convs and "0000" + "s" * 196 not in convs  # the least recent went
    # 3-block paths are all beyond their budget (3 + 2 - 10 < 0), but only the remembered
    # conversations' are trimmed: a forgotten one's blocks are plain LRU blocks
    remembered = {10_000 + 3 * int(s[:4]) + d for s in convs for d in range(3)}
    assert c.policy.trimmable(EvictionContext(c.index, 0, 500.0)) == remembered
    assert c.policy._tips[0].keys() == {10_002 + 3 * int(s[:4]) for s in convs}


def test_a_new_turn_keeps_a_conversation_and_clearing_releases_its_bytes(cache_of):
    c = cache_of({**PARAMS, "max_sessions": 3})
    for i, sid in enumerate("abc"):
        c.store([100 * i + 1, 100 * i + 2], now=float(i + 1), info=conv(sid))
    c.access([1, 2], now=10.0, info=conv("a"))  # a's next turn: b is now the least recently active
    c.store([301, 302], now=11.0, info=conv("d"))
    assert set(c.policy._convs[0]) == {"a", "c", "d"}
    c.policy.on_cleared(0)
    assert c.policy.session_bytes == 0 and not c.policy._recent


def test_a_conversation_evicted_from_the_cache_is_forgotten_with_its_bytes(cache_of):
    c = cache_of(PARAMS)
    c.store([1, 2], now=1.0, info=conv("a"))
    c.evict([2, 1])
    assert "a" not in c.policy._convs[0] and c.policy.session_bytes == 0 and not c.policy._recent


def test_session_bounds_are_validated():
    with pytest.raises(ConfigError, match="max_session_bytes"):
        registry.build("eviction", {"name": "tlru", "max_session_bytes": 10})


def _recomputed(policy, index, slot: int = 0) -> tuple[dict, dict]:
    """The trimming counts recomputed from scratch (every conversation walked again)."""
    t = policy._trim_state(slot)
    incremental = dict(t.tail), dict(t.protected)
    t.dirty.update(policy._convs.get(slot, {}))
    policy._refresh(slot, EvictionContext(index, slot, 0.0))
    assert (t.tail, t.protected) == incremental
    return incremental


@pytest.mark.parametrize("seed", range(8))
def test_budgets_moved_by_a_shift_match_a_full_recompute(cache_of, seed):
    """P - xi/alpha crossing an integer moves every budget: the policy shifts each
    conversation's split by the change instead of walking every path again (that walk held
    the loop 0.25 s at 200k path blocks, 1.8 s at 1.2M), with the same result."""
    import random

    rng = random.Random(seed)
    c = cache_of({"name": "tlru", "latency_threshold_ms": 8.0, "prefill_ms_per_block": 1.0})
    key, paths, shifts = 1, {}, set()
    for step in range(120):
        sid = f"s{rng.randrange(12)}"
        now = float(step)
        if sid in paths and rng.random() < 0.7:  # a next turn: the history again, then more
            held = paths[sid]
            c.access(held, now=now, info=conv(sid))
            grow = list(range(key, key + rng.randrange(0, 6)))
            key += len(grow)
            if grow:
                c.store(grow, now=now, parent=held[-1], info=AccessInfo(session_id=sid, first_offset=len(held)))
            paths[sid] = held + grow
        elif sid not in paths:
            first = list(range(key, key + rng.randrange(1, 15)))
            key += len(first)
            c.store(first, now=now, info=conv(sid))
            paths[sid] = first
        if rng.random() < 0.1:
            c.policy.end_session(sid)
        if rng.random() < 0.3:
            c.rank(rng.randrange(1, 4), now=now)  # refreshes: budgets shift as the growth mean moves
            shifts.add(c.policy._trim_state(0).shift)
            _recomputed(c.policy, c.index)
    assert len(shifts) > 1  # budgets did shift
