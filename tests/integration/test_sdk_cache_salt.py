"""A tenant's cache salt through the SDK: blocks an engine publishes under a salt match the
SDK's Routes under that salt only, as in the engine (vLLM/SGLang ``cache_salt``)."""

from __future__ import annotations

import grpc
import pytest

from kvrouter_client import EventPublisher, RouterClient
from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon

BS = 16
PROMPT = list(range(100, 100 + 20 * BS))


@pytest.mark.parametrize(("send_block_keys", "batch_blocks"), [(False, 1024), (True, 1024), (False, 8)])
async def test_sdk_routes_match_blocks_stored_under_their_salt_and_only_theirs(send_block_keys: bool,
                                                                                batch_blocks: int) -> None:
    """``batch_blocks`` 8: the publisher cuts the 20-block chain into batches, each part's parent
    the key of the block before it, chained from the salted namespace."""
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "block_size": BS}), seed=1)
    port = await daemon.start()
    target = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = router_pb2_grpc.KVRouterStub(channel)
            for w in ("a", "b"):
                await stub.RegisterWorker(pb.RegisterWorkerRequest(
                    worker=pb.Worker(id=w, address=f"{w}:1", mode=pb.CACHE_STATE_MODE_EVENTS)))
        async with EventPublisher(target, worker_id="a", block_size=BS, max_batch_blocks=batch_blocks) as publisher:
            publisher.stored(PROMPT, model="m", cache_salt="tenant-1")
            assert await publisher.flush(timeout=5)
        async with RouterClient(target, timeout=5, send_block_keys=send_block_keys) as client:
            for _ in range(2):  # the second on a stream that has seen the router's block size
                same = await client.route(PROMPT, model="m", cache_salt="tenant-1")
                await client.complete(same)
            other = await client.route(PROMPT, model="m", cache_salt="tenant-2")
            await client.complete(other)
            unsalted = await client.route(PROMPT, model="m")
            await client.complete(unsalted)
        assert (same.worker_id, same.matched_blocks) == ("a", 20)
        assert other.matched_blocks == 0 and unsalted.matched_blocks == 0
    finally:
        await daemon.stop(grace=0)
