"""The bridge's message encoding (events/bridge.py): what the ZMQ source hands over at the
bridge is what a replica replays, field for field, and anything else is refused."""

from __future__ import annotations

import msgpack
import pytest

from kvrouterd.errors import InvalidRequest
from kvrouterd.events.bridge import (
    BridgedEvents,
    Rejected,
    Reset,
    decode_bridged,
    encode_batch,
    encode_rejected,
    encode_reset,
)
from kvrouterd.protocols import BatchOutcome, Cleared, EventBatch, Removed, Stored

FULL = Stored(
    token_ids=bytes(range(64)), engine_hashes=(1, (1 << 64) - 1), parent_engine_hash=7, block_size=8,
    model="llama", lora="sql", group=1, group_kind="sliding_window", salt="tenant-a", extra_hashes=(0, 99),
)


def test_every_event_field_survives_the_bus() -> None:
    batch = EventBatch("gpu.1", 41, (Cleared(), FULL, Stored(b"\x01\x00\x00\x00" * 16, None), Removed((3, 4), 2),
                                      Removed((5,))))
    assert decode_bridged(encode_batch(batch), 100) == batch


def test_token_ids_given_as_ints_travel_as_uint32_bytes() -> None:
    batch = EventBatch("w", 0, (Stored(tuple(range(16)), (1,)),))
    (stored,) = decode_bridged(encode_batch(batch), 10).events  # type: ignore[union-attr]
    assert isinstance(stored, Stored) and stored.token_ids == b"".join(i.to_bytes(4, "little") for i in range(16))


def test_resets_and_rejections_round_trip() -> None:
    assert decode_bridged(encode_reset("w", True), 1) == Reset("w", True)
    assert decode_bridged(encode_rejected("w", {"malformed_batch": 2}, True), 1) == Rejected("w", {"malformed_batch": 2}, True)


@pytest.mark.parametrize("data, match", [
    (b"\xc1", "does not parse"),
    (msgpack.packb({"op": 0}), "expected"),
    (msgpack.packb([0, "", 0, []]), "without worker_id"),
    (msgpack.packb([9, "w", 0]), "unknown operation"),
    (msgpack.packb([0, "w", -1, []]), "sequence"),
    (msgpack.packb([0, "w", 0, [[7]]]), "unknown event layout"),
    (msgpack.packb([0, "w", 0, [[1, ["x"], None]]]), "engine_hashes"),
    (msgpack.packb([0, "w", 0, [[0, b"abc", None, None, 0, "", "", None, None, "", None]]]), "uint32"),
    (msgpack.packb([0, "w", 0, [[2]] * 3]), "max_batch_events"),
    (msgpack.packb([1, "w", "yes"]), "unknown operation"),
    (msgpack.packb([2, "w", {"r": -1}, False]), "count"),
])
def test_a_malformed_message_is_refused_with_the_reason(data: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        decode_bridged(data, 2)


def test_a_replica_makes_the_call_the_source_made_at_the_bridge() -> None:
    calls: list[tuple[object, ...]] = []
    replay = BridgedEvents(
        apply=lambda batch: calls.append(("apply", batch)) or BatchOutcome(applied=True),  # type: ignore[func-returns-value]
        reset=lambda wid, lost: calls.append(("reset", wid, lost)),
        rejected=lambda wid, counts, lost: calls.append(("rejected", wid, dict(counts), lost)),
        max_events=10,
    )
    batch = EventBatch("w", 0, (Cleared(),))
    assert replay(encode_reset("w", True)).gap == 1
    replay(encode_batch(batch))
    assert replay(encode_rejected("w", {"unknown_type": 1}, False)).rejected == {"unknown_type": 1}
    assert calls == [("reset", "w", True), ("apply", batch), ("rejected", "w", {"unknown_type": 1}, False)]
