"""A RouteStream batch read from its bytes is the batch upb parses, and is answered alike.

``stream_wire.stream_message`` (RouteStream's deserializer below the off-loop size) reads a batch
of the plain form natively (``stream_batch_items`` in ``index/_native.c``) into the tuples the
native conversions take in place of messages; everything else is upb's. Over random batches (every
prompt form, ids and names at and past their limits, Completes at every bound) and what a peer may
send but no encoder writes (fields twice, unknown fields, out-of-range varints, merged messages,
cut and flipped bytes), what the reader answers must be what upb parses, field for field and type
for type, or left to upb; each item converts to the same request or error as its message; and the
handler answers a batch read from its bytes with the bytes it answers the parsed message with.
"""

from __future__ import annotations

import asyncio
import random
import struct
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.index import native
from kvrouterd.server import convert, stream_wire
from kvrouterd.server.service import MAX_STREAM_BATCH_ITEMS, KVRouterService
from kvrouterd.server.stream_answers import passes_bytes
from kvrouterd.telemetry.metrics import Metrics
from tests.unit.server import test_completion_conversion as completes
from tests.unit.server import test_route_conversion as routes
from tests.wire import CORRUPT_FIELDS, length_delimited, varint_field

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

MAX_ITEMS = 6
U64 = (0, 1, 127, 128, 2**32, 2**63, 2**64 - 1)


def random_item(rng: random.Random) -> pb.RouteStreamRequest:
    item = pb.RouteStreamRequest(id=rng.choice(U64) if rng.random() < 0.3 else rng.randrange(1000))
    if rng.random() < 0.3:
        item.timeout_ms = rng.choice((0.0, 250.0, -0.0, float("nan")))
    kind = rng.random()
    if kind < 0.55:
        item.route.CopyFrom(routes.random_message(rng))
        if rng.random() < 0.05:
            item.route.task = rng.choice((-1, -(2**31), 2**31 - 1))
    elif kind < 0.95:
        item.complete.CopyFrom(completes.random_message(rng))
        if rng.random() < 0.05:
            item.complete.cached_tokens = rng.choice((-(2**63), 2**63 - 1))
    elif kind < 0.98:
        item.batch.SetInParent()  # an item that is itself a batch
    return item  # else neither route nor complete


#: bytes appended to one item's Route or Complete: what upb reads (merging, keeping the last,
#: keeping the low bits, as unknown) or refuses, which the reader must leave to it
ROUTE_EXTRAS = (
    varint_field(10, 7),  # expected_output_tokens twice: the last is kept
    varint_field(10, 2**33),  # a uint32 past 32 bits: upb keeps the low ones
    varint_field(8, 2**40),  # an int32 past 32 bits
    varint_field(4, 16),  # prompt_tokens, which a packed prompt ignores
    varint_field(2, 5),  # token_ids unpacked, beside the packed prompt
    length_delimited(3, bytes(8)),  # block_keys
    length_delimited(12, "wörker".encode("latin-1")),  # a candidate that is not UTF-8
    length_delimited(12, b"w9"),  # one more candidate
    length_delimited(14, bytes(16)),  # the prompt twice: the last is kept
    varint_field(20, 1),  # an unknown field
    struct.pack("<B", 9 << 3 | 1) + struct.pack("<d", -0.0),  # ttft_slo_ms as -0.0
) + CORRUPT_FIELDS
COMPLETE_EXTRAS = (
    varint_field(6, 2),  # a bool of 2: upb reads true
    varint_field(5, 2**32),  # output_tokens past 32 bits
    varint_field(4, 2**64 - 1),  # cached_tokens -1 in ten bytes
    length_delimited(1, b"again"),  # request_id twice
    varint_field(11, 0),  # an unknown field
) + CORRUPT_FIELDS
#: bytes appended to an item or to the whole message
ITEM_EXTRAS = (
    varint_field(1, 5),  # the id twice
    length_delimited(2, b""),  # a route after a complete (a oneof's last member is kept), or merged into a route
    length_delimited(3, b""),
    varint_field(9, 1),
) + CORRUPT_FIELDS
MESSAGE_EXTRAS = (
    length_delimited(5, length_delimited(1, varint_field(1, 3))),  # a second batch, merged into the first
    varint_field(1, 3),
    length_delimited(2, b""),  # a route beside the batch
    varint_field(7, 1),
) + CORRUPT_FIELDS


def item_bytes(rng: random.Random, item: pb.RouteStreamRequest) -> bytes:
    kind = item.WhichOneof("kind")
    if kind in ("route", "complete") and rng.random() < 0.15:  # the payload's fields changed
        extras = ROUTE_EXTRAS if kind == "route" else COMPLETE_EXTRAS
        payload = getattr(item, kind).SerializeToString() + rng.choice(extras)
        rest = pb.RouteStreamRequest(id=item.id, timeout_ms=item.timeout_ms).SerializeToString()
        return rest + length_delimited(2 if kind == "route" else 3, payload)
    data = item.SerializeToString()
    return data + rng.choice(ITEM_EXTRAS) if rng.random() < 0.05 else data


def random_batch(rng: random.Random) -> bytes:
    n = rng.choice((0, 1, 2, 3, MAX_ITEMS, MAX_ITEMS + 1))
    batch = b"".join(length_delimited(1, item_bytes(rng, random_item(rng))) for _ in range(n))
    head = pb.RouteStreamRequest(id=rng.choice(U64), timeout_ms=rng.choice((0.0, 5.0))).SerializeToString()
    data = head + length_delimited(5, batch)
    change = rng.random()
    if change < 0.05:
        data += rng.choice(MESSAGE_EXTRAS)
    elif change < 0.08:
        data = data[: rng.randrange(len(data) + 1)]
    elif change < 0.11 and data:
        at = rng.randrange(len(data))
        data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
    elif change < 0.13:  # a message that is not a batch
        data = random_item(rng).SerializeToString()
    return data


def typed(values: Sequence[Any]) -> list[Any]:
    """Values with their types, floats by their bits (NaN and -0.0 compare as they are)."""
    return [(type(v), struct.pack("<d", v) if type(v) is float else v) for v in values]


def upb_fields(msg: pb.RouteRequest | pb.CompleteRequest) -> list[Any]:
    """What the native passes read of a message, in the reader's order."""
    if type(msg) is pb.RouteRequest:
        return typed((msg.token_ids_le32, tuple(msg.token_ids), tuple(msg.block_keys), msg.task, msg.model, msg.lora,
                      msg.cache_salt, msg.request_id, msg.session_id, msg.ttft_slo_ms, msg.expected_output_tokens,
                      msg.policy, tuple(msg.candidate_workers)))
    return typed((msg.request_id, msg.ttft_ms, msg.e2e_ms, msg.cached_tokens, msg.output_tokens, msg.success,
                  msg.session_ended, msg.prefill_ms, msg.kv_transfer_ms, msg.prefill_done))


def read_alike(data: bytes) -> str:
    """Read ``data`` both ways; how the reader answered ("wire", "upb", "refused")."""
    try:
        expected = pb.RouteStreamRequest.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            stream_wire.stream_message(data, MAX_ITEMS)
        return "refused"
    got = stream_wire.stream_message(data, MAX_ITEMS)
    if type(got) is pb.RouteStreamRequest:
        assert got == expected
        return "upb"
    assert type(got) is stream_wire.WireBatch and got.message() == expected
    items = expected.batch.items
    assert expected.WhichOneof("kind") == "batch" and 1 <= len(items) <= MAX_ITEMS
    assert len(got.items) == len(items)
    for (item_id, kind, fields), item in zip(got.items, items, strict=True):
        assert (item_id, kind) == (item.id, item.WhichOneof("kind"))
        msg = getattr(item, kind)
        assert fields[-3] is data
        assert stream_wire.as_message(fields, type(msg)) == msg  # the item's own bytes, for the reference
        if len(fields) == 3:  # a prompt in the reference's forms: where the Route is, alone
            assert kind == "route" and (len(msg.token_ids) or len(msg.block_keys))
            continue
        read = list(fields[:-3])
        if kind == "route" and msg.token_ids_le32:
            assert type(read[0]) is memoryview and read[0].obj is data  # the prompt is not copied
            read[0] = bytes(read[0])
        assert typed(read) == upb_fields(msg)
    return "wire"


@pytest.mark.parametrize("seed", range(4))
def test_what_the_reader_reads_is_what_upb_parses(seed: int) -> None:
    rng = random.Random(seed)
    answered = {"wire": 0, "upb": 0, "refused": 0}
    for _ in range(500):
        answered[read_alike(random_batch(rng))] += 1
    assert answered["wire"] > 60 and answered["upb"] > 100 and answered["refused"] > 100


@pytest.mark.parametrize("seed", range(3))
def test_each_item_read_converts_as_its_message(seed: int) -> None:
    rng, r = random.Random(seed), routes.router()
    converted = 0
    for _ in range(300):
        data = random_batch(rng)
        try:
            got = stream_wire.stream_message(data, MAX_ITEMS)
        except DecodeError:
            continue
        if type(got) is not stream_wire.WireBatch:
            continue
        for (_, kind, fields), item in zip(got.items, got.message().batch.items, strict=True):
            converted += 1
            if kind == "route":
                client = rng.choice(("", "ipv4:10.0.0.1:5000"))
                assert routes.outcome(convert.route_request, fields, r, client) == \
                    routes.outcome(convert.route_request, item.route, r, client)
            else:
                limit = rng.choice((completes.LIMIT, 0))
                assert completes.outcome(convert.completion, fields, limit) == \
                    completes.outcome(convert.completion, item.complete, limit)
    assert converted > 200


def test_a_plain_batch_of_every_field_is_read_natively() -> None:
    route = pb.RouteRequest(request_id="réq", token_ids_le32=array("I", range(64)).tobytes(), model="m", lora="l",
                            session_id="s", task=-3, ttft_slo_ms=-0.0, expected_output_tokens=2**32 - 1, policy="lbgr",
                            candidate_workers=["w1", "wörker", ""], cache_salt="salt", prompt_tokens=5)
    complete = pb.CompleteRequest(request_id="réq", ttft_ms=1.5, e2e_ms=float("inf"), cached_tokens=-(2**63),
                                  output_tokens=2**32 - 1, success=True, session_ended=True, prefill_ms=2.0,
                                  kv_transfer_ms=float("nan"), prefill_done=True)
    items = [pb.RouteStreamRequest(id=2**64 - 1, route=route, timeout_ms=5.0),
             pb.RouteStreamRequest(id=0, complete=complete), pb.RouteStreamRequest(id=7, route=pb.RouteRequest()),
             pb.RouteStreamRequest(id=8, complete=pb.CompleteRequest())]
    batch = pb.RouteStreamRequestBatch(items=items)
    data = pb.RouteStreamRequest(id=3, timeout_ms=1.0, batch=batch).SerializeToString()
    assert read_alike(data) == "wire"
    got = stream_wire.stream_message(data, MAX_ITEMS)
    assert [kind for _, kind, _ in got.items] == ["route", "complete", "route", "complete"]
    assert got.items[0][2][12] == ("w1", "wörker", "")


@pytest.mark.parametrize("name, data", [
    ("not a batch", pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids_le32=bytes(64))).SerializeToString()),
    ("an empty batch", pb.RouteStreamRequest(id=1, batch=pb.RouteStreamRequestBatch()).SerializeToString()),
    ("too many items", pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(
        items=[pb.RouteStreamRequest(id=i, complete=pb.CompleteRequest(request_id="r")) for i in range(MAX_ITEMS + 1)]
    )).SerializeToString()),
    ("an item of neither kind", pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(
        items=[pb.RouteStreamRequest(id=1)])).SerializeToString()),
    ("an item that is a batch", pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(
        items=[pb.RouteStreamRequest(id=1, batch=pb.RouteStreamRequestBatch())])).SerializeToString()),
    ("a token id in eleven bytes", length_delimited(5, length_delimited(1, length_delimited(
        2, length_delimited(2, b"\x80" * 10 + b"\x00"))))),
    ("block keys cut", length_delimited(5, length_delimited(1, length_delimited(2, length_delimited(3, bytes(12)))))),
    ("a bool of 2", length_delimited(5, length_delimited(1, length_delimited(3, varint_field(6, 2))))),
    *((f"request_id {text!r}", length_delimited(5, length_delimited(1, length_delimited(3, length_delimited(1, text)))))
      for text in (b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80")),  # a surrogate, overlong, past U+10FFFF
    ("a field twice", length_delimited(5, length_delimited(1, varint_field(1, 1) + varint_field(1, 2)
                                                           + length_delimited(3, b"")))),
])
def test_what_upb_reads_otherwise_or_refuses_is_left_to_it(name: str, data: bytes) -> None:
    assert read_alike(data) in ("upb", "refused")


def test_a_route_with_its_prompt_in_another_form_is_read_as_its_bytes_for_the_reference() -> None:
    prompts = [pb.RouteRequest(token_ids=[1, 2**32 - 1], model="m"), pb.RouteRequest(block_keys=[1, 2**64 - 1]),
               pb.RouteRequest(token_ids=[5], token_ids_le32=bytes(4))]  # two forms: the reference refuses it
    items = [pb.RouteStreamRequest(id=i, route=route) for i, route in enumerate(prompts)]
    unpacked = varint_field(2, 7) + varint_field(2, 8)  # token ids each on its own, as upb also reads them
    data = pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=items)).SerializeToString()
    data += length_delimited(5, length_delimited(1, length_delimited(2, unpacked)))  # a batch after a batch: merged
    assert read_alike(data) == "upb"  # merged: upb's
    data = pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=items + [pb.RouteStreamRequest(
        id=9, route=pb.RouteRequest.FromString(unpacked))])).SerializeToString()
    assert read_alike(data) == "wire"
    got = stream_wire.stream_message(data, MAX_ITEMS)
    assert [len(fields) for _, _, fields in got.items] == [3, 3, 3, 3]
    r = routes.router()
    for (_, _, fields), item in zip(got.items, got.message().batch.items, strict=True):
        read, parsed = (routes.outcome(convert.route_request, route, r, "") for route in (fields, item.route))
        assert read == parsed


# ---- the handler: a batch read from its bytes is answered as its message ------------------------

class _Call:
    def __init__(self) -> None:
        self.replies: list[bytes] = []
        self._serialize = passes_bytes(pb.RouteStreamResponse.SerializeToString)

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        pass

    async def write(self, reply: pb.RouteStreamResponse | bytes) -> None:
        self.replies.append(self._serialize(reply))

    def peer(self) -> str:
        return "ipv4:10.0.0.1:5000"


def _answers(messages: list[pb.RouteStreamRequest | stream_wire.WireBatch], traced: bool) -> tuple[list[bytes], Any]:
    r = routes.router()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    service = KVRouterService(r, provider.get_tracer("test") if traced else None,
                              Metrics(MeterProvider(), lambda: len(r.index), lambda: ()), 65536)
    call = _Call()

    async def requests() -> AsyncIterator[Any]:
        for msg in messages:
            yield msg

    asyncio.run(service.RouteStream(requests(), call))
    spans = [(s.name, dict(s.attributes), s.status.status_code) for s in exporter.get_finished_spans()]
    return call.replies, spans


@pytest.mark.parametrize("traced", [False, True])
def test_the_handler_answers_a_batch_read_from_its_bytes_as_the_parsed_message(traced: bool) -> None:
    rng = random.Random(5)
    batches, sent = [], []  # Routes and Completes of requests routed earlier, some of them refused
    for step in range(60):
        items = []
        for n in range(rng.randrange(1, 8)):
            if sent and rng.random() < 0.4:
                done = completes.random_message(rng)
                done.request_id = sent.pop(rng.randrange(len(sent)))
                items.append(pb.RouteStreamRequest(id=step * 10 + n, complete=done))
            else:
                route = routes.random_message(rng)
                route.request_id = rng.choice(("", f"r{step}-{n}"))
                if route.request_id:
                    sent.append(route.request_id)
                items.append(pb.RouteStreamRequest(id=step * 10 + n, route=route))
        batch = pb.RouteStreamRequestBatch(items=items)
        batches.append(pb.RouteStreamRequest(id=step, batch=batch).SerializeToString())
    read = [stream_wire.stream_message(data, MAX_STREAM_BATCH_ITEMS) for data in batches]
    assert sum(type(msg) is stream_wire.WireBatch for msg in read) > 30  # most are read from their bytes
    by_wire = _answers(read, traced)
    by_message = _answers([pb.RouteStreamRequest.FromString(data) for data in batches], traced)
    assert by_wire == by_message
    answers = [item for reply in by_wire[0] for item in pb.RouteStreamResponse.FromString(reply).batch.items]
    kinds = {item.WhichOneof("kind") for item in answers}
    assert kinds == {"route", "complete", "error"}  # answered, completed and refused items all compared
    assert not traced or len(by_wire[1]) > 100
