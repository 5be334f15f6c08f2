"""T-LRU: blocks beyond a conversation's TEL-safe budget go first, then plain LRU."""

from __future__ import annotations

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.base import AccessInfo, EvictionContext
from kvrouterd.policies.eviction._leaves import rank_leaves_by
from kvrouterd.policies.eviction._reach import Trim

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


def reference_rank(policy, index, slot: int, count: int, pinned: frozenset[int] = frozenset()) -> list[int]:
    """T-LRU's order computed from scratch, as section 4 states it: a block is trimmed if some
    remembered conversation's path holds it and it lies beyond the TEL-safe budget
    (``policy.budget``) of every such conversation, its depth counted from the conversation's
    L at its tip; trimmed leaves go first, then the rest, least recently used first, parents
    joining as their last held child goes."""
    beyond: dict[int, bool] = {}
    for sid, conv in policy._convs.get(slot, {}).items():
        budget = policy.budget(slot, sid)
        node, depth = conv.tip, conv.length
        while node is not None:
            beyond[node.key] = beyond.get(node.key, True) and depth > budget
            node, depth = node.parent, depth - 1
    trimmed = {k for k, b in beyond.items() if b}
    ctx = EvictionContext(index, slot, 0.0)
    return [b.key for b in rank_leaves_by(
        ctx, count, pinned, lambda b: (0 if b.key in trimmed else 1, index.recency(b, slot)))]


def _recomputed(policy, index, slot: int = 0) -> None:
    """The reaches kept incrementally equal those of every conversation walked again."""
    t = policy._trim_state(slot)
    incremental = dict(t.reach), {k: dict(r.count) for k, r in t.shared.items()}
    fresh = policy._trim[slot] = Trim()
    fresh.dirty.update(policy._convs.get(slot, {}))
    policy._refresh(slot, EvictionContext(index, slot, 0.0))
    assert (fresh.reach, {k: dict(r.count) for k, r in fresh.shared.items()}) == incremental


def _set_prompt_estimate(policy, blocks: float) -> None:
    """Move P (so every budget) as a run of observed prompt growth would."""
    policy._growth_sum, policy._growth_n = blocks, 1


@pytest.mark.parametrize("absorb_batch", [1, 64])  # folded as the hooks go, or mostly at ranking
@pytest.mark.parametrize("seed", range(8))
def test_the_order_under_random_shifts_matches_a_recompute_from_scratch(cache_of, monkeypatch, seed, absorb_batch):
    """P - xi/alpha crossing an integer moves every budget. The policy keeps each key's reach,
    which no shift changes, instead of each conversation's split (moving every split held the
    loop 0.5-1.3 s at 16k-65k conversations); the order must be the paper's all the same:
    random turns, ends, evictions (tips move up, gaps open) and random P, checked against the
    order computed from scratch."""
    import random

    from kvrouterd.policies.eviction import tlru

    monkeypatch.setattr(tlru, "ABSORB_BATCH", absorb_batch)
    rng = random.Random(seed)
    c = cache_of({"name": "tlru", "latency_threshold_ms": 8.0, "prefill_ms_per_block": 1.0})
    key, tails = 1, set()
    shared = [key, key + 1]  # a system prompt some conversations start with
    c.store(shared, now=0.0)
    key += 2
    for step in range(150):
        sid = f"s{rng.randrange(12)}"
        now = float(step + 1)
        conv_ = c.policy._convs.get(0, {}).get(sid)
        if conv_ is not None and rng.random() < 0.7:  # a next turn: its cached history again, then more
            held, node = [], conv_.tip
            while node is not None and node.holders & 1:
                held.append(node.key)
                node = node.parent
            held.reverse()
            if node is None:
                c.access(held, now=now, info=conv(sid))
            grow = list(range(key, key + rng.randrange(0, 9)))
            key += len(grow)
            if grow:
                c.store(grow, now=now, parent=conv_.tip.key, info=AccessInfo(session_id=sid, first_offset=conv_.length))
        elif conv_ is None:
            first = list(range(key, key + rng.randrange(1, 15)))
            key += len(first)
            on_shared = rng.random() < 0.5
            if on_shared and all(c.index.holds(0, k) for k in shared):
                c.access(shared, now=now, info=conv(sid))
                # an offset that misses the shared prompt (L below the path's length) must not
                # trim what the conversation's L does not reach
                offset = rng.choice([2, 2, 0])
                c.store(first, now=now, parent=shared[-1], info=AccessInfo(session_id=sid, first_offset=offset))
            else:
                c.store(first, now=now, info=conv(sid))
        if rng.random() < 0.1:
            c.policy.end_session(sid)
        if rng.random() < 0.15:  # the engine drops a block, not always a leaf
            held_keys = sorted(b.key for b in c.index.blocks_of(0))
            if held_keys:
                c.evict([rng.choice(held_keys)])
        if rng.random() < 0.3:
            _set_prompt_estimate(c.policy, rng.randrange(11) + rng.random())  # tail 8..0 blocks
            n = c.index.count(0)
            assert c.rank(n, now=now) == reference_rank(c.policy, c.index, 0, n)
            tails.add(c.policy._trim_state(0).tail)
            _recomputed(c.policy, c.index)
            _set_prompt_estimate(c.policy, rng.randrange(11) + rng.random())
            pinned = frozenset(rng.sample(sorted(b.key for b in c.index.blocks_of(0)), min(3, n)))
            assert c.rank(5, now=now, pinned=pinned) == reference_rank(c.policy, c.index, 0, 5, pinned)
    assert {0, 1} <= tails and len(tails) > 4  # the shift moved, across "nothing beyond the budget"


@pytest.mark.parametrize("conversations", [64, 1024])
def test_a_budget_shift_visits_no_conversation(cache_of, monkeypatch, conversations):
    """Issue #16: one call may not hold the routing loop. A shift of every budget (here P jumps
    from 0 to 5: 5 more of each path's 15 blocks fall inside its budget) costs the same work
    with 64 conversations as with 1,024: the one whose turn moved P is walked again, and only
    its leaves are re-sorted."""
    from kvrouterd.policies.eviction import _reach

    c = cache_of({"name": "tlru", "latency_threshold_ms": 8.0, "prefill_ms_per_block": 1.0})
    c.store([1, 2, 3], now=0.0)
    for i in range(conversations):
        now = 1.0 + i
        c.access([1, 2, 3], now=now, info=conv(f"s{i}"))
        c.store(list(range(100 + 12 * i, 112 + 12 * i)), now=now, parent=3,
                info=AccessInfo(session_id=f"s{i}", first_offset=3))
    n = c.index.count(0)
    assert c.rank(n, now=1e6) == reference_rank(c.policy, c.index, 0, n)
    assert c.policy._trim_state(0).tail == 8

    walked, rescored, moved = [], [], []
    path = _reach.path_keys
    monkeypatch.setattr(_reach, "path_keys", lambda tip: (walked.append(tip.key), path(tip))[1])
    leaves = c.policy._leaves
    score = leaves.priority  # what the tracker calls for each leaf it places or re-scores
    monkeypatch.setattr(leaves, "priority", lambda index, b, slot: (rescored.append(b.key), score(index, b, slot))[1])
    move = _reach.move
    monkeypatch.setattr(_reach, "move", lambda t, old, new, changed: (move(t, old, new, changed), moved.append(len(changed))))

    tip = 111  # s0's second turn adds 5 blocks: the growth mean P goes from 0 to 5
    c.access([1, 2, 3, *range(100, 112)], now=1e6 + 1, info=conv("s0"))
    c.store(list(range(10**6, 10**6 + 5)), now=1e6 + 1, parent=tip, info=AccessInfo(session_id="s0", first_offset=15))
    assert c.policy.next_prompt_estimate() == 5.0
    walked.clear(), rescored.clear()  # the hooks' own work on s0's blocks
    assert c.rank(1, now=1e6 + 2) == reference_rank(c.policy, c.index, 0, 1)
    assert c.policy._trim_state(0).tail == 3
    assert walked == [10**6 + 4]      # s0 only: its path grew
    assert moved == [3 + 12 + 5]      # each of s0's keys moved reach once; nobody else's
    assert sorted(rescored) == [10**6 + 4]  # s0's new tip; no other leaf changed place
    n = c.index.count(0)
    assert c.rank(n, now=1e6 + 2) == reference_rank(c.policy, c.index, 0, n)


def test_new_conversations_are_absorbed_as_they_come_not_all_by_the_next_hint(cache_of, monkeypatch):
    """Issue #16: 65,536 conversations that arrived between two EvictHints were all walked by
    the second (~1.5 s on the loop). The hooks fold them in every ABSORB_BATCH, so a hint walks
    fewer than that many paths however many arrived; the order is unchanged."""
    from kvrouterd.policies.eviction import _reach, tlru

    c = cache_of(PARAMS)
    c.store([1, 2, 3], now=0.0)
    c.rank(1, now=0.5)
    walked: list[int] = []
    path = _reach.path_keys
    monkeypatch.setattr(_reach, "path_keys", lambda tip: (walked.append(tip.key), path(tip))[1])
    arrivals = 5 * tlru.ABSORB_BATCH + 7
    for i in range(arrivals):
        c.access([1, 2, 3], now=1.0 + i, info=conv(f"s{i}"))
        c.store(list(range(100 + 4 * i, 104 + 4 * i)), now=1.0 + i, parent=3,
                info=AccessInfo(session_id=f"s{i}", first_offset=3))
    assert len(walked) >= arrivals - tlru.ABSORB_BATCH  # paid for by the hooks, as they came
    walked.clear()
    n = c.index.count(0)
    assert c.rank(n, now=1e6) == reference_rank(c.policy, c.index, 0, n)
    assert 0 < len(walked) < tlru.ABSORB_BATCH


def test_past_the_bound_a_new_conversation_forgets_only_what_it_must(cache_of, monkeypatch):
    """Issue #16: forgetting the least recently active quarter at once left a quarter of the
    paths (16,384 at the default bound) to release in one EvictHint. Past the bound a new
    conversation forgets the least recently active one, so the next ranking releases one path."""
    from kvrouterd.policies.eviction import _reach

    c = cache_of({**PARAMS, "max_sessions": 64})
    for i in range(64):
        c.store([1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i], now=float(i + 1), info=conv(f"s{i}"))
    c.rank(1, now=100.0)
    moved: list[tuple[bool, bool]] = []
    move = _reach.move
    monkeypatch.setattr(_reach, "move", lambda t, old, new, changed: (
        moved.append((old is not None, new is not None)), move(t, old, new, changed)))
    for i in range(64, 80):
        c.store([1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i], now=float(i + 1), info=conv(f"s{i}"))
        assert set(c.policy._convs[0]) == {f"s{j}" for j in range(i - 63, i + 1)}
        n = c.index.count(0)
        assert c.rank(n, now=100.0 + i) == reference_rank(c.policy, c.index, 0, n)
        assert sorted(moved) == [(False, True), (True, False)]  # the new path counted, the forgotten one released
        moved.clear()
