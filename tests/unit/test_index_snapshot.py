"""Router.export_blocks / import_blocks: a replica warmed from a peer, or restored from a snapshot, is the peer."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.clock import ManualClock
from kvrouterd.errors import InvalidRequest
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Cleared, EventBatch, Removed, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.snapshot import (
    SNAPSHOT_MAGIC, WarmResult, _import, encode_snapshot, export_chunks, restore_snapshot, snapshot_position,
)

from ..invariants import check_router_invariants, index_state

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


# ---- a restored replica is its peer, block for block (issue #28 item 12) ----------------------
# an engine evicts a chain's first blocks and keeps the rest: the index keeps the evicted ones
# (held by none) so the rest is matched once the engine stores them again; a replica restored
# from a snapshot or warmed from the peer dropped the rest as unreachable


def first_block_evicted() -> Router:
    r = router(["x", "y"])
    r.apply(EventBatch("x", 0, (Stored(token_ids=tokens(0, 10), engine_hashes=tuple(range(1, 11))),)))
    r.apply(EventBatch("x", 1, (Removed((1,)),)))
    r.apply(EventBatch("y", 0, (Stored(token_ids=tokens(0, 2), engine_hashes=(21, 22)),)))
    r.apply(EventBatch("y", 1, (Stored(token_ids=tokens(900, 3), engine_hashes=(23, 24, 25), parent_engine_hash=22),)))
    r.apply(EventBatch("y", 2, (Removed((21, 22)),)))  # y's chain now hangs under x's second block
    r.apply(EventBatch("y", 3, (Stored(token_ids=tokens(500, 3), engine_hashes=(31, 32, 33)),)))
    r.apply(EventBatch("y", 4, (Removed((31,)),)))  # and this one under a block nobody holds
    return r


async def warm_over_export(src: Router, dst: Router, max_blocks: int = 0, step: int = 3) -> WarmResult:
    result = WarmResult()
    await _import(dst, export_chunks(src, (), max_blocks=max_blocks, step=step), result)
    return result


async def restore(src: Router, dst: Router) -> WarmResult:
    _, result = await restore_snapshot(dst, encode_snapshot(src, 5))
    return result


@pytest.mark.parametrize("copy", [warm_over_export, restore])
async def test_chains_under_an_evicted_first_block_are_restored_and_match_once_it_is_back(copy):
    src, dst = first_block_evicted(), router([])
    result = await copy(src, dst)
    assert result.skipped == 0 and result.blocks == 9 + 3 + 2
    assert index_state(dst) == index_state(src)
    assert len(src.index) == 16 and src.indexed_blocks == 14  # the two evicted first blocks are no hit
    again = Stored(token_ids=tokens(0, 1), engine_hashes=(1,))  # the engine computes it again
    for r in (src, dst):
        r.apply(EventBatch("x", 2, (again,)))
    assert overlaps(dst, tokens(0, 10)) == overlaps(src, tokens(0, 10)) == {"x": 10, "y": 0}
    assert index_state(dst) == index_state(src)


def lora_route(r: Router, adapter: str) -> tuple[str, str]:
    decision, _, _ = r.decide(RouteRequest("", r.keys_for_tokens(tokens(7000, 2), lora=adapter), 2 * BS, lora=adapter))
    return decision.worker_id, decision.lora_placement


@pytest.mark.parametrize("copy", [warm_over_export, restore])
async def test_lora_residency_comes_along_and_the_lora_stage_prefers_the_holder(copy):
    src = peer()
    src.report_load("z", 0, 0, 0.0, ["sql", "chat"])  # least recently used first: sql
    src.report_load("x", 0, 0, 0.0, ["chat"])
    assert lora_route(src, "sql") == ("z", "loaded")
    dst = router([])
    await copy(src, dst)
    assert {w.id: list(w.loras) for w in dst.workers} == {"x": ["chat"], "y": [], "z": ["sql", "chat"]}
    assert lora_route(dst, "sql") == ("z", "loaded")


async def test_adopted_residency_is_older_than_what_the_replica_learned_itself():
    src = peer()
    src.report_load("z", 0, 0, 0.0, ["sql", "chat"])
    dst = router(["x", "y", "z"])
    dst.report_load("z", 0, 0, 0.0, ["code"])  # an engine's own report that came first
    await warm_over_export(src, dst)
    assert list(dst.workers.get("z").loras) == ["sql", "chat", "code"]


async def test_a_snapshot_without_residency_restores_as_before():
    """Snapshots written before ``Worker.loaded_loras`` existed: the same chunks without it."""
    src = peer()
    src.report_load("z", 0, 0, 0.0, ["sql"])
    data = encode_snapshot(src, 5)
    frames, pos = [], len(SNAPSHOT_MAGIC)
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        frames.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    chunks = [pb.IndexChunk.FromString(f) for f in frames[1:]]
    for chunk in chunks:
        chunk.worker.ClearField("loaded_loras")
    old = SNAPSHOT_MAGIC + b"".join(struct.pack(">I", len(f)) + f
                                    for f in (frames[0], *(c.SerializeToString() for c in chunks)))
    dst = router([])
    sequence, result = await restore_snapshot(dst, old)
    assert sequence == 5 and result.skipped == 0
    assert index_state(dst) == index_state(src)
    assert all(not w.loras for w in dst.workers)
    assert lora_route(dst, "sql")[1] == "free_slot"


PATHS = [p for d in range(1, 5) for p in itertools.product(range(3), repeat=d)]
WORKERS = ("x", "y", "z")


def path_tokens(path: tuple[int, ...]) -> list[int]:
    return [10_000 * depth + 1_000 * sym + j for depth, sym in enumerate(path) for j in range(BS)]


def engine_hash(path: tuple[int, ...]) -> int:
    return 1 + PATHS.index(path)  # an engine's hash names the prefix, as vLLM's chained hashes do


stores = st.tuples(st.just("store"), st.sampled_from(WORKERS), st.sampled_from(PATHS), st.sampled_from([0, 0, 1, 2]))
events = st.one_of(
    stores,
    stores,
    # picks among the blocks the worker stored (an engine evicts what it holds), first blocks too
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), st.lists(st.integers(0, 1 << 16), min_size=1, max_size=3)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
)


def replay(stream: list[tuple]) -> Router:
    r = router(list(WORKERS))
    sequence = dict.fromkeys(WORKERS, 0)
    stored: dict[str, list[tuple[int, ...]]] = {w: [] for w in WORKERS}
    for op, wid, *args in stream:
        if op == "store":
            path, start = args
            start = min(start, len(path) - 1)
            stored[wid] += [path[:d] for d in range(start + 1, len(path) + 1)]
            ev = Stored(token_ids=tuple(path_tokens(path)[start * BS :]),
                        engine_hashes=tuple(engine_hash(path[:d]) for d in range(start + 1, len(path) + 1)),
                        parent_engine_hash=engine_hash(path[:start]) if start else None)
        elif op == "remove":
            held = stored[wid] or PATHS
            ev = Removed(tuple(engine_hash(held[pick % len(held)]) for pick in args[0]))
        else:
            ev = Cleared()
        r.apply(EventBatch(wid, sequence[wid], (ev,)))
        sequence[wid] += 1
    return r


@settings(max_examples=150, deadline=None)
@given(stream=st.lists(events, min_size=4, max_size=40), max_blocks=st.integers(0, 4), step=st.integers(1, 6))
def test_a_restored_replica_equals_its_source_after_any_event_stream(stream, max_blocks, step):
    src = replay(stream)
    for copy in (restore, lambda s, d: warm_over_export(s, d, max_blocks, step)):
        dst = router([])
        result = asyncio.run(copy(src, dst))
        assert result.skipped == 0
        assert index_state(dst) == index_state(src)
        check_router_invariants(dst)


async def test_a_snapshot_names_its_messages_digest_and_one_written_before_reads_as_before():
    src = peer()
    assert snapshot_position(encode_snapshot(src, 5, "ab12")) == (5, "ab12")
    data = encode_snapshot(src, 5)
    (n,) = struct.unpack_from(">I", data, len(SNAPSHOT_MAGIC))
    header = json.loads(data[len(SNAPSHOT_MAGIC) + 4 : len(SNAPSHOT_MAGIC) + 4 + n])
    del header["stream_digest"]  # as deployed buckets hold them
    raw = json.dumps(header).encode()
    old = SNAPSHOT_MAGIC + struct.pack(">I", len(raw)) + raw + data[len(SNAPSHOT_MAGIC) + 4 + n :]
    assert snapshot_position(old) == (5, "")
    dst = router([])
    sequence, result = await restore_snapshot(dst, old)
    assert sequence == 5 and result.skipped == 0 and index_state(dst) == index_state(src)
    with pytest.raises(InvalidRequest, match="does not parse"):
        bad = json.dumps({**header, "stream_digest": 7}).encode()
        snapshot_position(SNAPSHOT_MAGIC + struct.pack(">I", len(bad)) + bad)
