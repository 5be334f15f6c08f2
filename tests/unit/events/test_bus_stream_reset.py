"""A replica whose event stream NATS lost (a server restarted without its store) follows the new
one from its start: what it counts as applied, and when it is caught up, are the new stream's."""

from __future__ import annotations

from types import SimpleNamespace

from kvrouterd.events.bus_config import NatsBusConfig
from kvrouterd.events.nats_bus import BusEventSource, replaced
from kvrouterd.protocols import BatchOutcome


def _info(created: str, last_seq: int, first_seq: int = 1) -> SimpleNamespace:
    return SimpleNamespace(created=created, state=SimpleNamespace(last_seq=last_seq, first_seq=first_seq))


def _message(seq: int) -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=0),
                           data=b"batch %d" % seq, headers=None, subject="kvrouter.events.w0")


class _Stream:
    """A JetStream stand-in holding one stream's messages by sequence (``get_msg``)."""

    def __init__(self, messages: dict[int, bytes]) -> None:
        self.messages = messages

    async def get_msg(self, stream: str, seq: int) -> SimpleNamespace:
        from nats.js.errors import NotFoundError

        if seq not in self.messages:
            raise NotFoundError
        return SimpleNamespace(data=self.messages[seq] or None)


def _source(applied: list[int]) -> BusEventSource:
    return BusEventSource(NatsBusConfig(kind="nats"), decode=lambda data: data,  # type: ignore[arg-type,return-value]
                          apply=lambda batch: applied.append(1) or BatchOutcome(applied=True))


async def test_a_stream_is_a_new_one_when_it_ends_before_or_holds_other_data_at_what_was_applied() -> None:
    same = _Stream({40: b"batch 40", 41: b"batch 41"})
    # the creation time plays no part: some nats-server releases change it on a restart that kept the stream
    assert not await replaced(same, "S", _info("t1", 41), 40, b"batch 40")
    assert await replaced(same, "S", _info("t0", 39), 40, b"batch 40")  # ends before what was applied
    assert await replaced(_Stream({40: b"another"}), "S", _info("t0", 90), 40, b"batch 40")
    # nothing to compare: aged out, deleted, or nothing applied yet; the same stream, as before
    assert not await replaced(same, "S", _info("t0", 90, first_seq=50), 40, b"batch 40")
    assert not await replaced(_Stream({}), "S", _info("t0", 90), 40, b"batch 40")
    assert not await replaced(same, "S", _info("t0", 0), 0, None)


async def test_a_replica_catching_up_follows_the_new_streams_messages_and_end() -> None:
    applied: list[int] = []
    source = _source(applied)
    source._target = 100  # started behind a 100-message stream
    for seq in (1, 2, 3):
        await source._on_message(_message(seq))
    assert not source.caught_up.is_set()
    source._stream_lost(_info("t1", 2))  # the new stream holds 2 messages so far
    assert source.stats.stream_resets == 1 and source.stats.last_stream_sequence == 0 and source._applied_data is None
    for seq in (1, 2):  # below the 3 applied from the old stream, yet new: applied
        await source._on_message(_message(seq))
    assert len(applied) == 5 and source.caught_up.is_set() and source.stats.stream_skips == 0


async def test_a_replica_catching_up_when_the_new_stream_is_empty_is_caught_up() -> None:
    source = _source([])
    source._target = 100
    source._stream_lost(_info("t1", 0))
    assert source.caught_up.is_set()


def test_a_replica_replaying_the_load_stream_when_nats_loses_it_sends_its_start_marker_again() -> None:
    from kvrouterd.events.replica_sync import ReplicaSync

    sync = ReplicaSync(NatsBusConfig(kind="nats"), 300.0, decode=lambda data, age: ("", None),
                       apply=lambda delta, own: None, marker=lambda replica: b"marker:" + replica.encode())
    sync.stats.last_stream_sequence = 40
    sync._stream_lost(_info("t1", 0))
    assert sync.stats.stream_resets == 1 and sync.stats.last_stream_sequence == 0
    assert [encode(sync.replica_id) for encode in sync._outbox] == [b"marker:" + sync.replica_id.encode()]
    sync.caught_up.set()
    sync._outbox.clear()
    sync._stream_lost(_info("t2", 0))  # caught up already: nothing to wait for
    assert not sync._outbox
