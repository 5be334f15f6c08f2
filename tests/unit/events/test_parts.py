"""An engine batch applied in parts (events.parts) leaves the router exactly where the whole
batch does: blocks, parents, engine-hash maps, page chains, hybrid-group presence, per-worker
counts, the outcome counters and the eviction order."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.events.parts import batch_blocks, event_blocks, split_events
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheEvent, CacheMode, Cleared, EventBatch, EvictRequest, Removed, Stored
from kvrouterd.router import MAX_KV_GROUPS, Router, RouterSettings

BS = 4
KINDS = {0: "full_attention", 1: "sliding_window", 2: None}


class Engine:
    """A random engine that stays consistent with its own cache, as vLLM / SGLang do: it stores
    new pages under a page it holds (or the root), removes pages it holds (in any order), clears;
    and now and then stores under a parent the router never saw (an orphan, fresh hashes)."""

    def __init__(self, rng: random.Random, page: int, groups: bool) -> None:
        self.rng, self.page, self.groups = rng, page, groups
        self.held: list[int] = []
        self.next_hash = 1 << 40

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        return out

    def events(self, n: int) -> list[CacheEvent]:
        rng, out = self.rng, []
        for _ in range(n):
            roll = rng.random()
            if roll < 0.6 or not self.held:
                out.extend(self.stored())
            elif roll < 0.93:
                doomed = rng.sample(self.held, rng.randint(1, min(len(self.held), 30)))
                for h in doomed:
                    self.held.remove(h)
                group = rng.choice([None, None, 0, 1, MAX_KV_GROUPS]) if self.groups else None
                out.append(Removed(tuple(doomed), group))
            else:
                self.held.clear()
                out.append(Cleared())
        return out

    def stored(self) -> list[Stored]:
        rng = self.rng
        pages = rng.randint(1, 40)
        roll = rng.random()
        parent = None if roll < 0.3 or not self.held else self.fresh(1)[0] if roll < 0.4 else rng.choice(self.held)
        hashes = self.fresh(pages)
        tokens = array("I", [rng.randrange(1000) for _ in range(pages * self.page)]).tobytes()
        extras = None
        if rng.random() < 0.3:
            extras = tuple(rng.choice([0, 0, rng.getrandbits(64)]) for _ in range(pages))
        group = rng.choice([None, 0, 1, 2]) if self.groups else None
        model, salt = rng.choice([("m", ""), ("m", "s"), ("", "")])
        ev = Stored(tokens, tuple(hashes), parent, self.page, model, "", group, KINDS.get(group) if group is not None else None,
                    salt, extras)
        self.held.extend(hashes)
        if group is not None and rng.random() < 0.5:  # hybrid: another group stores the same pages
            other = rng.choice([g for g in (0, 1, 2) if g != group])
            return [ev, Stored(tokens, tuple(hashes), parent, self.page, model, "", other, KINDS[other], salt, extras)]
        return [ev]


def new_router(eviction: str) -> Router:
    router = Router(RouterSettings(block_size=BS, eviction={"name": eviction}, max_evict_blocks=1 << 20), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    return router


def state(router: Router) -> dict[str, Any]:
    while router.drain_step():
        pass
    w = router.workers.get("w")
    pages = None if w.pages is None else {
        eh: (s.anchor, s.tail, s.tail_pages, s.seed, list(s.blocks), s.tail_extra) for eh, s in w.pages._pages.items()}
    groups = None if w.groups is None else (dict(w.groups._masks), w.groups._seen, w.groups._non_reusable, w.groups._first)
    counters = {k: router.counters[k] for k in ("blocks_stored", "blocks_removed", "orphan_blocks", "unknown_removals",
                                                 "events_rejected", "gaps", "restarts", "batches_duplicate")}
    return {
        "blocks": sorted(router.export_blocks("w")),
        "count": router.index.count(w.slot),
        "index": len(router.index),
        "engine_keys": sorted(w.engine_keys.items()),
        "pages": pages,
        "groups": groups,
        "counters": counters,
        "rejected": dict(w.events_rejected),
        "state": (w.state, w.state_reason, w.resync_needed, w.gaps),
        # the eviction policy's view: which blocks it would give up first, in order
        "evict": router.evict_hint(EvictRequest("w", blocks=1 << 20)).keys,
    }


def apply_whole(router: Router, batches: list[list[CacheEvent]]) -> None:
    for seq, events in enumerate(batches):
        router.apply(EventBatch("w", seq, tuple(events)), per_event=True)


def apply_in_parts(router: Router, batches: list[list[CacheEvent]], sizes: list[int]) -> int:
    seq = 0
    for i, events in enumerate(batches):
        size = sizes[i % len(sizes)]
        for part in split_events(events, size, BS):
            assert batch_blocks(part, BS) <= size or len(part) == 1
            router.apply(EventBatch("w", seq, part), per_event=True)
            seq += 1
    return seq


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    page=st.sampled_from([BS, 1, 3, 2 * BS, 6]),
    groups=st.booleans(),
    batches=st.integers(1, 6),
    sizes=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    eviction=st.sampled_from(["lru", "lfu", "hybrid"]),
)
def test_a_batch_applied_in_parts_leaves_the_router_as_the_whole_batch_does(seed, page, groups, batches, sizes, eviction):
    engine = Engine(random.Random(seed), page, groups)
    stream = [engine.events(engine.rng.randint(1, 5)) for _ in range(batches)]
    whole, parts = new_router(eviction), new_router(eviction)
    apply_whole(whole, stream)
    applied = apply_in_parts(parts, stream, sizes)
    assert applied >= len(stream)
    assert state(parts) == state(whole)


def test_a_long_chain_is_cut_between_pages_that_chain_by_engine_hash():
    tokens = array("I", range(10 * BS)).tobytes()
    ev = Stored(tokens, tuple(range(100, 110)), 7, BS, "m", "l", 0, "full_attention", "s", (0,) * 9 + (5,))
    parts = list(split_events([Removed((1, 2, 3)), ev, Cleared()], 4, BS))
    assert [batch_blocks(p, BS) for p in parts] == [4, 4, 4, 2]
    pieces = [e for p in parts for e in p if type(e) is Stored]
    assert [e.engine_hashes for e in pieces] == [(100,), (101, 102, 103, 104), (105, 106, 107, 108), (109,)]
    assert [e.parent_engine_hash for e in pieces] == [7, 100, 104, 108]
    assert b"".join(e.token_ids for e in pieces) == tokens  # type: ignore[misc]
    assert [e.extra_hashes for e in pieces] == [None, None, None, (5,)]
    assert {(e.block_size, e.model, e.lora, e.group, e.group_kind, e.salt) for e in pieces} == {
        (BS, "m", "l", 0, "full_attention", "s")}
    assert type(parts[-1][-1]) is Cleared


def test_pages_smaller_than_the_router_block_are_cut_only_at_whole_router_blocks():
    ev = Stored(array("I", range(40)).tobytes(), tuple(range(40)), None, 1)  # 1-token pages, blocks of 4
    pieces = [e for part in split_events([ev], 10, BS) for e in part]
    assert [len(e.engine_hashes) for e in pieces] == [8, 8, 8, 8, 8]  # type: ignore[arg-type]
    big = Stored(array("I", range(64)).tobytes(), (1, 2), None, 32)  # 32-token pages: 8 blocks each
    assert event_blocks(big, BS) == 16
    assert [len(p[0].engine_hashes) for p in split_events([big], 8, BS)] == [1, 1]  # type: ignore[union-attr]


@pytest.mark.parametrize("ev", [
    Stored(array("I", range(40)).tobytes(), tuple(range(9)), None, BS),  # pages do not add up
    Stored(array("I", range(40)).tobytes(), tuple(range(10)), None, BS, group=MAX_KV_GROUPS),  # group refused
    Stored(array("I", range(40)).tobytes(), tuple(range(10)), None, 0),  # no page size to cut by
    Stored(array("I", range(40)).tobytes(), None, None, BS),  # no engine hashes
])
def test_a_store_the_router_refuses_whole_is_never_cut(ev):
    parts = list(split_events([Removed((1,)), ev, Removed((2,))], 3, BS))
    assert parts == [(Removed((1,)),), (ev,), (Removed((2,)),)]


def test_a_removal_of_a_refused_group_is_counted_once_and_applies_to_every_group():
    parts = list(split_events([Removed(tuple(range(10)), MAX_KV_GROUPS)], 4, BS))
    assert [p[0].group for p in parts] == [MAX_KV_GROUPS, None, None]  # type: ignore[union-attr]
    assert [h for p in parts for h in p[0].engine_hashes] == list(range(10))  # type: ignore[union-attr]


def test_a_batch_within_the_part_size_is_one_part_of_the_same_events():
    events = [Removed((1, 2)), Cleared(), Stored(array("I", range(8)).tobytes(), (1, 2), None, BS)]
    assert list(split_events(events, 5, BS)) == [tuple(events)]
