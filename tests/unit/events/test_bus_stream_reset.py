"""A replica whose event stream NATS lost (a server restarted without its store) follows the new
one from its start: what it counts as applied, and when it is caught up, are the new stream's."""

from __future__ import annotations

from types import SimpleNamespace

from kvrouterd.events.bus_config import NatsBusConfig
from kvrouterd.events.nats_bus import BusEventSource, replaced
from kvrouterd.protocols import BatchOutcome


def _info(created: str, last_seq: int, first_seq: int = 1) -> SimpleNamespace:
    return SimpleNamespace(created=created, state=SimpleNamespace(last_seq=last_seq, first_seq=first_seq))


def _message(seq: int, data: bytes = b"batch") -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=0),
                           data=b"%s %d" % (data, seq), headers=None, subject="kvrouter.events.w0")


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


class _Server:
    """A JetStream stand-in for one stream a test may delete (``messages`` None) or replace while
    a reader stays connected: ``stream_info``, ``get_msg`` and the calls a reader subscribes with."""

    def __init__(self, messages: dict[int, bytes] | None) -> None:
        self.messages = messages
        self.subscribed: list[int] = []  # the start sequence of each consumer (1: from the start)
        self.created = 0

    async def stream_info(self, stream: str) -> SimpleNamespace:
        from nats.js.errors import NotFoundError

        if self.messages is None:
            raise NotFoundError
        return _info("t", max(self.messages, default=0), min(self.messages, default=1))

    async def get_msg(self, stream: str, seq: int) -> SimpleNamespace:
        return await _Stream(self.messages or {}).get_msg(stream, seq)

    async def add_stream(self, config: object) -> None:
        self.messages, self.created = {}, self.created + 1

    async def subscribe(self, subject: str, cb: object, ordered_consumer: bool, config: object) -> SimpleNamespace:
        self.subscribed.append(getattr(config, "opt_start_seq", None) or 1)

        async def unsubscribe() -> None:
            pass

        return SimpleNamespace(pending_msgs=0, unsubscribe=unsubscribe)


def _applied(source: BusEventSource) -> tuple[int, bytes | None]:
    return source.stats.last_stream_sequence, source._applied_data


async def _watched(applied: int) -> tuple[BusEventSource, _Server, object]:
    """A reader that applied messages 1..``applied`` of a stream holding them, and its StreamWatch."""
    from kvrouterd.events.nats_bus import StreamWatch

    source = _source([])
    server = _Server({seq: b"batch %d" % seq for seq in range(1, applied + 1)})
    for seq in range(1, applied + 1):
        await source._on_message(_message(seq))
    return source, server, StreamWatch(server, "S", lambda: _applied(source), lambda: source.stats.stream_resets)


async def test_the_watch_tells_a_new_stream_from_the_one_followed_while_the_consumer_runs() -> None:
    source, server, watch = await _watched(40)
    assert await watch.check() == (False, await server.stream_info("S"))
    for seq in (41, 42):  # the consumer goes on; the stream does too
        server.messages[seq] = b"batch %d" % seq
        await source._on_message(_message(seq))
    assert not (await watch.check())[0]
    # deleted and made again, and grown past what was applied: its end cannot tell, its content does
    server.messages = {seq: b"other %d" % seq for seq in range(1, 90)}
    lost, info = await watch.check()
    assert lost and info.state.last_seq == 89
    server.messages = None  # deleted, not made again yet
    assert await watch.check() == (True, None)


async def test_the_watch_compares_what_was_applied_at_the_previous_check() -> None:
    """nats-py's ordered consumer re-creates itself after two missed heartbeats, after the last
    sequence it delivered, on whatever stream holds the name now: the messages it then hands over
    are the new stream's, and the latest one applied matches that stream."""
    source, server, watch = await _watched(10)
    assert not (await watch.check())[0]
    server.messages = {seq: b"other %d" % seq for seq in range(1, 13)}
    for seq in (11, 12):  # delivered from the new stream, after the old one's 10
        await source._on_message(_message(seq, b"other"))
    assert (await watch.check())[0]


async def test_the_watch_does_not_count_a_stream_a_reconnect_already_followed_anew() -> None:
    source, server, watch = await _watched(10)
    assert not (await watch.check())[0]
    server.messages = {seq: b"other %d" % seq for seq in range(1, 13)}
    source._stream_lost(await server.stream_info("S"))  # the reconnect's check got there first
    assert not (await watch.check())[0]
    assert not (await watch.check())[0] and source.stats.stream_resets == 1


async def test_a_connected_replica_follows_a_stream_made_again_from_its_start(monkeypatch) -> None:
    import asyncio

    monkeypatch.setattr("kvrouterd.events.nats_bus.LAG_CHECK_S", 0.01)
    applied: list[int] = []
    source = _source(applied)
    server = _Server({seq: b"batch %d" % seq for seq in range(1, 6)})
    source._js = server
    source._target = 5
    await source.start(0)
    try:
        for seq in range(1, 6):
            await source._on_message(_message(seq))
        await asyncio.sleep(0.05)
        assert source.stats.stream_resets == 0 and server.subscribed == [1]
        server.messages = {seq: b"other %d" % seq for seq in range(1, 9)}  # deleted, made again, grown past 5
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(server.subscribed) > 1:
                break
        assert source.stats.stream_resets == 1 and server.subscribed == [1, 1]  # the new consumer: from 1
        assert source.stats.last_stream_sequence == 0 and source._target == 8
        await source._on_message(_message(1, b"other"))  # the new stream's first
        assert len(applied) == 6
        await asyncio.sleep(0.05)
        assert source.stats.stream_resets == 1  # once
    finally:
        await source.close()


async def test_a_connected_replica_makes_a_deleted_stream_again_and_follows_it(monkeypatch) -> None:
    import asyncio

    monkeypatch.setattr("kvrouterd.events.nats_bus.LAG_CHECK_S", 0.01)
    source = _source([])
    server = _Server({seq: b"batch %d" % seq for seq in range(1, 6)})
    source._js = server
    source._target = 5
    await source.start(0)
    try:
        for seq in range(1, 6):
            await source._on_message(_message(seq))
        server.messages = None
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(server.subscribed) > 1:
                break
        # made again (empty: it ends before the 5 applied) and followed from its start, once
        assert server.created == 1 and source.stats.stream_resets == 1 and server.subscribed == [1, 1]
        await asyncio.sleep(0.05)
        assert server.created == 1 and len(server.subscribed) == 2
    finally:
        await source.close()


async def test_a_connected_load_sync_follows_a_stream_made_again_from_its_start(monkeypatch) -> None:
    import asyncio

    from kvrouterd.events.replica_sync import ReplicaSync

    monkeypatch.setattr("kvrouterd.events.replica_sync.STREAM_CHECK_S", 0.01)
    sync = ReplicaSync(NatsBusConfig(kind="nats"), 300.0, decode=lambda data, age: ("other", None),
                       apply=lambda delta, own: None, marker=lambda replica: b"marker")
    server = _Server({seq: b"batch %d" % seq for seq in range(1, 6)})
    sync._js = server

    class _Connection:
        async def publish(self, subject: str, data: bytes) -> None:
            pass

    sync._nc = _Connection()
    await sync.start()
    try:
        for seq in range(1, 6):
            msg = _message(seq)
            msg.metadata.timestamp = SimpleNamespace(timestamp=lambda: 0.0)
            await sync._on_message(msg)
        server.messages = {seq: b"other %d" % seq for seq in range(1, 9)}
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(server.subscribed) > 1:
                break
        assert sync.stats.stream_resets == 1 and server.subscribed[1:] == [1]
        assert sync.stats.last_stream_sequence == 0
    finally:
        sync._nc = None
        await sync.close()


async def test_a_snapshot_is_followed_after_its_sequence_only_on_the_stream_it_was_taken_of() -> None:
    from kvrouterd.events.nats_bus import message_digest

    digest = message_digest(b"batch 40")
    cases = [  # stream's messages, the snapshot's digest -> where to follow the stream after
        ({seq: b"batch %d" % seq for seq in range(1, 61)}, digest, 40),
        ({seq: b"other %d" % seq for seq in range(1, 61)}, digest, 0),  # made again, grown past 40
        ({seq: b"other %d" % seq for seq in range(1, 11)}, digest, 0),  # made again, ends before 40
        ({seq: b"other %d" % seq for seq in range(50, 61)}, digest, 40),  # 40 aged out: nothing to compare
        # a snapshot written before digests were recorded: only the stream's end tells
        ({seq: b"other %d" % seq for seq in range(1, 61)}, "", 40),
        ({seq: b"other %d" % seq for seq in range(1, 11)}, "", 0),
    ]
    for messages, recorded, expected in cases:
        source = _source([])
        source._js = _Server(messages)
        assert await source.snapshot_start(40, recorded) == expected, (min(messages), max(messages), recorded)
        assert source.stats.stream_resets == (expected == 0)
        if expected == 0:
            assert source.stream_end == max(messages)  # caught up at the new stream's end


def test_what_a_snapshot_records_of_the_message_it_was_taken_after() -> None:
    from kvrouterd.events.nats_bus import message_digest

    source = _source([])
    assert source.applied_digest() == ""  # nothing applied: a snapshot at 0 needs no check
    source._applied_data = b"batch 7"
    assert source.applied_digest() == message_digest(b"batch 7") != message_digest(b"batch 8")


async def test_a_replica_restored_from_a_snapshot_passes_its_digest_on_until_it_applies_a_message() -> None:
    from kvrouterd.events.nats_bus import message_digest

    source = _source([])
    source._js = _Server({seq: b"batch %d" % seq for seq in range(1, 41)})
    assert await source.snapshot_start(40, message_digest(b"batch 40")) == 40
    source.stats.last_stream_sequence = 40  # as start(40) leaves it
    assert source.applied_digest() == message_digest(b"batch 40")  # a snapshot written now keeps it
    await source._on_message(_message(41))
    assert source.applied_digest() == message_digest(b"batch 41")
    source._stream_lost(_info("t", 0))
    assert source.applied_digest() == ""
