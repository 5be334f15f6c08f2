"""The SDK cuts what it buffers into batches the router takes whole (``kvrouter_client._batches``):
every batch it builds is under the event, block and byte limits as the router counts them, and
its parts add up to the events recorded, in order, each Stored part chained to the one before."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter_client import Cleared, Removed, Stored, keys
from kvrouter_client._batches import BatchLimits, check_limits, pack_batches
from kvrouter_client._generated.kvrouter.v1 import router_pb2 as pb
from kvrouter_client._types import event_to_pb
from kvrouterd.server import convert

WORKER = "wörker-0"


@st.composite
def events(draw: st.DrawFn, block_size: int) -> list:  # type: ignore[type-arg]
    out: list = []  # type: ignore[type-arg]
    for kind in draw(st.lists(st.sampled_from(["stored", "keyed", "removed", "cleared"]), min_size=1, max_size=12)):
        if kind in ("stored", "keyed"):
            pages = draw(st.integers(1, 300))
            tokens = [draw(st.integers(0, 2**32 - 1))] * (pages * block_size)
            hashes = None if kind == "keyed" else [draw(st.integers(0, 2**64 - 1)) for _ in range(pages)]
            parent = draw(st.one_of(st.none(), st.integers(0, 2**64 - 1)))
            out.append(Stored(tokens, hashes, parent, draw(st.text(max_size=20)), draw(st.text(max_size=5))))
        elif kind == "removed":
            out.append(Removed([2**64 - 1] * draw(st.integers(0, 400))))
        else:
            out.append(Cleared())
    return out


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([1, 4, 16]), st.integers(1, 8), st.integers(8, 200), st.integers(1200, 9000))
def test_every_batch_fits_the_limits_and_the_parts_add_up(data, block_size, max_events, max_blocks, max_bytes):
    limits = BatchLimits(max_events, max_blocks, max_bytes)
    check_limits(limits, block_size, WORKER)
    recorded = data.draw(events(block_size))
    batches = list(pack_batches(recorded, block_size, limits, WORKER))
    router = convert.BatchLimits(max_events, 256, max_bytes, max_blocks, block_size)
    for i, batch in enumerate(batches):
        msg = pb.EventBatch(worker_id=WORKER, sequence=2**63 - 1, timestamp=1.0,
                            events=[event_to_pb(e, block_size) for e in batch])
        data_ = msg.SerializeToString()
        assert len(data_) <= max_bytes and len(batch) <= max_events
        # the router's own count (the reference convert path) takes it
        assert convert.batch_blocks(msg, block_size, max_blocks) <= max_blocks
        assert type(convert.event_batch_message(data_, router)) is not convert.BatchTooLarge
    parts = [e for b in batches for e in b]
    # the parts, merged back in order, are the recorded events
    merged: list = []  # type: ignore[type-arg]
    for part in parts:
        last = merged[-1] if merged else None
        if isinstance(part, Stored) and isinstance(last, Stored) and _continues(last, part, block_size):
            merged[-1] = Stored(list(last.token_ids) + list(part.token_ids),
                                None if part.engine_hashes is None else list(last.engine_hashes) + list(part.engine_hashes),
                                last.parent_engine_hash, last.model, last.lora)
        else:
            merged.append(part)
    assert _same(merged, recorded)


def _continues(last: Stored, part: Stored, block_size: int) -> bool:
    """``part`` is the next part of ``last``'s chain: its parent is ``last``'s final page."""
    if part.engine_hashes is None:
        seed = last.parent_engine_hash if last.parent_engine_hash is not None else keys.namespace_seed(last.model, last.lora)
        return part.parent_engine_hash == keys.chain_keys(keys.tokens_to_bytes(last.token_ids), block_size, seed)[-1]
    return last.engine_hashes is not None and part.parent_engine_hash == last.engine_hashes[-1]


def _same(merged: list, recorded: list) -> bool:  # type: ignore[type-arg]
    """Equal, with removals merged the same way (a long Removed becomes several in a row)."""
    def norm(evs: list) -> list:  # type: ignore[type-arg]
        out: list = []  # type: ignore[type-arg]
        for e in evs:
            if isinstance(e, Removed) and out and isinstance(out[-1], Removed):
                out[-1] = Removed(list(out[-1].engine_hashes) + list(e.engine_hashes))
            elif isinstance(e, Stored):
                out.append(Stored(list(e.token_ids), None if e.engine_hashes is None else list(e.engine_hashes),
                                  e.parent_engine_hash, e.model, e.lora))
            else:
                out.append(e if not isinstance(e, Removed) else Removed(list(e.engine_hashes)))
        return out
    return norm(merged) == norm(recorded)


def test_a_page_larger_than_a_batch_is_refused_at_construction():
    with pytest.raises(ValueError, match="cannot hold one page of 1024 tokens"):
        check_limits(BatchLimits(512, 4096, 4096), 1024, WORKER)


def test_a_chain_is_cut_at_the_block_limit_and_chained_by_keys():
    rng = random.Random(1)
    tokens = [rng.randrange(2**32) for _ in range(80 * 16)]
    batches = list(pack_batches([Stored(tokens, model="m")], 16, BatchLimits(512, 32, 1 << 20), WORKER))
    assert [len(b[0].token_ids) // 16 for b in batches] == [32, 32, 16]
    chain = keys.block_keys(tokens, 16, model="m")
    assert [b[0].parent_engine_hash for b in batches] == [None, chain[31], chain[63]]
