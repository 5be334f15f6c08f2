"""UniCache: evict-first queue drained first; weights shift toward hit-efficient queues."""

from __future__ import annotations

import math

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.base import AccessInfo
from kvrouterd.policies.eviction.unicache import AGENTIC, CHAT, EVICT_FIRST, STRUCTURAL, lognormal_cdf
from kvrouterd.protocols import TaskCategory

CHAT_INFO = AccessInfo(session_id="c", task=int(TaskCategory.CHAT))
AGENT_INFO = AccessInfo(session_id="g", task=int(TaskCategory.AGENTIC))
UNTEMPLATED = AccessInfo(task=int(TaskCategory.UNTEMPLATED))
TEMPLATED_WITH_DECODE = AccessInfo(task=int(TaskCategory.TEMPLATED), decode_from_block=2)


def test_evict_first_queue_is_drained_first_deepest_offset_first(cache_of):
    c = cache_of("unicache")
    c.store([10, 11], now=0.0, info=CHAT_INFO)              # old chat session
    c.store([20, 21, 22], now=1.0)                          # unlabelled, no session: structural
    c.store([30, 31, 32, 33], now=2.0, info=TEMPLATED_WITH_DECODE)  # 32, 33 are decode blocks
    c.store([1, 2, 3], now=500.0, info=UNTEMPLATED)         # newest, but untemplated single-turn
    q = {k: c.policy.queue_of(0, k) for k in (10, 20, 30, 32, 1)}
    assert q == {10: CHAT, 20: STRUCTURAL, 30: STRUCTURAL, 32: EVICT_FIRST, 1: EVICT_FIRST}
    order = c.rank(5, now=501.0)
    # deepest offset first across requests (33 is at offset 3; 32 and 3 tie at 2, older first),
    # all before the far older chat and structural blocks
    assert order == [33, 32, 3, 2, 1]


def test_a_reused_evict_first_block_leaves_the_evict_first_queue(cache_of):
    c = cache_of("unicache")
    c.store([1, 2], now=0.0, info=UNTEMPLATED)
    c.access([1], now=1.0, info=CHAT_INFO)
    assert c.policy.queue_of(0, 1) == CHAT and c.policy.queue_of(0, 2) == EVICT_FIRST


def test_session_queue_score_is_one_minus_lognormal_cdf():
    # the paper's chat fit: median gap e^4.15 ~ 63 s
    assert lognormal_cdf(math.exp(4.15), 4.15, 0.971) == pytest.approx(0.5)
    assert lognormal_cdf(0.0, 4.15, 0.971) == 0.0


def history(cache_of, interval):
    c = cache_of({"name": "unicache", "update_interval_s": interval})
    c.store([10, 11], now=0.0, info=CHAT_INFO)
    c.store([20, 21], now=0.0, info=AGENT_INFO)
    for t in range(1, 6):  # the agentic session keeps reusing its blocks, the chat one never does
        c.access([20, 21], now=float(t), info=AGENT_INFO)
    return c


def test_weights_shift_capacity_toward_the_queue_with_higher_hit_efficiency(cache_of):
    adaptive, frozen = history(cache_of, 1.0), history(cache_of, 1e9)
    w = adaptive.policy.weights(0)
    assert w[AGENTIC] > 1.0 > w[CHAT]
    assert frozen.policy.weights(0) == {CHAT: 1.0, AGENTIC: 1.0, STRUCTURAL: 1.0}
    # at t=10 the agentic leaf (idle 5 s of a ~6 s median gap) scores below the chat leaf
    # (idle 10 s of a ~63 s median): with equal weights it goes first ...
    assert frozen.rank(1, now=10.0) == [21]
    # ... but the agentic queue earned a larger weight, so the chat leaf goes instead
    assert adaptive.rank(1, now=10.0) == [11]


def test_online_fit_replaces_the_default_gap_model(cache_of):
    c = cache_of({"name": "unicache", "fit_online": True, "min_fit_samples": 3})
    t = 0.0
    for gap in (100.0, 100.0, 100.0, 100.0):  # chat turns every 100 s (sigma 0 is not a fit)
        c.access([1], now=t, info=CHAT_INFO) if t else c.store([1], now=t, info=CHAT_INFO)
        t += gap
    assert c.policy.gap_model(CHAT) == (4.15, 0.971)
    c.access([1], now=t + 50.0, info=CHAT_INFO)
    mu, sigma = c.policy.gap_model(CHAT)
    assert mu == pytest.approx(math.log(100.0), abs=0.2) and sigma > 0


def test_rejects_bad_ema_beta():
    with pytest.raises(ConfigError, match="ema_beta"):
        registry.build("eviction", {"name": "unicache", "ema_beta": 1.0})


def test_structural_score_is_normalised_by_the_deepest_block_of_any_queue(cache_of):
    # section 5.2: s = 1 - offset / max_offset, "max_offset is the maximum offset among all blocks"
    c = cache_of({"name": "unicache", "update_interval_s": 1e9})  # weights stay 1
    c.store(list(range(10, 18)), now=0.0, info=CHAT_INFO)   # chat session, offsets 0-7
    c.store([20, 21, 22, 23], now=0.0)                      # structural, offsets 0-3
    # 105.5 s after its last access the chat leaf scores 1 - CDF = 0.30; the structural leaf at
    # offset 3 scores 1 - 3/7 = 0.57 (it would score 0, and go first, if only structural
    # blocks set max_offset)
    assert 1 - lognormal_cdf(105.5, 4.15, 0.971) == pytest.approx(0.30, abs=0.01)
    assert c.rank(1, now=105.5) == [17]


def test_the_session_map_has_a_byte_budget_not_only_a_count(cache_of):
    """Issue #16 item 3: session ids are client-chosen, so long ids must not grow memory past the budget."""
    from kvrouterd.policies.eviction.unicache import SESSION_ENTRY_BYTES

    budget = 100 * (SESSION_ENTRY_BYTES + 200)
    c = cache_of({"name": "unicache", "max_session_bytes": budget})
    for i in range(1000):
        sid = f"{i:04d}" + "s" * 196  # 200 characters each
        c.store([10_000 + i], now=float(i + 1), info=AccessInfo(session_id=sid, task=int(TaskCategory.CHAT)))
        assert c.policy.session_bytes <= budget
    sessions = c.policy._session_seen
    assert 50 <= len(sessions) <= 100  # the count bound (65536) never came into play
    assert c.policy.session_bytes == sum(SESSION_ENTRY_BYTES + len(s) for s in sessions)
    assert "0999" + "s" * 196 in sessions  # the newest stay; the oldest were forgotten
    assert "0000" + "s" * 196 not in sessions


def test_the_session_map_count_bound_holds_too(cache_of):
    c = cache_of({"name": "unicache", "max_sessions": 10})
    for i in range(100):
        c.store([20_000 + i], now=float(i + 1), info=AccessInfo(session_id=f"s{i}", task=int(TaskCategory.CHAT)))
    assert len(c.policy._session_seen) <= 10
