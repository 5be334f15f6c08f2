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
