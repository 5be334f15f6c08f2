"""Router.export_blocks / import_blocks: a replica warmed from a peer matches like the peer."""

from __future__ import annotations

import random

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, EventBatch, Removed, Stored
from kvrouterd.router import Router, RouterSettings

BS = 4


def router(order: list[str]) -> Router:
    r = Router(RouterSettings(block_size=BS), ManualClock(), random.Random(0))
    for wid in order:
        r.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", mode=CacheMode.EVENTS))
    return r


def tokens(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def peer() -> Router:
    r = router(["x", "y", "z"])
    shared = tokens(0, 3)
    r.apply(EventBatch("x", 0, (Stored(token_ids=shared + tokens(100, 2), engine_hashes=(11, 12, 13, 14, 15)),)))
    # y stores the shared prefix and a branch of its own, then evicts the prefix: its branch
    # hangs under blocks only x holds
    r.apply(EventBatch("y", 0, (Stored(token_ids=shared, engine_hashes=(21, 22, 23)),)))
    r.apply(EventBatch("y", 1, (Stored(token_ids=tokens(500, 4), engine_hashes=(24, 25, 26, 27), parent_engine_hash=23),)))
    r.apply(EventBatch("y", 2, (Removed((21, 22, 23)),)))
    r.apply(EventBatch("z", 0, (Stored(token_ids=tokens(900, 6), engine_hashes=None),)))
    return r


def overlaps(r: Router, prompt: list[int]) -> dict[str, int]:
    keys = r.keys_for_tokens(prompt)
    match = r.index.match(keys, sum(w.bit for w in r.workers))
    return {w.id: match.overlap(w.slot) for w in r.workers}


def warm(src: Router, dst: Router, order: list[str]) -> list[tuple]:
    deferred = []
    for wid in order:
        deferred += [(wid, b) for b in dst.import_blocks(wid, src.export_blocks(wid))]
    left = []
    for wid, block in deferred:
        left += dst.import_blocks(wid, [block])
    return left


def test_exported_blocks_come_parents_first():
    r = peer()
    for w in r.workers:
        seen: set[int] = set()
        for key, parent, _ in r.export_blocks(w.id):
            assert parent is None or parent in seen or not r.index.holds(w.slot, parent)
            seen.add(key)
        assert len(seen) == r.index.count(w.slot)


def test_a_warmed_replica_matches_like_its_peer_and_applies_later_removals():
    src = peer()
    # y first: its branch's parents (held only by x) arrive later and are retried
    dst = router(["z", "y", "x"])
    assert warm(src, dst, ["y", "z", "x"]) == []
    for w in src.workers:
        assert dst.index.count(dst.workers.get(w.id).slot) == src.index.count(w.slot)
    for prompt in (tokens(0, 3) + tokens(100, 2), tokens(0, 3) + tokens(500, 4), tokens(900, 6), tokens(0, 2)):
        assert overlaps(dst, prompt) == overlaps(src, prompt)
    # the engine hashes came along: y's later removal by engine hash lands on the replica too
    dst.apply(EventBatch("y", 0, (Removed((27,)),)))
    assert dst.index.count(dst.workers.get("y").slot) == 3


def test_blocks_without_ancestors_anywhere_are_left_over():
    src = peer()
    dst = router(["y"])  # x is not on the replica: y's branch has no ancestors there
    left = dst.import_blocks("y", src.export_blocks("y"))
    assert len(left) == 4 and dst.index.count(dst.workers.get("y").slot) == 0  # the whole branch
