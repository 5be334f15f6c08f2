"""PublishEvents' deserializer (``convert.event_batch_message``): where the native reader reads a
message it must build exactly what parsing then ``convert.event_batch`` build, and leave every
message those would refuse, or read differently, to them."""

from __future__ import annotations

from array import array

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.errors import KVRouterError, Overloaded
from kvrouterd.index import native
from kvrouterd.protocols import EventBatch
from kvrouterd.server import convert
from kvrouterd.server.convert import pb
from tests.wire import CORRUPT_FIELDS, length_delimited, varint, varint_field

MAX_EVENTS, MAX_ID = 6, 12
#: small enough that drawn batches go over it (each event counts at least convert.EVENT_BLOCKS = 8)
MAX_BLOCKS, BLOCK_SIZE = 50, 2
LIMITS = convert.BatchLimits(MAX_EVENTS, MAX_ID, max_bytes=1 << 20, max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE)
U64 = st.integers(0, 2**64 - 1)
# small values, 64-bit ones and those on a varint's byte boundaries
HASH = st.one_of(st.integers(0, 300), U64, st.sampled_from([2**7 - 1, 2**7, 2**63 - 1, 2**63, 2**64 - 1]))
TEXT = st.one_of(st.just(""), st.text(max_size=14))
#: what the native path answers with: the core batch where it reads the message natively
NATIVE = EventBatch if native.module is not None else pb.EventBatch


@st.composite
def stored(draw: st.DrawFn) -> pb.CacheEvent:
    blocks = draw(st.integers(1, 3))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=blocks * 2, max_size=blocks * 2))
    ev = pb.StoredBlocks(engine_hashes=draw(st.lists(HASH, max_size=4)),
                         block_size=draw(st.sampled_from([0, 2, 16, 2**32 - 1])),
                         model=draw(TEXT), lora=draw(TEXT), cache_salt=draw(TEXT))
    form = draw(st.sampled_from(["packed"] * 4 + ["repeated"] * 2 + ["both", "neither", "odd"]))
    if form in ("packed", "both"):
        ev.token_ids_le32 = array("I", tokens).tobytes()
    if form in ("repeated", "both"):
        ev.token_ids.extend(tokens)
    if form == "odd":
        ev.token_ids_le32 = b"\x01\x02\x03"
    if draw(st.booleans()):
        ev.parent_engine_hash = draw(HASH)
    return pb.CacheEvent(stored=ev)


cache_event = st.one_of(
    stored(),
    stored(),
    st.lists(HASH, max_size=4).map(lambda h: pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=h))),
    st.just(pb.CacheEvent(cleared=pb.AllBlocksCleared())),
    st.just(pb.CacheEvent()),
)
batch = st.builds(pb.EventBatch, worker_id=st.one_of(st.sampled_from(["w0", "wörker"]), TEXT),
                  sequence=st.one_of(st.integers(0, 5), U64), timestamp=st.floats(allow_nan=False),
                  events=st.one_of(st.lists(cache_event, max_size=MAX_EVENTS),
                                   st.lists(cache_event, max_size=MAX_EVENTS + 1)))

# what an encoder never writes but a peer may send: protobuf's merge of two messages, unknown
# fields, unpacked repeated fields, a field twice, cut or garbled bytes, strings that are not UTF-8
wire_change = st.sampled_from(["none"] * 4 + ["concat", "unknown", "unpacked", "twice", "cut", "flip", "latin1",
                                              "oneof2"])


def changed(msg: pb.EventBatch, change: str, other: bytes, at: int) -> bytes:
    data = msg.SerializeToString()
    if change == "concat":
        return data + other
    if change == "unknown":
        return data + varint_field(15, at)
    if change == "unpacked":  # events[0] removed with its hashes as separate varints
        return data + length_delimited(3, length_delimited(2, varint_field(1, at) + varint_field(1, at + 1)))
    if change == "twice":
        return data + varint_field(2, at)  # sequence again: protobuf keeps the last
    if change == "cut":
        return data[: at % (len(data) + 1)]
    if change == "flip" and data:
        i = at % len(data)
        return data[:i] + bytes([data[i] ^ (1 << (at % 8))]) + data[i + 1:]
    if change == "latin1":
        return data + length_delimited(1, "wörker".encode("latin-1"))
    if change == "oneof2":  # a CacheEvent naming two of its oneof: the last is kept
        return data + length_delimited(3, length_delimited(3, b"") + length_delimited(2, b""))
    return data


def reference(data: bytes, limits: convert.BatchLimits = LIMITS) -> EventBatch | type[Exception]:
    try:
        return convert.event_batch(pb.EventBatch.FromString(data), limits)
    except (DecodeError, KVRouterError) as exc:
        return type(exc)


@settings(max_examples=400, deadline=None)
@given(batch, wire_change, batch, st.integers(0, 2**16))
def test_what_the_reader_reads_is_what_parsing_and_converting_make(msg, change, other, at):
    data = changed(msg, change, other.SerializeToString(), at)
    expected = reference(data)
    try:
        got = convert.event_batch_message(data, LIMITS)
    except DecodeError:
        assert expected is DecodeError
        return
    if type(got) is EventBatch:  # read natively
        assert got == expected
        assert type(got.events) is tuple
        assert all(type(getattr(e, "engine_hashes", ())) in (tuple, type(None)) for e in got.events)
    else:  # left to the reference, which reads it as before
        assert got == pb.EventBatch.FromString(data)


def test_plain_batches_of_every_event_kind_are_read_natively():
    tokens = array("I", range(64)).tobytes()
    # 8 + 32 + 8 + 8 + 8 = 64 blocks (each event at least 8): over LIMITS' 50
    ROOMY = convert.BatchLimits(MAX_EVENTS, MAX_ID, 1 << 20, 64, BLOCK_SIZE)
    msg = pb.EventBatch(worker_id="wörker", sequence=2**63 - 1, timestamp=1.5, events=[
        pb.CacheEvent(stored=pb.StoredBlocks(engine_hashes=[1, 2**64 - 1], token_ids_le32=tokens,
                                             parent_engine_hash=0, block_size=32, model="m", lora="l", cache_salt="s")),
        pb.CacheEvent(stored=pb.StoredBlocks(token_ids=range(2**32 - 64, 2**32))),  # repeated ids, no hashes
        pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[5, 2**63])),
        pb.CacheEvent(removed=pb.RemovedBlocks()),
        pb.CacheEvent(cleared=pb.AllBlocksCleared()),
    ])
    data = msg.SerializeToString()
    got = convert.event_batch_message(data, ROOMY)
    assert type(got) is NATIVE
    assert convert.event_batch_bytes(data, ROOMY) == reference(data, ROOMY)
    if type(got) is EventBatch:
        assert got == reference(data, ROOMY)
        assert got.events[1].token_ids == array("I", range(2**32 - 64, 2**32)).tobytes()


def test_what_convert_refuses_is_left_to_it():
    ok = pb.CacheEvent(stored=pb.StoredBlocks(engine_hashes=[1], token_ids_le32=bytes(8)))
    refused = {
        "no worker": pb.EventBatch(events=[ok]),
        "long worker id": pb.EventBatch(worker_id="w" * (MAX_ID + 1), events=[ok]),
        "sequence past 2**63-1": pb.EventBatch(worker_id="w", sequence=2**63, events=[ok]),
        "too many events": pb.EventBatch(worker_id="w", events=[ok] * (MAX_EVENTS + 1)),
        "too many blocks": pb.EventBatch(worker_id="w", events=[
            pb.CacheEvent(stored=pb.StoredBlocks(token_ids_le32=bytes(4 * BLOCK_SIZE * (MAX_BLOCKS + 1))))]),
        "no event set": pb.EventBatch(worker_id="w", events=[pb.CacheEvent()]),
        "both token fields": pb.EventBatch(worker_id="w", events=[pb.CacheEvent(stored=pb.StoredBlocks(
            token_ids=[1, 2], token_ids_le32=bytes(8)))]),
        "packed length": pb.EventBatch(worker_id="w", events=[
            pb.CacheEvent(stored=pb.StoredBlocks(token_ids_le32=bytes(6)))]),
    }
    for why, msg in refused.items():
        data = msg.SerializeToString()
        assert type(convert.event_batch_message(data, LIMITS)) is pb.EventBatch, why
        assert isinstance(reference(data), type), why
    # a varint past 64 bits, and one cut short: upb's error, not the reader's answer
    too_long, cut = bytes([0x10]) + b"\xff" * 9 + b"\x7f", b"\x10\xff"
    for data in (length_delimited(1, b"w") + too_long, length_delimited(1, b"w") + cut):
        try:
            got = convert.event_batch_message(data, LIMITS)
        except DecodeError:
            continue
        assert type(got) is pb.EventBatch


def test_framing_upb_refuses_is_refused_wherever_it_stands():
    # a tag or a length of six bytes whose value fits is still refused by upb: so by the reader
    stored = pb.StoredBlocks(token_ids_le32=bytes(8), model="m").SerializeToString()
    for corrupt in CORRUPT_FIELDS:
        for data in (length_delimited(1, b"w") + corrupt,
                     length_delimited(1, b"w") + length_delimited(3, length_delimited(1, stored + corrupt))):
            assert reference(data) is DecodeError, corrupt
            with pytest.raises(DecodeError):
                convert.event_batch_message(data, LIMITS)


def test_a_token_id_past_32_bits_is_left_to_protobuf():
    # upb keeps a uint32's low 32 bits; the reader leaves such an id to it rather than guess
    field = length_delimited(3, varint(2**32 + 7) + varint(1))
    data = length_delimited(1, b"w") + length_delimited(3, length_delimited(1, field))
    got = convert.event_batch_message(data, LIMITS)
    assert type(got) is pb.EventBatch
    assert convert.event_batch(got, LIMITS).events[0].token_ids == array("I", [7, 1]).tobytes()


def _blocks_batch(*events: pb.CacheEvent) -> bytes:
    return pb.EventBatch(worker_id="w", sequence=3, events=events).SerializeToString()


def test_the_block_limit_counts_pages_hashes_and_events_alike_in_both_readers():
    """A batch of exactly ``max_blocks`` is read (natively where it can be); one more block, by
    any of the ways a batch counts them, is RESOURCE_EXHAUSTED from the reference with the same
    words: the native reader stops counting there and leaves it to it, so both modes agree."""
    def stored(tokens: int, hashes: int = 0, block_size: int = 0) -> pb.CacheEvent:
        return pb.CacheEvent(stored=pb.StoredBlocks(token_ids_le32=bytes(4 * tokens), engine_hashes=range(hashes),
                                                    block_size=block_size))

    def removed(hashes: int) -> pb.CacheEvent:
        return pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=range(hashes)))

    cleared = pb.CacheEvent(cleared=pb.AllBlocksCleared())
    n, least = 64, convert.EVENT_BLOCKS
    at_limit = {  # (events, one more block)
        "router blocks": ([stored(2 * n)], [stored(2 * n + 2)]),
        "pages of the event's size": ([stored(4 * n, block_size=4)], [stored(4 * n + 4, block_size=4)]),
        "engine hashes past the pages": ([stored(2, hashes=n)], [stored(2, hashes=n + 1)]),
        "removed hashes": ([removed(n - least - 18), cleared, removed(18)], [removed(n - least - 17), cleared, removed(18)]),
        "events count 8 at least": ([cleared] * (n // least - 2) + [removed(0), stored(1)],
                                    [cleared] * (n // least - 2) + [removed(0), stored(2 * (least + 1))]),
    }
    words = ("more than limits.max_batch_blocks=64 blocks (stored pages and removed hashes; each event counts at "
             "least 8): split the batch; the kvrouter_client SDK does")
    for why, (fits, over) in at_limit.items():
        limits = convert.BatchLimits(64, MAX_ID, 1 << 20, n, BLOCK_SIZE)
        data = _blocks_batch(*fits)
        got = convert.event_batch_message(data, limits)
        assert type(got) is NATIVE, why
        assert convert.event_batch_bytes(data, limits) == convert.event_batch(pb.EventBatch.FromString(data), limits)
        data = _blocks_batch(*over)
        assert type(convert.event_batch_message(data, limits)) is pb.EventBatch, why  # the reference's to refuse
        for refuse in (lambda: convert.event_batch(pb.EventBatch.FromString(data), limits),
                       lambda: convert.event_batch_bytes(data, limits)):
            try:
                refuse()
            except Overloaded as exc:
                assert words in str(exc), why
            else:
                raise AssertionError(f"{why}: a batch over the block limit was accepted")


def test_a_batch_over_the_byte_limit_is_refused_unread():
    limits = convert.BatchLimits(MAX_EVENTS, MAX_ID, max_bytes=64, max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE)
    fits = pb.EventBatch(worker_id="w", events=[pb.CacheEvent(cleared=pb.AllBlocksCleared())]).SerializeToString()
    assert type(convert.event_batch_message(fits, limits)) is NATIVE
    for data in (fits + bytes(64 - len(fits) + 1), b"\xff" * 65):  # garbage too: nothing is parsed
        got = convert.event_batch_message(data, limits)
        assert type(got) is convert.BatchTooLarge
        assert got.size == 65
        assert got.message == ("event batch of 65 bytes exceeds limits.max_event_batch_bytes=64: split the batch; "
                               "the kvrouter_client SDK does")
        try:
            convert.event_batch_bytes(data, limits)
        except Overloaded as exc:
            assert str(exc) == got.message
        else:
            raise AssertionError("the bus accepted a batch over the byte limit")
