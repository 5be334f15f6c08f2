"""A huge prompt does not hold up routing (issue #16 item 1), over a real daemon.

A Route whose prompt field reaches ``limits.off_loop_prompt_bytes`` is decoded and hashed on a
worker thread. The probe test proves the loop served another Route while a huge one was being
hashed (structure, not timing: the hash waits until the probe is answered, which could never
happen if hashing held the loop); the others hold the split path to the same answers, limits
and statuses as the parsed one.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.server import convert

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


async def test_small_route_answered_while_a_huge_prompt_is_hashed(running):
    stub = running.stub
    await register(stub, "a")
    await register(stub, "b")
    service = running.daemon.service
    real_hash = service.hash_prompt
    hashing = threading.Event()
    probe_answered = threading.Event()

    def hash_after_probe(split, block_size, max_tokens):  # type: ignore[no-untyped-def]
        hashing.set()
        # the probe below must be answered while this hash is in progress: were the hash on
        # the loop, the probe could not run and this wait would time out
        assert probe_answered.wait(30), "no Route was answered while a huge prompt was being hashed"
        return real_hash(split, block_size, max_tokens)

    service.hash_prompt = hash_after_probe
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
        assert type(running.daemon.service.route_message(data)) is convert.SplitRoute
        # the same RouteRequest as the parsed path builds, so the same decision for the same index
        split = convert.route_message(data, OFF_LOOP_BYTES)
        assert isinstance(split, convert.SplitRoute)
        hashed = convert.hash_wire_prompt(split, router.block_size, MAX_TOKENS)
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
    # a packed varint chunk cut short inside a token id: field 2, 5,000 bytes, the last one continuing
    cut = b"\x12" + bytes([0x88, 0x27]) + b"\x01" * 4999 + b"\x80"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.channel.unary_unary("/kvrouter.v1.KVRouter/Route")(cut)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request is not a valid kvrouter.v1.RouteRequest message: ")
    assert state(running) == before
