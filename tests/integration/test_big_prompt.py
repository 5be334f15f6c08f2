"""A huge prompt does not hold up routing (issue #16 item 1), over a real daemon.

A Route whose prompt field reaches ``limits.off_loop_prompt_bytes`` is decoded and hashed on a
worker thread, and so are the Routes of a RouteStream message of that size (top level or batch
items). The probe tests prove the loop served another Route while a huge one was being hashed
(structure, not timing: the hash waits until the probe is answered, which could never happen if
hashing held the loop); the others hold the split path to the same answers, ids, limits,
statuses, spans and admission as the parsed one.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from google.protobuf.message import DecodeError

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.server import convert, off_loop

from ..wire import length_delimited as frame
from ..wire import varint, varint_field
from .test_bounded_input import state
from .test_daemon import BS, publish, register

#: small enough that the test's prompts take the off-loop path without being large
OFF_LOOP_BYTES = 4096
MAX_TOKENS = 50_000


def le32(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


@pytest.fixture
def daemon_config() -> dict:
    return {"limits": {"off_loop_prompt_bytes": OFF_LOOP_BYTES, "max_prompt_tokens": MAX_TOKENS}}


def hash_after_probe(service, what: str) -> tuple[threading.Event, threading.Event]:  # type: ignore[no-untyped-def]
    """Make ``service`` hash a huge prompt only once a probe Route has been answered meanwhile:
    (the hashing started, the probe answered: the test sets it)."""
    real_hash = service.hash_prompt
    hashing = threading.Event()
    probe_answered = threading.Event()

    def gated(split, block_size, max_tokens, adapter_bases):  # type: ignore[no-untyped-def]
        hashing.set()
        # the probe must be answered while this hash is in progress: were the hash on the
        # loop, the probe could not run and this wait would time out
        assert probe_answered.wait(30), f"no Route was answered while {what} was being hashed"
        return real_hash(split, block_size, max_tokens, adapter_bases)

    service.hash_prompt = gated
    return hashing, probe_answered


async def test_small_route_answered_while_a_huge_prompt_is_hashed(running):
    stub = running.stub
    await register(stub, "a")
    await register(stub, "b")
    hashing, probe_answered = hash_after_probe(running.daemon.service, "a huge prompt")
    huge = asyncio.ensure_future(stub.Route(pb.RouteRequest(token_ids_le32=le32(list(range(40_000))), request_id="huge")))
    assert await asyncio.to_thread(hashing.wait, 30)
    probe = await stub.Route(pb.RouteRequest(token_ids=list(range(4 * BS)), request_id="probe"))
    probe_answered.set()
    assert probe.request_id == "probe" and probe.prompt_blocks == 4
    resp = await huge
    assert resp.request_id == "huge" and resp.prompt_blocks == 40_000 // BS


async def test_huge_prompts_route_as_parsed_ones(running):
    stub = running.stub
    await register(stub, "a")
    await register(stub, "b")
    prompt = list(range(70_000, 70_000 + 2048 * BS))  # 32 KiB packed: split
    held = prompt[: 1500 * BS]
    await publish(stub, pb.EventBatch(worker_id="b", sequence=0, events=[pb.CacheEvent(stored=pb.StoredBlocks(
        token_ids_le32=le32(held), engine_hashes=list(range(1, 1501)), model="m", lora="l", cache_salt="s"))]))
    router = running.router
    tail = [5] * (BS - 1)
    for msg in (pb.RouteRequest(token_ids_le32=le32(prompt + tail), model="m", lora="l", cache_salt="s"),
                pb.RouteRequest(token_ids=prompt + tail, model="m", lora="l", cache_salt="s")):
        data = msg.SerializeToString()
        assert type(running.daemon.service.route_message(data)) is off_loop.SplitRoute
        # the same RouteRequest as the parsed path builds, so the same decision for the same index
        split = off_loop.route_message(data, OFF_LOOP_BYTES)
        assert isinstance(split, off_loop.SplitRoute)
        hashed = off_loop.hash_wire_prompt(split, router.block_size, MAX_TOKENS)
        assert convert.route_request(split.msg, router, hashed) == convert.route_request(msg, router)
        resp = await stub.Route(msg)
        assert (resp.worker_id, resp.matched_blocks, resp.prompt_blocks) == ("b", 1500, 2048)
        await stub.Complete(pb.CompleteRequest(request_id=resp.request_id))
    # another model's namespace matches nothing: the split path salts the keys too
    resp = await stub.Route(pb.RouteRequest(token_ids_le32=le32(prompt), model="other"))
    assert resp.matched_blocks == 0


async def test_huge_prompts_rejected_precisely_and_change_nothing(running):
    stub = running.stub
    await register(stub, "a")
    before = state(running)
    over = list(range(MAX_TOKENS + 1))
    cases = [
        (pb.RouteRequest(token_ids_le32=le32(over)), grpc.StatusCode.RESOURCE_EXHAUSTED,
         f"prompt of {MAX_TOKENS + 1} tokens exceeds max_prompt_tokens={MAX_TOKENS}"),
        (pb.RouteRequest(token_ids=over), grpc.StatusCode.RESOURCE_EXHAUSTED,
         f"prompt of {MAX_TOKENS + 1} tokens exceeds max_prompt_tokens={MAX_TOKENS}"),
        (pb.RouteRequest(token_ids_le32=le32(over[:5000]) + b"\x01"), grpc.StatusCode.INVALID_ARGUMENT,
         "token_ids_le32 holds 20001 bytes, not a multiple of 4 (little-endian uint32 token ids)"),
        (pb.RouteRequest(token_ids=over[:5000], block_keys=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT,
         "set exactly one of token_ids, token_ids_le32 and block_keys, not several"),
        (pb.RouteRequest(token_ids_le32=le32(over[:5000]), task=99), grpc.StatusCode.INVALID_ARGUMENT,
         "unknown task category 99"),
        (pb.RouteRequest(token_ids_le32=le32(over[:5000]), token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT,
         "set exactly one of token_ids, token_ids_le32 and block_keys, not several"),
    ]
    for msg, code, details in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Route(msg)
        assert (err.value.code(), err.value.details()) == (code, details)
    # a packed varint chunk cut short inside a token id: field 2, 5,000 bytes, the last one continuing;
    # with a task its checks reject, too; valid ids, then a string of bad UTF-8 or a length past the
    # end: upb's error comes first, in upb's words, as parsed whole
    cut = b"\x12" + bytes([0x88, 0x27]) + b"\x01" * 4999 + b"\x80"
    ids = frame(2, b"\x01" * 5000)
    for data in (cut, b"\x40\x63" + cut, cut + b"\x40\x63", ids + frame(7, b"\xff"), ids + b"\x3a\x05ab"):
        assert type(running.daemon.service.route_message(data)) is off_loop.SplitRoute
        with pytest.raises(DecodeError) as parsed:
            pb.RouteRequest.FromString(data)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.channel.unary_unary("/kvrouter.v1.KVRouter/Route")(data)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (f"request is not a valid kvrouter.v1.RouteRequest message ({len(data)} bytes): "
                                       f"{str(parsed.value)!r}")
    assert state(running) == before


# ---- RouteStream: the same split for the Routes inside a stream message ------------------------


def stream_route(i: int, **fields) -> pb.RouteStreamRequest:  # type: ignore[no-untyped-def]
    return pb.RouteStreamRequest(id=i, route=pb.RouteRequest(**fields))


def stream_batch(*items: pb.RouteStreamRequest) -> pb.RouteStreamRequest:
    return pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=items))


async def test_small_route_answered_while_a_huge_stream_message_is_hashed(running):
    stub = running.stub
    await register(stub, "a")
    await register(stub, "b")
    hashing, probe_answered = hash_after_probe(running.daemon.service, "a huge stream message")
    huge_call = stub.RouteStream()
    await huge_call.write(stream_route(7, token_ids_le32=le32(list(range(40_000))), request_id="huge"))
    assert await asyncio.to_thread(hashing.wait, 30)
    probe_call = stub.RouteStream()  # another stream (a unary Route would do as well)
    await probe_call.write(stream_route(1, token_ids=list(range(4 * BS)), request_id="probe"))
    probe = await probe_call.read()
    probe_answered.set()
    assert (probe.id, probe.route.request_id, probe.route.prompt_blocks) == (1, "probe", 4)
    reply = await huge_call.read()
    assert (reply.id, reply.route.request_id, reply.route.prompt_blocks) == (7, "huge", 40_000 // BS)
    for call in (huge_call, probe_call):
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


async def test_huge_batch_items_answered_under_their_own_ids(running):
    stub = running.stub
    await register(stub, "a")
    await register(stub, "b")
    prompt = list(range(70_000, 70_000 + 2048 * BS))  # 32 KiB packed: split
    held = prompt[: 1500 * BS]
    await publish(stub, pb.EventBatch(worker_id="b", sequence=0, events=[pb.CacheEvent(stored=pb.StoredBlocks(
        token_ids_le32=le32(held), engine_hashes=list(range(1, 1501)), model="m"))]))
    router = running.router
    msg = stream_batch(
        stream_route(11, token_ids_le32=le32(prompt), model="m", request_id="packed"),
        pb.RouteStreamRequest(id=12, complete=pb.CompleteRequest(request_id="never-routed")),
        stream_route(13, token_ids=prompt[: 1000 * BS], model="m", request_id="repeated"),
        stream_route(14, token_ids=list(range(4 * BS)), request_id="small"),
        stream_route(15, token_ids_le32=le32(prompt), model="m", task=99),
    )
    data = msg.SerializeToString()
    split = running.daemon.service.route_stream_message(data)
    assert type(split) is off_loop.SplitStream and sorted(split.routes) == [0, 2, 3, 4]
    before = state(running)
    call = stub.RouteStream()
    await call.write(msg)
    reply = await call.read()
    answers = {a.id: a for a in reply.batch.items}
    assert list(answers) == [11, 12, 13, 14, 15]
    assert (answers[11].route.request_id, answers[11].route.worker_id, answers[11].route.matched_blocks,
            answers[11].route.prompt_blocks) == ("packed", "b", 1500, 2048)
    assert (answers[13].route.request_id, answers[13].route.worker_id, answers[13].route.matched_blocks,
            answers[13].route.prompt_blocks) == ("repeated", "b", 1000, 1000)
    assert (answers[14].route.request_id, answers[14].route.prompt_blocks) == ("small", 4)
    assert (answers[12].error.code, answers[15].error.code) == (grpc.StatusCode.NOT_FOUND.value[0],
                                                                grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert answers[15].error.message == "unknown task category 99"
    assert router.workers.inflight_count == before[2] + 3
    spans = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
    assert [s.attributes.get("kvrouter.chosen.worker_id") for s in spans] == ["b", "b", spans[2].attributes["kvrouter.chosen.worker_id"], None]
    assert spans[3].status.status_code.name == "ERROR"  # one span per Route, rejected ones included
    # the decisions are the parsed path's: the same requests (same keys) as route_request builds
    for place, item in ((0, msg.batch.items[0]), (2, msg.batch.items[2])):
        hashed = off_loop.hash_wire_prompt(split.routes[place], router.block_size, MAX_TOKENS)
        assert convert.route_request(split.routes[place].msg, router, hashed) == convert.route_request(item.route, router)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_huge_stream_prompts_rejected_as_parsed_ones_and_change_nothing(running):
    stub = running.stub
    await register(stub, "a")
    before = state(running)
    over = list(range(MAX_TOKENS + 1))
    too_big = (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], f"prompt of {MAX_TOKENS + 1} tokens exceeds max_prompt_tokens={MAX_TOKENS}")
    call = stub.RouteStream()
    for msg in (stream_route(1, token_ids_le32=le32(over)), stream_route(2, token_ids=over)):
        await call.write(msg)
        reply = await call.read()
        assert (reply.id, reply.error.code, reply.error.message) == (msg.id, *too_big)
    await call.write(stream_batch(stream_route(3, token_ids_le32=le32(over)), stream_route(4, token_ids=over[:5000], block_keys=[1])))
    reply = await call.read()
    assert [(a.id, a.error.code, a.error.message) for a in reply.batch.items] == [
        (3, *too_big), (4, grpc.StatusCode.INVALID_ARGUMENT.value[0], "set exactly one of token_ids, token_ids_le32 and block_keys, not several")]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert state(running) == before

    # token ids that are no valid varints (here past the limit, so never decoded): the whole message
    # is refused as its parse would be, INVALID_ARGUMENT with upb's words, and the stream ends
    route = frame(2, b"\x01" * (MAX_TOKENS + 1) + b"\x80")  # token_ids, the last varint cut short
    data = frame(5, frame(1, b"\x08\x05" + frame(2, route)) + frame(1, stream_route(6, token_ids=[1]).SerializeToString()))
    assert type(running.daemon.service.route_stream_message(data)) is off_loop.SplitStream
    with pytest.raises(DecodeError) as parsed:
        pb.RouteStreamRequest.FromString(data)
    call = running.channel.stream_stream("/kvrouter.v1.KVRouter/RouteStream")()
    await call.write(data)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (f"request is not a valid kvrouter.v1.RouteStreamRequest message ({len(data)} bytes): "
                                   f"{str(parsed.value)!r}")
    assert state(running) == before


@pytest.mark.parametrize("daemon_config", [{
    "limits": {"off_loop_prompt_bytes": OFF_LOOP_BYTES, "max_prompt_tokens": MAX_TOKENS},
    "admission": {"max_inflight": 1, "max_wait_s": 5}}])
async def test_huge_stream_routes_wait_in_admission_queues_as_parsed_ones(running):
    stub = running.stub
    await register(stub, "a")
    msg = stream_batch(stream_route(21, token_ids_le32=le32(list(range(8000))), request_id="first"),
                       stream_route(22, token_ids=list(range(9000)), request_id="second", session_id="s"))
    assert type(running.daemon.service.route_stream_message(msg.SerializeToString())) is off_loop.SplitStream
    call = stub.RouteStream()
    await call.write(msg)
    first = await call.read()  # admitted at once, answered on its own
    assert (first.id, first.route.request_id, first.route.prompt_blocks) == (21, "first", 8000 // BS)
    assert [e.request_id for e in running.daemon.admission.queues.queue("a")] == ["second"]
    await call.write(pb.RouteStreamRequest(id=23, complete=pb.CompleteRequest(request_id="first", success=True)))
    replies = {r.id: r for r in (await call.read(), await call.read())}
    assert replies[23].WhichOneof("kind") == "complete"
    assert (replies[22].route.request_id, replies[22].route.prompt_blocks) == ("second", 9000 // BS)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF




# ---- huge messages in an encoding the split does not read: refused, never parsed whole -----------


def odd_message(type_name: str, size: int, reason: str) -> str:
    return (f"{type_name} of {size} bytes is encoded in a form the router reads only below "
            f"limits.off_loop_prompt_bytes ({OFF_LOOP_BYTES} bytes): {reason}; encode it as protobuf encoders do "
            "(token_ids packed, as every proto3 encoder writes them, or token_ids_le32)")


async def test_huge_odd_messages_refused_precisely_the_stream_survives_and_nothing_changes(running):
    stub = running.stub
    await register(stub, "a")
    before = state(running)
    unpacked = b"".join(b"\x10" + varint(t) for t in range(3000))  # 3,000 token ids, a field each: ~8.7 KB
    assert len(unpacked) >= OFF_LOOP_BYTES
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.channel.unary_unary("/kvrouter.v1.KVRouter/Route")(unpacked)
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, odd_message("RouteRequest", len(unpacked), "unpacked token_ids (a field per id)"))
    assert state(running) == before

    # on a stream: answered under the message's id, and the stream goes on
    call = running.channel.stream_stream("/kvrouter.v1.KVRouter/RouteStream")()
    odd = varint_field(1, 41) + frame(2, unpacked)
    await call.write(odd)
    reply = pb.RouteStreamResponse.FromString(await call.read())
    assert (reply.id, reply.error.code, reply.error.message) == (
        41, grpc.StatusCode.INVALID_ARGUMENT.value[0],
        odd_message("RouteStreamRequest", len(odd), "unpacked token_ids (a field per id)"))
    assert state(running) == before
    await call.write(stream_route(42, token_ids=list(range(4 * BS)), request_id="after").SerializeToString())
    reply = pb.RouteStreamResponse.FromString(await call.read())
    assert (reply.id, reply.route.request_id, reply.route.worker_id, reply.route.prompt_blocks) == (42, "after", "a", 4)
    await call.write(pb.RouteStreamRequest(id=43, complete=pb.CompleteRequest(request_id="after")).SerializeToString())
    assert pb.RouteStreamResponse.FromString(await call.read()).WhichOneof("kind") == "complete"
    # one whose top level is odd has no id to be answered under: the stream ends, as for bytes
    # that do not parse
    group = b"\xfb\x01\xfc\x01" + frame(2, unpacked)
    await call.write(group)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, odd_message("RouteStreamRequest", len(group), "a group (field 31, wire type 3)"))
    assert state(running) == before

    # and a normal Route after all that
    resp = await stub.Route(pb.RouteRequest(token_ids=list(range(4 * BS)), request_id="normal"))
    assert (resp.request_id, resp.worker_id, resp.prompt_blocks) == ("normal", "a", 4)
