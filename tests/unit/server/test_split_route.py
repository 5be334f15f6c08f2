"""A Route split on the wire (``convert.route_message``: its prompt decoded and hashed off the loop)
means exactly what upb's parse of the same bytes means: the same RouteRequest, or the same error."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server import convert
from kvrouterd.server.convert import pb

from ...wire import length_delimited as _field
from ...wire import varint as _varint

ROUTER = Router(RouterSettings(block_size=4, max_prompt_tokens=300), ManualClock(), random.Random(0))


token = st.integers(0, 2**64 - 1)  # past 2**32: upb truncates a uint32 to its low bits
extra_fields = st.lists(st.one_of(
    st.binary(max_size=60).map(lambda b: _field(14, b)),  # token_ids_le32 again: the last one wins
    st.lists(token, max_size=30).map(lambda ts: _field(2, b"".join(map(_varint, ts)))),  # more token_ids chunks
    st.text(max_size=5).map(lambda t: _field(7, t.encode())),  # session_id again
    st.integers(0, 2**32).map(lambda v: bytes([0xF8, 0x01]) + _varint(v)),  # unknown field 31, varint
    st.lists(st.integers(1, 9), max_size=3).map(lambda ks: _field(3, b"".join(k.to_bytes(8, "little") for k in ks))),
), max_size=4)


@settings(max_examples=200, deadline=None)
@given(
    packed=st.binary(max_size=1300),
    ids=st.lists(token, max_size=400),
    model=st.sampled_from(["", "m"]),
    salt=st.sampled_from(["", "s"]),
    task=st.sampled_from([0, 2, 9]),
    candidates=st.lists(st.sampled_from(["a", "b"]), max_size=3),
    extra=extra_fields,
)
def test_split_route_means_what_the_parse_means(packed, ids, model, salt, task, candidates, extra):
    msg = pb.RouteRequest(token_ids_le32=packed, token_ids=[t & 0xFFFFFFFF for t in ids], model=model,
                          cache_salt=salt, task=task, candidate_workers=candidates, session_id="x")
    data = msg.SerializeToString() + b"".join(extra)
    if ids:  # the SDK never does, but a varint past 32 bits is legal on the wire: re-encode them
        data = data.replace(_field(2, b"".join(_varint(t & 0xFFFFFFFF) for t in ids)),
                            _field(2, b"".join(_varint(t) for t in ids)), 1)
    expected = _outcome(lambda: convert.route_request(pb.RouteRequest.FromString(data), ROUTER))
    got = convert.route_message(data, 1)
    if type(got) is convert.SplitRoute:
        def split_path():  # type: ignore[no-untyped-def]
            convert.check_split(got, ROUTER)
            hashed = convert.hash_wire_prompt(got, ROUTER.block_size, ROUTER.settings.max_prompt_tokens)
            return convert.route_request(got.msg, ROUTER, hashed)
        assert _outcome(split_path) == expected
    else:
        assert _outcome(lambda: convert.route_request(got, ROUTER)) == expected


def _outcome(build):  # type: ignore[no-untyped-def]
    try:
        req = build()
    except KVRouterError as exc:
        return type(exc).__name__, str(exc)
    return (req.request_id, list(req.keys), req.prompt_tokens, req.session_id, req.task, req.model,
            req.candidate_workers)


def test_small_prompts_and_odd_messages_are_parsed_whole():
    small = pb.RouteRequest(token_ids_le32=bytes(400)).SerializeToString()
    assert type(convert.route_message(small, 1024)) is pb.RouteRequest
    big = pb.RouteRequest(token_ids_le32=bytes(4000)).SerializeToString()
    assert type(convert.route_message(big, 1024)) is convert.SplitRoute
    assert type(convert.route_message(big, 0)) is pb.RouteRequest  # 0: off
    # a prompt of unpacked token ids (each its own tag) or thousands of fields: left to upb
    unpacked = b"".join(bytes([0x10]) + _varint(t) for t in range(2000))
    assert type(convert.route_message(unpacked, 1024)) is pb.RouteRequest
    many = b"".join(_field(7, b"x") for _ in range(convert.MAX_SPLIT_FIELDS)) + _field(14, bytes(4000))
    assert type(convert.route_message(many, 1024)) is pb.RouteRequest
    # big only through block keys: nothing to hash
    keys = pb.RouteRequest(block_keys=list(range(1000))).SerializeToString()
    assert type(convert.route_message(keys, 1024)) is pb.RouteRequest
