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
    message,
)
from kvrouterd.protocols import BatchOutcome, Cleared, EventBatch, Removed, Stored

FULL = Stored(
    token_ids=bytes(range(64)), engine_hashes=(1, (1 << 64) - 1), parent_engine_hash=7, block_size=8,
    model="llama", lora="sql", group=1, group_kind="sliding_window", salt="tenant-a", extra_hashes=(0, 99),
)


def test_every_event_field_survives_the_bus() -> None:
    batch = EventBatch("gpu.1", 41, (Cleared(), FULL, Stored(b"\x01\x00\x00\x00" * 16, None), Removed((3, 4), 2),
                                      Removed((5,))))
    assert decode_bridged(message([encode_batch(batch)]), 100) == [batch]


def test_token_ids_given_as_ints_travel_as_uint32_bytes() -> None:
    batch = EventBatch("w", 0, (Stored(tuple(range(16)), (1,)),))
    ((stored,),) = (call.events for call in decode_bridged(message([encode_batch(batch)]), 10))  # type: ignore[union-attr]
    assert isinstance(stored, Stored) and stored.token_ids == b"".join(i.to_bytes(4, "little") for i in range(16))


def test_resets_and_rejections_round_trip() -> None:
    calls = [encode_reset("w", True), encode_rejected("w", {"malformed_batch": 2}, True)]
    assert decode_bridged(message(calls), 1) == [Reset("w", True), Rejected("w", {"malformed_batch": 2}, True)]


@pytest.mark.parametrize("data, match", [
    (b"\xc1", "does not parse"),
    (msgpack.packb([]), "non-empty list of calls"),
    (msgpack.packb({"op": 0}), "non-empty list of calls"),
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
    if data[:1] not in (b"\xc1", b"\x90", b"\x81"):  # a call: sent alone, and after a good one
        with pytest.raises(InvalidRequest, match=match):
            decode_bridged(message([encode_reset("w", False), data]), 2)
        data = message([data])
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
    assert replay(message([encode_reset("w", True)])).gap == 1
    outcome = replay(message([encode_batch(batch), encode_rejected("w", {"unknown_type": 1}, False)]))
    assert outcome.rejected == {"unknown_type": 1} and not outcome.duplicate
    assert calls == [("reset", "w", True), ("apply", batch), ("rejected", "w", {"unknown_type": 1}, False)]


def test_a_call_the_router_refuses_does_not_stop_the_others_and_is_reported() -> None:
    from kvrouterd.errors import NotFound

    applied: list[str] = []

    def apply(batch: EventBatch) -> BatchOutcome:
        if batch.worker_id == "gone":
            raise NotFound("unknown worker 'gone'")
        applied.append(batch.worker_id)
        return BatchOutcome(applied=True)

    replay = BridgedEvents(apply, lambda *a: None, lambda *a: None, max_events=10)
    with pytest.raises(NotFound, match="gone"):
        replay(message([encode_batch(EventBatch("gone", 0, ())), encode_batch(EventBatch("w", 0, ()))]))
    assert applied == ["w"]
