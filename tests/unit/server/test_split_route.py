"""A Route split on the wire (``off_loop.route_message``: its prompt decoded and hashed off the loop)
means exactly what upb's parse of the same bytes means: the same RouteRequest, or the same error
(the same status and words: upb's for a message it refuses, before any check of ours). A huge
Route in an encoding the split does not read (unpacked token ids, a group, too many fields) is
refused instead (``off_loop.Refused``), also where upb would refuse it for something else."""

from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server import convert, off_loop, wire
from kvrouterd.server.convert import pb

from ...wire import CORRUPT_FIELDS
from ...wire import length_delimited as _field
from ...wire import varint as _varint

ROUTER = Router(RouterSettings(block_size=4, max_prompt_tokens=300), ManualClock(), random.Random(0))


token = st.integers(0, 2**64 - 1)  # past 2**32: upb truncates a uint32 to its low bits
#: now and then a varint cut short or eleven bytes long, at the end of a token_ids chunk
bad_varint = st.sampled_from([b"", b"", b"", b"\x80", b"\xff" * 10 + b"\x01", b"\xff" * 10 + b"\x02"])
extra_fields = st.lists(st.one_of(
    st.binary(max_size=60).map(lambda b: _field(14, b)),  # token_ids_le32 again: the last one wins
    st.tuples(st.lists(token, max_size=30), bad_varint).map(  # more token_ids chunks
        lambda t: _field(2, b"".join(map(_varint, t[0])) + t[1])),
    st.text(max_size=5).map(lambda t: _field(7, t.encode())),  # session_id again
    st.sampled_from([b"\xff", b"\xc3"]).map(lambda b: _field(7, b)),  # session_id of bad UTF-8
    st.integers(0, 2**32).map(lambda v: bytes([0xF8, 0x01]) + _varint(v)),  # unknown field 31, varint
    st.lists(st.integers(1, 9), max_size=3).map(lambda ks: _field(3, b"".join(k.to_bytes(8, "little") for k in ks))),
    st.sampled_from([0, 2, 99]).map(lambda t: bytes([0x40]) + _varint(t)),  # task again (99: unknown)
    # now and then an encoding the split refuses: an unpacked token id, a group (unknown field 31)
    st.sampled_from([b"\x10\x05", b"\x10\x85\x01", b"\xfb\x01\x08\x01\xfc\x01"]),
), max_size=4)


@settings(max_examples=300, deadline=None)
@given(
    form=st.sampled_from(["packed", "ids", "ids", "both"]),
    packed=st.binary(max_size=1300),
    ids=st.lists(token, max_size=400),
    ids_end=bad_varint,
    model=st.sampled_from(["", "m"]),
    salt=st.sampled_from(["", "s"]),
    task=st.sampled_from([0, 2, 9]),
    candidates=st.lists(st.sampled_from(["a", "b"]), max_size=3),
    extra=extra_fields,
    tail=st.one_of(st.just(b""), st.just(b""), st.sampled_from(CORRUPT_FIELDS)),
    cut=st.integers(0, 5),
)
def test_split_route_means_what_the_parse_means(form, packed, ids, ids_end, model, salt, task, candidates, extra,
                                                tail, cut):
    packed = packed if form != "ids" else b""
    ids = ids if form != "packed" else []
    msg = pb.RouteRequest(token_ids_le32=packed, token_ids=[t & 0xFFFFFFFF for t in ids], model=model,
                          cache_salt=salt, task=task, candidate_workers=candidates, session_id="x")
    data = msg.SerializeToString()
    if ids:  # the SDK never does, but a varint past 32 bits is legal on the wire: re-encode them
        data = data.replace(_field(2, b"".join(_varint(t & 0xFFFFFFFF) for t in ids)),
                            _field(2, b"".join(_varint(t) for t in ids) + ids_end), 1)
    data += b"".join(extra) + tail
    if cut == 5 and data:  # cut off inside its last field
        data = data[:-1]
    reason = _odd(data)
    if reason is None:
        assert _split(data, 1) == _parsed(data)
    else:  # refused, whether upb would refuse it too or not
        assert _split(data, 1) == ("Refused", odd(len(data), 1, reason).message)
        assert _split(data, len(data) + 1) == _parsed(data)  # below the threshold: parsed whole, as ever


def _odd(data: bytes) -> str | None:
    """Why the split refuses ``data`` at its threshold, by the rule: of its top-level fields as
    upb frames them (up to the first it refuses: what follows is upb's to judge), the first that
    is a group or a token field not length-delimited, within MAX_SPLIT_FIELDS; else more fields
    than that."""
    for i, (number, wire_type) in enumerate(_framed(data)):
        if i == wire.MAX_SPLIT_FIELDS:
            return f"more than {wire.MAX_SPLIT_FIELDS} fields"
        if wire_type == 3:
            return f"a group (field {number}, wire type 3)"
        if number in (2, 14) and wire_type != 2:
            if (number, wire_type) == (2, 0):
                return "unpacked token_ids (a field per id)"
            return f"{'token_ids' if number == 2 else 'token_ids_le32'} of wire type {wire_type}"
    return None


def _framed(data: bytes):  # type: ignore[no-untyped-def]
    """(number, wire type) of each top-level field, as upb frames them, up to the first it refuses
    or a group (whose end only upb finds)."""
    i = 0
    while i < len(data):
        tag, i = _read_varint(data, i, 5)
        if tag is None or tag >> 3 == 0 or tag > 0xFFFFFFFF or tag & 7 in (4, 6, 7):
            return
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, i = _read_varint(data, i, 10)
            if value is None:
                return
        elif wire_type in (1, 5):
            i += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, i = _read_varint(data, i, 5)
            if length is None:
                return
            i += length
        if i > len(data):
            return
        yield number, wire_type
        if wire_type == 3:
            return


def _read_varint(data: bytes, i: int, most: int):  # type: ignore[no-untyped-def]
    """(value, next) of the varint at ``data[i]``, (None, i) when cut short or longer than ``most`` bytes."""
    value = 0
    for k in range(most):
        if i + k >= len(data):
            return None, i
        value |= (data[i + k] & 0x7F) << (7 * k)
        if data[i + k] < 0x80:
            return value, i + k + 1
    return None, i


def _parsed(data: bytes):  # type: ignore[no-untyped-def]
    try:
        msg = pb.RouteRequest.FromString(data)
    except DecodeError as exc:
        return "DecodeError", str(exc)
    return _outcome(lambda: convert.route_request(msg, ROUTER))


def _split(data: bytes, min_prompt_bytes: int):  # type: ignore[no-untyped-def]
    """What the daemon makes of ``data``: Route's deserializer, then (for a split Route) the worker
    thread's ``hash_route``."""
    try:
        got = off_loop.route_message(data, min_prompt_bytes)
        if type(got) is off_loop.Refused:
            assert got.id is None
            return "Refused", got.message
        if type(got) is not off_loop.SplitRoute:
            return _outcome(lambda: convert.route_request(got, ROUTER))
        prompt = off_loop.hash_route(got, ROUTER)
    except DecodeError as exc:
        return "DecodeError", str(exc)
    return _outcome(lambda: off_loop.split_route_request(got.msg, ROUTER, prompt))


def _outcome(build):  # type: ignore[no-untyped-def]
    try:
        req = build()
    except KVRouterError as exc:
        return type(exc).__name__, str(exc)
    return (req.request_id, list(req.keys), req.prompt_tokens, req.session_id, req.task, req.model,
            req.candidate_workers)


@pytest.mark.parametrize("corrupt", CORRUPT_FIELDS)
def test_framing_the_walk_stops_at_is_framing_upb_refuses(corrupt):
    # _walk keeps everything from such a field on as it is, for upb to refuse, and cuts no prompt
    # after it: that is only right if upb refuses the message there whatever follows, at any level
    prompt = _field(14, bytes(8))
    assert wire.split_route(corrupt + prompt) is None
    assert wire.split_route(prompt + corrupt)[0] == corrupt
    for data in (corrupt + prompt, prompt + corrupt):
        with pytest.raises(DecodeError):
            pb.RouteRequest.FromString(data)
        with pytest.raises(DecodeError):
            pb.RouteStreamRequest.FromString(_field(2, data) + _field(4, b""))


def test_a_refused_huge_message_is_answered_from_a_small_stand_in():
    # 1M token ids (~2.5 MiB), valid or not, with a field upb refuses after them: upb's words,
    # from a stand-in of a few bytes (the ids cut out; malformed ones as one cut-short varint)
    ids = b"".join(_varint(t) for t in range(1 << 20))
    bad_ids = ids[:-1] + b"\x80"
    cases = [
        (_field(2, ids) + _field(7, b"\xff"), False, _field(7, b"\xff")),  # bad UTF-8 after the ids
        (_field(2, bad_ids) + _field(7, b"\xff"), True, b"\x12\x01\x80" + _field(7, b"\xff")),  # the ids first
        (_field(2, ids) + b"\x3a\x05ab", False, b"\x3a\x05ab"),  # a length past the end
        (_field(2, bad_ids) + _field(7, b"s"), True, b"\x12\x01\x80" + _field(7, b"s")),  # only the ids
    ]
    for data, malformed, stand_in in cases:
        split = off_loop.route_message(data, 1024)
        assert type(split) is off_loop.SplitRoute
        assert wire.split_route(data, 1 + len(_varint(len(ids))) if malformed else -1)[0] == stand_in
        with pytest.raises(DecodeError) as parsed:
            pb.RouteRequest.FromString(data)
        with pytest.raises(DecodeError) as refused:
            off_loop.hash_route(split, ROUTER)
        assert str(refused.value) == str(parsed.value)


def test_small_prompts_are_parsed_whole():
    small = pb.RouteRequest(token_ids_le32=bytes(400)).SerializeToString()
    assert type(off_loop.route_message(small, 1024)) is pb.RouteRequest
    big = pb.RouteRequest(token_ids_le32=bytes(4000)).SerializeToString()
    assert type(off_loop.route_message(big, 1024)) is off_loop.SplitRoute
    assert type(off_loop.route_message(big, 0)) is pb.RouteRequest  # 0: off
    # big only through block keys: nothing to hash, a field upb reads in one go
    keys = pb.RouteRequest(block_keys=list(range(1000))).SerializeToString()
    assert type(off_loop.route_message(keys, 1024)) is pb.RouteRequest


def odd(size: int, limit: int, reason: str) -> off_loop.Refused:
    return off_loop.Refused(None, (
        f"RouteRequest of {size} bytes is encoded in a form the router reads only below "
        f"limits.off_loop_prompt_bytes ({limit} bytes): {reason}; encode it as protobuf encoders do "
        "(token_ids packed, as every proto3 encoder writes them, or token_ids_le32)"))


#: a prompt of unpacked token ids (each its own tag), thousands of fields, a group: encodings upb
#: would parse field by field on the loop, holding it for as long as the message is long
ODD_ROUTES = [
    (b"".join(bytes([0x10]) + _varint(t) for t in range(2000)), "unpacked token_ids (a field per id)"),
    (_field(14, bytes(4000)) + b"\x15" + bytes(4), "token_ids of wire type 5"),
    (_field(2, bytes(4000)) + b"\x70\x01", "token_ids_le32 of wire type 0"),
    (b"".join(_field(7, b"x") for _ in range(wire.MAX_SPLIT_FIELDS)) + _field(14, bytes(4000)),
     f"more than {wire.MAX_SPLIT_FIELDS} fields"),
    (_field(14, bytes(4000)) + b"\xfb\x01" + _field(1, b"x") + b"\xfc\x01", "a group (field 31, wire type 3)"),
]


@pytest.mark.parametrize("data, reason", ODD_ROUTES)
def test_huge_odd_messages_are_refused_and_small_ones_parsed_whole(data, reason):
    assert off_loop.route_message(data, 1024) == odd(len(data), 1024, reason)
    assert off_loop.route_message(data, len(data)) == odd(len(data), len(data), reason)  # at the threshold
    below = off_loop.route_message(data, len(data) + 1)
    assert type(below) is pb.RouteRequest and below == pb.RouteRequest.FromString(data)


def test_odd_messages_refused_say_their_size_in_mib():
    data = b"".join(bytes([0x10]) + _varint(t) for t in range(1 << 19))  # ~1.5 MiB
    assert off_loop.route_message(data, 1024).message.startswith(
        f"RouteRequest of {len(data) / 2**20:.1f} MiB is encoded in a form the router reads only below")


def test_both_prompt_forms_are_split_and_refused_by_the_checks():
    # huge token_ids beside token_ids_le32: both cut out (upb would decode the ids on the loop),
    # answered with route_request's own words
    data = pb.RouteRequest(token_ids=list(range(3000)), token_ids_le32=bytes(8)).SerializeToString()
    split = off_loop.route_message(data, 1024)
    assert type(split) is off_loop.SplitRoute and split.prompt.both
    assert _split(data, 1024) == _parsed(data) == ("InvalidRequest", convert._ONE_PROMPT_FORM)
