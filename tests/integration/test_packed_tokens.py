"""Token ids packed as little-endian uint32 bytes (``token_ids_le32``) beside the repeated field,
over a real daemon: both forms mean the same prompt, and a malformed packed field is refused
precisely without changing anything."""

from __future__ import annotations

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

from .test_bounded_input import state
from .test_daemon import BS, publish, register


def le32(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


@pytest.fixture
def daemon_config() -> dict:
    return {"limits": {"max_prompt_tokens": 4096}}


async def test_packed_and_repeated_tokens_store_and_route_alike(running):
    stub = running.stub
    await register(stub, "a")
    await register(stub, "b")
    prompt_a = list(range(1000, 1000 + 6 * BS))
    prompt_b = list(range(9000, 9000 + 4 * BS))
    # a new publisher packs its tokens, an old one repeats them; both on one stream
    summary = await publish(
        stub,
        pb.EventBatch(worker_id="a", sequence=0, events=[pb.CacheEvent(stored=pb.StoredBlocks(
            token_ids_le32=le32(prompt_a[: 4 * BS]), engine_hashes=[1, 2, 3, 4]))]),
        pb.EventBatch(worker_id="a", sequence=1, events=[pb.CacheEvent(stored=pb.StoredBlocks(
            token_ids=prompt_a[4 * BS :], engine_hashes=[5, 6], parent_engine_hash=4))]),
        pb.EventBatch(worker_id="b", sequence=0, events=[pb.CacheEvent(stored=pb.StoredBlocks(
            token_ids=prompt_b, engine_hashes=[11, 12, 13, 14]))]),
    )
    assert summary.blocks_stored == 10 and summary.gaps_detected == 0
    # the same keys whichever form stored them: the whole prompt's block keys are held
    router = running.router
    slot_a = router.workers.get("a").slot
    assert all(router.index.holds(slot_a, key) for key in router.keys_for_tokens(prompt_a))
    tail = [7] * (BS // 2)  # a partial block is never keyed, in either form
    for prompt, worker, blocks in ((prompt_a, "a", 6), (prompt_b, "b", 4)):
        packed = await stub.Route(pb.RouteRequest(token_ids_le32=le32(prompt + tail)))
        repeated = await stub.Route(pb.RouteRequest(token_ids=prompt + tail))
        for resp in (packed, repeated):
            assert (resp.worker_id, resp.matched_blocks, resp.prompt_blocks) == (worker, blocks, blocks)
    # the prompt length counts the partial block's tokens in both forms: each call charged its
    # worker the uncached tail
    workers = {w.id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert workers["a"].pending_prefill_tokens == workers["b"].pending_prefill_tokens == 2 * len(tail)
    # removals by engine hash reach blocks stored from packed tokens
    await publish(stub, pb.EventBatch(worker_id="a", sequence=2, events=[
        pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[5, 6]))]))
    resp = await stub.Route(pb.RouteRequest(token_ids_le32=le32(prompt_a), candidate_workers=["a"]))
    assert resp.matched_blocks == 4


@pytest.mark.parametrize(
    "request_msg,code,needle",
    [
        (pb.RouteRequest(token_ids_le32=b"\x01\x00\x00"), grpc.StatusCode.INVALID_ARGUMENT, "3 bytes, not a multiple of 4"),
        (pb.RouteRequest(token_ids_le32=le32([1] * 33)[:-1]), grpc.StatusCode.INVALID_ARGUMENT, "not a multiple of 4"),
        (pb.RouteRequest(token_ids_le32=le32([1] * 32), token_ids=[1] * 32), grpc.StatusCode.INVALID_ARGUMENT,
         "exactly one of token_ids, token_ids_le32 and block_keys"),
        (pb.RouteRequest(token_ids_le32=le32([1] * 32), block_keys=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT,
         "exactly one of token_ids, token_ids_le32 and block_keys"),
        # the same limit as the repeated field (limits.max_prompt_tokens = 4096 here)
        (pb.RouteRequest(token_ids_le32=le32([1] * 4097)), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "prompt of 4097 tokens exceeds max_prompt_tokens=4096"),
        (pb.RouteRequest(token_ids=[1] * 4097), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "prompt of 4097 tokens exceeds max_prompt_tokens=4096"),
    ],
)
async def test_a_bad_packed_prompt_gets_a_precise_status_on_unary_and_stream(running, request_msg, code, needle):
    await register(running.stub, "a")
    before = state(running)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(request_msg)
    assert err.value.code() == code and needle in err.value.details(), err.value
    call = running.stub.RouteStream()
    await call.write(pb.RouteStreamRequest(id=5, route=request_msg))
    reply = await call.read()
    assert reply.id == 5 and reply.error.code == code.value[0] and needle in reply.error.message
    await call.done_writing()
    assert state(running) == before


@pytest.mark.parametrize(
    "stored,needle",
    [
        (pb.StoredBlocks(token_ids_le32=le32(list(range(BS)))[:-2], engine_hashes=[9]),
         "events[1].stored.token_ids_le32 holds 62 bytes, not a multiple of 4"),
        (pb.StoredBlocks(token_ids_le32=le32(list(range(BS))), token_ids=list(range(BS)), engine_hashes=[9]),
         "events[1].stored: set exactly one of token_ids and token_ids_le32"),
        (pb.StoredBlocks(token_ids_le32=le32(list(range(BS + 4))), engine_hashes=[9]),
         "not a positive multiple of the page size 16"),
        (pb.StoredBlocks(token_ids_le32=le32(list(range(2 * BS))), engine_hashes=[9]), "1 engine hashes for 2 pages"),
    ],
)
async def test_a_bad_packed_stored_event_rejects_its_whole_batch(running, stored, needle):
    await register(running.stub, "a")
    good = pb.CacheEvent(stored=pb.StoredBlocks(token_ids_le32=le32(list(range(100, 100 + BS))), engine_hashes=[1]))
    before = state(running)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await publish(running.stub, pb.EventBatch(worker_id="a", sequence=0, events=[good, pb.CacheEvent(stored=stored)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details(), err.value
    assert state(running) == before  # not even the good event before it
    assert running.router.workers.get("a").last_sequence == -1
