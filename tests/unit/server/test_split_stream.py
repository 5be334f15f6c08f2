"""A RouteStream message split on the wire (``off_loop.route_stream_message``: its Routes' prompts
decoded and hashed off the loop) means exactly what upb's parse of the same bytes means: the same
answer for every Route in it (top level or batch item), the same other fields, or the same error.

Messages are built field by field, as no encoder would: ``route`` given several times (the
occurrences merge), oneof members switching (the last one wins, discarding earlier ones),
batches given several times (their items append), unknown fields, both prompt forms, malformed
token varints, invalid UTF-8, framing upb refuses at any level, and cut-off messages. A huge
message in an encoding the split does not read is refused instead (``off_loop.Refused``), also
where upb would refuse it for something else: unpacked token ids, groups, kind fields of
another wire type, a batch in a batch item, framing upb refuses inside a submessage with bytes
after it, token ids in Routes a later oneof member discards (``_odd``).
"""

from __future__ import annotations

import random
import struct

import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server import convert, off_loop, wire
from kvrouterd.server.convert import pb

from ...wire import CORRUPT_FIELDS
from ...wire import length_delimited as _field
from ...wire import varint as _varint
from ...wire import varint_field as _int_field

ROUTER = Router(RouterSettings(block_size=4, max_prompt_tokens=300), ManualClock(), random.Random(0))


token = st.integers(0, 2**64 - 1)  # past 2**32: upb truncates a uint32 to its low bits


@st.composite
def ids_chunk(draw: st.DrawFn) -> bytes:
    payload = b"".join(map(_varint, draw(st.lists(token, max_size=120))))
    if draw(st.integers(0, 19)) == 0:  # now and then a varint cut short or eleven bytes long
        payload += draw(st.sampled_from([b"\x80", b"\xff" * 10 + b"\x01"]))
    return _field(2, payload)


route_field = st.one_of(
    st.binary(max_size=600).map(lambda b: _field(14, b)),  # packed ids, any length (a multiple of 4 or not)
    ids_chunk(),
    st.lists(st.integers(1, 9), min_size=1, max_size=3).map(
        lambda ks: _field(3, b"".join(k.to_bytes(8, "little") for k in ks))),  # block keys
    st.sampled_from([0, 2, 99]).map(lambda t: _int_field(8, t)),  # task
    st.sampled_from(["", "m", "n"]).map(lambda m: _field(5, m.encode())),  # model
    st.sampled_from(["r1", "r2"]).map(lambda r: _field(1, r.encode())),  # request_id
    st.sampled_from([b"s", b"t", b"u", b"\xff"]).map(lambda s: _field(7, s)),  # session_id, now and then bad UTF-8
    st.integers(0, 2**32).map(lambda v: _int_field(31, v)),  # unknown
    st.sampled_from(CORRUPT_FIELDS),  # framing upb refuses: the walk of this Route stops there
    st.sampled_from([b"\x10\x05", b"\xfb\x01\x08\x01\xfc\x01"]),  # odd: an unpacked token id, a group
)
route_payload = st.lists(route_field, max_size=5).map(b"".join)
complete_payload = st.sampled_from(["c1", "c2"]).map(lambda r: pb.CompleteRequest(request_id=r).SerializeToString())


def item_field(batch: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.integers(0, 2**64 - 1).map(lambda v: _int_field(1, v)),  # id
        route_payload.map(lambda p: _field(2, p)),
        route_payload.map(lambda p: _field(2, p)),  # twice as likely: several of them merge
        complete_payload.map(lambda p: _field(3, p)),
        st.floats(0, 1e4).map(lambda t: b"\x21" + struct.pack("<d", t)),  # timeout_ms
        st.integers(0, 2**32).map(lambda v: _int_field(30, v)),  # unknown
        st.sampled_from([_int_field(3, 1), b"\xf3\x01\xf4\x01"]),  # odd: a complete as a varint, a group
        batch,
    )


#: a batch inside a batch item (answered with an error) holds a Route or nothing
nested_batch = route_payload.map(lambda p: _field(5, _field(1, _field(2, p))))
route_item = st.tuples(st.integers(0, 99).map(lambda v: _int_field(1, v)),
                       st.lists(route_payload.map(lambda p: _field(2, p)), min_size=1, max_size=2).map(b"".join))
item = st.one_of(st.lists(item_field(nested_batch), max_size=5).map(b"".join), route_item.map(b"".join))
batch = st.lists(st.one_of(item.map(lambda i: _field(1, i)), st.just(_int_field(9, 7))), max_size=6).map(
    lambda fs: _field(5, b"".join(fs)))
#: anything, a Route (given once or more), or a message whose kind is most likely a batch (the same)
message = st.one_of(st.lists(item_field(batch), max_size=6).map(b"".join), route_item.map(b"".join),
                    st.tuples(st.lists(item_field(batch), max_size=3), st.lists(batch, min_size=1, max_size=2)).map(
                        lambda t: b"".join(t[0] + t[1])))


def _route_outcome(route: pb.RouteRequest, prompt: off_loop.StreamPrompt | None):  # type: ignore[no-untyped-def]
    try:
        if prompt is None:
            req = convert.route_request(route, ROUTER)
        else:
            req = off_loop.split_route_request(route, ROUTER, prompt)
    except KVRouterError as exc:
        return type(exc).__name__, str(exc)
    return (req.request_id, list(req.keys), req.prompt_tokens, req.session_id, req.task, req.model,
            req.candidate_workers)


def _without_prompts(msg: pb.RouteStreamRequest) -> bytes:
    """Everything but the Routes' token fields, as the message would be answered from."""
    msg = pb.RouteStreamRequest.FromString(msg.SerializeToString())
    routes = [msg.route] if msg.WhichOneof("kind") == "route" else [i.route for i in msg.batch.items]
    for route in routes:
        route.ClearField("token_ids")
        route.ClearField("token_ids_le32")
    return msg.SerializeToString(deterministic=True)


def _meaning(msg: pb.RouteStreamRequest, prompts):  # type: ignore[no-untyped-def]
    """What the handler answers ``msg`` with: each Route's request (or error), the rest as parsed."""
    kind = msg.WhichOneof("kind")
    routes = []
    if kind == "route":
        routes.append(_route_outcome(msg.route, prompts.get(wire.STREAM_ROUTE)))
    elif kind == "batch":
        for place, it in enumerate(msg.batch.items):
            if it.WhichOneof("kind") == "route":
                routes.append((place, _route_outcome(it.route, prompts.get(place))))
    return _without_prompts(msg), routes


def _parsed(data: bytes):  # type: ignore[no-untyped-def]
    try:
        return _meaning(pb.RouteStreamRequest.FromString(data), {})
    except DecodeError as exc:
        return "DecodeError", str(exc)


def _split(data: bytes, min_prompt_bytes: int):  # type: ignore[no-untyped-def]
    """What the daemon makes of ``data``: RouteStream's deserializer, then (for a split message)
    the worker thread's ``hash_stream``."""
    try:
        got = off_loop.route_stream_message(data, min_prompt_bytes)
        if type(got) is off_loop.Refused:
            return ("Refused", got.id, got.message), False
        if type(got) is not off_loop.SplitStream:
            return _meaning(got, {}), False
        hashed = off_loop.hash_stream(got, ROUTER)
    except DecodeError as exc:
        return ("DecodeError", str(exc)), True
    return _meaning(got.msg, hashed), True


@settings(max_examples=400, deadline=None)
@given(data=message, cut=st.integers(0, 3), tail=st.sampled_from(CORRUPT_FIELDS))
# a string running past its Route's end: upb reads on into the next Route, finds bad UTF-8 there
# or not (here not: "corrupt"), so what follows a Route refused inside must stay as it is (now:
# refused, as framing upb refuses inside a submessage with bytes after it)
@example(data=b"\x08\x00\x12\x04:\x05ab\x12\x06r\x01\x00\xf8\x01\x00", cut=0, tail=b"")
def test_split_stream_message_means_what_the_parse_means(data, cut, tail):
    if cut == 3 and data:  # cut off inside its last field: malformed framing
        data = data[:-1]
    elif cut == 2:  # framing upb refuses after the whole message
        data += tail
    meaning, _ = _split(data, 1)
    if not _odd(data, 1):
        assert meaning == _parsed(data)
        return
    # refused, whether upb would refuse it too or not; under its id when its top level was read
    kind, message_id, message = meaning
    assert kind == "Refused"
    assert message.startswith(f"RouteStreamRequest of {len(data)} bytes is encoded in a form the router reads "
                              "only below limits.off_loop_prompt_bytes (1 bytes): ")
    try:
        top = wire._walk(data, 0, len(data), [len(data)])
    except wire.Unsplittable:
        assert message_id is None
    else:
        assert message_id == wire._stream_id(data, top)
        parsed = _parsed(data)
        if parsed[0] != "DecodeError":
            assert message_id == pb.RouteStreamRequest.FromString(data).id
    assert _split(data, len(data) + 1)[0] == _parsed(data)  # below the threshold: parsed whole, as ever


class _Odd(Exception):
    pass


def _odd(data: bytes, threshold: int) -> bool:
    """Whether the split refuses ``data`` at ``threshold``, by the rule, checked as a whole
    rather than as the walk meets it: every message upb would parse in it (as framed by
    ``wire._walk``, which stops at the first field upb refuses when nothing follows: the
    rest is upb's to judge) holds no group, no framing upb refuses with bytes after it, no token
    field that is not length-delimited, no kind or items field of another wire type, no batch in
    a batch item; there are at most MAX_STREAM_SPLIT_FIELDS fields in all; and the token ids in
    the Routes upb parses but which are not cut out (discarded by a later oneof member, or in a
    batch so discarded) take fewer than ``threshold`` bytes."""
    fields_seen = [0]
    uncut = [0]

    def fields(start: int, end: int) -> list:
        try:
            out = wire._walk(data, start, end, [len(data)])
        except wire.Unsplittable as exc:
            raise _Odd from exc
        fields_seen[0] += len(out)
        return out

    def route(start: int, end: int, cut: bool) -> None:
        for number, wire_type, _, payload, after in fields(start, end):
            if number in (2, 14) and wire_type != 2:
                raise _Odd
            if number == 2 and not cut:
                uncut[0] += after - payload

    def message(start: int, end: int, item: bool, discarded: bool) -> None:
        top = fields(start, end)
        kinds = [(i, f) for i, f in enumerate(top) if f[0] in (2, 3, 5)]
        if any(f[1] != 2 for _, f in kinds) or (item and kinds and any(f[0] == 5 for _, f in kinds)):
            raise _Odd
        last = kinds[-1][1][0] if kinds else 0
        run_start = next((i for i, f in reversed(kinds) if f[0] != last), -1)  # the last switch of member
        for i, (number, _, _, payload, after) in kinds:
            kept = i > run_start and not discarded
            if number == 2:
                route(payload, after, kept)
            elif number == 3:
                fields(payload, after)
            else:
                for n, wire_type, _, p, a in fields(payload, after):
                    if n == 1:
                        if wire_type != 2:
                            raise _Odd
                        message(p, a, True, not kept)

    try:
        message(0, len(data), False, False)
    except _Odd:
        return True
    return fields_seen[0] > wire.MAX_STREAM_SPLIT_FIELDS or uncut[0] >= threshold


def _route_item(i: int, **fields) -> pb.RouteStreamRequest:  # type: ignore[no-untyped-def]
    return pb.RouteStreamRequest(id=i, route=pb.RouteRequest(**fields))


def test_huge_batch_items_are_split_under_their_own_places():
    big = bytes(range(256)) * 16  # 4 KiB packed: 1,024 tokens
    msg = pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=[
        _route_item(1, token_ids_le32=big, model="m"),
        pb.RouteStreamRequest(id=2, complete=pb.CompleteRequest(request_id="x")),
        _route_item(3, block_keys=[1, 2]),  # nothing to hash: parsed as it is
        _route_item(4, token_ids=list(range(1200)), task=99),  # refused by its checks, not hashed
    ]))
    data = msg.SerializeToString()
    split = off_loop.route_stream_message(data, 1024)
    assert type(split) is off_loop.SplitStream
    assert sorted(split.routes) == [0, 3]
    assert split.routes[0].msg.model == "m" and not split.routes[0].msg.token_ids_le32
    assert [i.id for i in split.msg.batch.items] == [1, 2, 3, 4]
    prompts = off_loop.hash_stream(split, ROUTER)
    assert isinstance(prompts, dict)
    assert isinstance(prompts[3].hashed, KVRouterError)
    big_router = Router(RouterSettings(block_size=4, max_prompt_tokens=2000), ManualClock(), random.Random(0))
    keys = off_loop.hash_stream(split, big_router)[0].hashed.keys  # type: ignore[index,union-attr]
    assert list(keys) == list(convert.route_request(msg.batch.items[0].route, big_router).keys)
    # past the limit: counted, not hashed, answered as the parsed path answers it
    assert off_loop.hash_stream(split, ROUTER)[0].hashed.keys is None  # type: ignore[index,union-attr]
    assert _split(data, 1024)[0] == _parsed(data)


@pytest.mark.parametrize("size, limit, split", [(400, 1024, False), (4000, 1024, True), (4000, 0, False)])
def test_small_messages_are_parsed_whole(size, limit, split):
    data = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids_le32=bytes(size))).SerializeToString()
    assert (type(off_loop.route_stream_message(data, limit)) is off_loop.SplitStream) is split


def test_huge_messages_without_prompts_are_parsed_whole():
    # big only through block keys, or through a Route a later complete discards whose token ids are
    # packed bytes: every field of them walked, nothing upb reads field by field
    keys = pb.RouteStreamRequest(route=pb.RouteRequest(block_keys=list(range(1000)))).SerializeToString()
    assert type(off_loop.route_stream_message(keys, 1024)) is pb.RouteStreamRequest
    discarded = (_field(2, _field(14, bytes(4000))) + _field(3, pb.CompleteRequest(request_id="c").SerializeToString()))
    assert type(off_loop.route_stream_message(discarded, 1024)) is pb.RouteStreamRequest


def _stream_odd(size: int, reason: str) -> str:
    return (f"RouteStreamRequest of {size} bytes is encoded in a form the router reads only below "
            f"limits.off_loop_prompt_bytes (1024 bytes): {reason}; encode it as protobuf encoders do "
            "(token_ids packed, as every proto3 encoder writes them, or token_ids_le32)")


ids_4k = b"".join(_varint(t) for t in range(1000, 3000))  # 4,000 bytes of packed token ids
ODD_STREAM_MESSAGES = [
    # (message, its id as refused: None when the top level is what is odd, reason)
    (pb.RouteStreamRequest(id=9, batch=pb.RouteStreamRequestBatch(items=[
        _route_item(i, token_ids_le32=bytes(8), session_id="s") for i in range(wire.MAX_STREAM_SPLIT_FIELDS // 4)])
     ).SerializeToString(), 9, f"more than {wire.MAX_STREAM_SPLIT_FIELDS} fields"),
    (_int_field(1, 3) + _field(3, _field(1, b"") * 5000), 3, f"more than {wire.MAX_STREAM_SPLIT_FIELDS} fields"),
    (_int_field(1, 4) + _field(2, b"".join(_int_field(2, t) for t in range(2000))), 4,
     "unpacked token_ids (a field per id)"),
    (_int_field(1, 5) + _field(2, _field(14, bytes(4000)) + _int_field(2, 7)), 5, "unpacked token_ids (a field per id)"),
    (_int_field(1, 6) + _field(2, _field(2, ids_4k)) + _field(3, b""), 6,
     "4000 bytes of token ids in routes that a later route, complete or batch field of their message discards"),
    (_int_field(1, 7) + _field(5, _field(1, _field(5, _field(1, _field(2, _field(14, bytes(4000))))))), 7,
     "a batch inside a batch item"),
    (_int_field(1, 8) + _field(2, _field(14, bytes(4000))) + _int_field(3, 1), 8, "a complete field of wire type 0"),
    (_int_field(1, 10) + _field(2, _field(14, bytes(4000)) + b"\x3a\x05ab") + _int_field(4, 1), 10,
     "a field protobuf cannot frame inside a submessage, with bytes after it"),
    (b"\xfb\x01\xfc\x01" + _int_field(1, 11) + _field(2, _field(14, bytes(4000))), None,
     "a group (field 31, wire type 3)"),
]


@pytest.mark.parametrize("data, message_id, reason", ODD_STREAM_MESSAGES)
def test_huge_odd_messages_are_refused_and_small_ones_parsed_whole(data, message_id, reason):
    assert off_loop.route_stream_message(data, 1024) == off_loop.Refused(message_id, _stream_odd(len(data), reason))
    # below the threshold upb parses it whole, as ever
    assert _split(data, len(data) + 1)[0] == _parsed(data)


def test_malformed_ids_refuse_the_whole_message_with_upbs_error():
    chunk = b"".join(_varint(t) for t in range(2000)) + b"\x80"  # the last varint cut short
    for route in (_field(2, chunk), _field(2, chunk) + _int_field(8, 99)):  # valid task or not
        data = _field(5, _field(1, _int_field(1, 7) + _field(2, route)) + _field(1, _field(2, _field(14, bytes(8)))))
        split = off_loop.route_stream_message(data, 1024)
        assert type(split) is off_loop.SplitStream
        with pytest.raises(DecodeError) as err:
            off_loop.hash_stream(split, ROUTER)
        with pytest.raises(DecodeError) as parsed:
            pb.RouteStreamRequest.FromString(data)
        assert str(err.value) == str(parsed.value)
