"""A replica whose event stream NATS lost (a server restarted without its store) follows the new
one from its start: what it counts as applied, and when it is caught up, are the new stream's."""

from __future__ import annotations

from types import SimpleNamespace

from kvrouterd.events.bus_config import NatsBusConfig
from kvrouterd.events.nats_bus import BusEventSource, recreated
from kvrouterd.protocols import BatchOutcome


def _info(created: str, last_seq: int) -> SimpleNamespace:
    return SimpleNamespace(created=created, state=SimpleNamespace(last_seq=last_seq))


def _message(seq: int) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=0),
                           data=b"", headers=None, subject="kvrouter.events.w0")


def _source(applied: list[int]) -> BusEventSource:
    return BusEventSource(NatsBusConfig(kind="nats"), decode=lambda data: data,  # type: ignore[arg-type,return-value]
                          apply=lambda batch: applied.append(1) or BatchOutcome(applied=True))


def test_a_stream_is_new_when_created_again_or_shorter_than_what_was_applied() -> None:
    assert not recreated(_info("t0", 40), "t0", 40)
    assert not recreated(_info("t0", 90), "t0", 40)
    assert recreated(_info("t1", 90), "t0", 40)  # created again and already past our sequence
    assert recreated(_info("t0", 3), "t0", 40)  # a server that reports no creation time the same


async def test_a_replica_catching_up_follows_the_new_streams_messages_and_end() -> None:
    applied: list[int] = []
    source = _source(applied)
    source._target, source._created = 100, "t0"  # started behind a 100-message stream
    for seq in (1, 2, 3):
        await source._on_message(_message(seq))
    assert not source.caught_up.is_set()
    source._stream_lost(_info("t1", 2))  # the new stream holds 2 messages so far
    assert source.stats.stream_resets == 1 and source.stats.last_stream_sequence == 0
    for seq in (1, 2):  # below the 3 applied from the old stream, yet new: applied
        await source._on_message(_message(seq))
    assert len(applied) == 5 and source.caught_up.is_set() and source.stats.stream_skips == 0


async def test_a_replica_catching_up_when_the_new_stream_is_empty_is_caught_up() -> None:
    source = _source([])
    source._target, source._created = 100, "t0"
    source._stream_lost(_info("t1", 0))
    assert source.caught_up.is_set()


def test_a_replica_replaying_the_load_stream_when_nats_loses_it_sends_its_start_marker_again() -> None:
    from kvrouterd.events.replica_sync import ReplicaSync

    sync = ReplicaSync(NatsBusConfig(kind="nats"), 300.0, decode=lambda data, age: ("", None),
                       apply=lambda delta, own: None, marker=lambda replica: b"marker:" + replica.encode())
    sync._created = "t0"
    sync.stats.last_stream_sequence = 40
    sync._stream_lost(_info("t1", 0))
    assert sync.stats.stream_resets == 1 and sync.stats.last_stream_sequence == 0
    assert [encode(sync.replica_id) for encode in sync._outbox] == [b"marker:" + sync.replica_id.encode()]
    sync.caught_up.set()
    sync._outbox.clear()
    sync._stream_lost(_info("t2", 0))  # caught up already: nothing to wait for
    assert not sync._outbox
