"""What one event batch may carry (issue #16 items 1 and 3), over real gRPC on loopback.

A batch is read and applied in one turn of the routing loop, so the daemon refuses one over
``limits.max_event_batch_bytes`` (before parsing it) or ``limits.max_batch_blocks`` (before
reading its hashes) with RESOURCE_EXHAUSTED; the stream's earlier batches stay applied and the
refused one changes nothing. The SDK cuts what it sends under both, a long Stored chain into
chained parts, and the router's index ends exactly as the whole chain applied at once leaves it.
"""

from __future__ import annotations

import asyncio
import random
from array import array

import grpc
import pytest

from kvrouter_client import EventPublisher, Stored as SdkStored, keys
from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.config import LimitsConfig
from kvrouterd.protocols import EventBatch, Stored
from kvrouterd.router import Router

BS = 16
LIMITS = LimitsConfig()


def le32(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


async def register(running, worker_id: str) -> None:  # type: ignore[no-untyped-def]
    await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
        id=worker_id, address=f"{worker_id}.local:8000", mode=pb.CACHE_STATE_MODE_EVENTS, capacity_blocks=1 << 22)))


def stored_batch(worker_id: str, sequence: int, tokens: list[int], hashes: list[int]) -> pb.EventBatch:
    return pb.EventBatch(worker_id=worker_id, sequence=sequence, events=[
        pb.CacheEvent(stored=pb.StoredBlocks(token_ids_le32=le32(tokens), engine_hashes=hashes, block_size=BS))])


def index_state(router: Router, worker_id: str) -> tuple:  # type: ignore[type-arg]
    """Everything the router knows of a worker's cache: its blocks (key -> parent key), the
    engine-hash map, its engine pages and the worker's stored-block count."""
    worker = router.workers.get(worker_id)
    blocks = {b.key: None if b.parent is None else b.parent.key for b in router.index.blocks_of(worker.slot)}
    pages = None if worker.pages is None else {
        eh: (s.anchor, s.tail, s.tail_pages, s.seed, list(s.blocks)) for eh, s in worker.pages._pages.items()}
    return blocks, dict(worker.engine_keys.items()), pages, router.index.count(worker.slot)


async def publish(running, *batches: pb.EventBatch):  # type: ignore[no-untyped-def]
    async def messages():  # type: ignore[no-untyped-def]
        for b in batches:
            yield b
    return await running.stub.PublishEvents(messages())


@pytest.mark.parametrize("over", ["bytes", "stored blocks", "removed hashes"])
async def test_an_oversized_batch_is_refused_precisely_and_changes_nothing(running, over):
    await register(running, "w")
    first = stored_batch("w", 0, list(range(4 * BS)), [1, 2, 3, 4])
    if over == "bytes":  # under the block limit, over the byte limit: refused before it is parsed
        pages = LIMITS.max_event_batch_bytes // (4 * 64) + 1
        big = pb.EventBatch(worker_id="w", sequence=1, events=[pb.CacheEvent(stored=pb.StoredBlocks(
            token_ids_le32=le32([7] * (pages * 64)), engine_hashes=range(100, 100 + pages), block_size=64))])
        assert pages <= LIMITS.max_batch_blocks and big.ByteSize() > LIMITS.max_event_batch_bytes
        words = (f"event batch of {big.ByteSize()} bytes exceeds limits.max_event_batch_bytes="
                 f"{LIMITS.max_event_batch_bytes}: split the batch; the kvrouter_client SDK does")
    else:
        if over == "stored blocks":
            n = LIMITS.max_batch_blocks + 1
            big = stored_batch("w", 1, list(range(n * BS)), list(range(100, 100 + n)))
        else:  # tiny varints: the most hashes a message of this size can carry
            big = pb.EventBatch(worker_id="w", sequence=1, events=[
                pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[1] * (LIMITS.max_batch_blocks + 1)))])
        assert big.ByteSize() <= LIMITS.max_event_batch_bytes
        words = (f"event batch carries more than limits.max_batch_blocks={LIMITS.max_batch_blocks} blocks (stored "
                 "pages and removed hashes; each event counts at least 8): split the batch; the kvrouter_client SDK does")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await publish(running, first, big, stored_batch("w", 2, list(range(500, 500 + BS)), [9]))
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.details() == words
    # the batch before it stays applied; it and the one after it changed nothing
    worker = running.router.workers.get("w")
    assert worker.last_sequence == 0
    assert running.router.index.count(worker.slot) == 4 and set(dict(worker.engine_keys.items())) == {1, 2, 3, 4}
    # the stream's refusal did not stop the worker: the next batch applies in order
    answer = await publish(running, stored_batch("w", 1, list(range(500, 500 + BS)), [9]))
    assert answer.batches_applied == 1 and running.router.index.count(worker.slot) == 5


@pytest.mark.parametrize("form", ["sdk keys", "engine hashes", "pages of 24"])
async def test_the_sdk_splits_a_long_chain_into_the_index_the_whole_chain_makes(running, form):
    """A chain far over both limits, continuing a chain stored before, published through the SDK,
    ends in the index exactly as the same events applied whole in-process: the same blocks,
    parents, engine-hash map and engine pages."""
    page = 24 if form == "pages of 24" else BS
    pages = 200_000 if form == "sdk keys" else 40_000  # 200k blocks: 3.2M tokens, ~12.5 MiB as one event
    rng = random.Random(16)
    root = [rng.randrange(2**32) for _ in range(2 * page)]
    chain = [rng.randrange(50_000) for _ in range(pages * page)]
    if form == "sdk keys":
        root_hashes, hashes = None, None
        parent = keys.block_keys(root, BS)[-1]  # the SDK's keys are the router's
    else:
        root_hashes, hashes = [11, 12], [1000 + i for i in range(pages)]
        parent = 12
    await register(running, "ref")
    router = running.router
    # the reference: each event applied whole, in-process
    router.apply(EventBatch("ref", 0, (Stored(le32(root), None if root_hashes is None else tuple(root_hashes),
                                              None, page),)))
    router.apply(EventBatch("ref", 1, (Stored(le32(chain), None if hashes is None else tuple(hashes), parent, page),)))
    target = f"127.0.0.1:{running.daemon.port}"
    async with EventPublisher(target, "sdk", block_size=page, timeout=5.0, probe_interval_s=0) as pub:
        await pub.register("sdk.local:8000", capacity_blocks=1 << 22)
        pub.stored(root, engine_hashes=root_hashes)
        pub.stored(chain, engine_hashes=hashes, parent_engine_hash=parent)
        assert await pub.flush(timeout=120)
        assert pub.stats.rejected == 0 and pub.stats.resyncs == 0
        parts = pub.stats.batches_sealed
    # the chain went in parts: as many as its pages or bytes need, each under both limits
    per_batch = min(LIMITS.max_batch_blocks, LIMITS.max_event_batch_bytes // (4 * page + (0 if hashes is None else 10)))
    assert parts >= 1 + pages // per_batch
    sdk, ref = index_state(router, "sdk"), index_state(router, "ref")
    assert sdk == ref
    assert sdk[3] == (len(root) + len(chain)) // BS  # every router block of both chains


LOW = {"max_event_batch_bytes": 16384, "max_batch_blocks": 64}


@pytest.mark.parametrize("daemon_config", [{"limits": LOW}])
@pytest.mark.parametrize("learned", ["before publishing", "from a refusal"])
async def test_the_sdk_adopts_a_routers_lower_limits(running, learned):
    """A router with limits below the SDK's defaults says so in every PublishEvents answer: a
    publisher that read them (its register() reads the router's answer before it streams) cuts
    under them from its first batch; one that wrote a batch first has it refused, reads them,
    and resyncs (Cleared + snapshot) cut under them. Either way the whole chain arrives."""
    rng = random.Random(7)
    chain = [rng.randrange(2**32) for _ in range(1000 * BS)]
    hashes = list(range(1, 1001))
    target = f"127.0.0.1:{running.daemon.port}"
    async with EventPublisher(target, "w", block_size=BS, timeout=5.0, probe_interval_s=0,
                              snapshot=lambda: [SdkStored(chain, hashes)]) as pub:
        if learned == "before publishing":
            await pub.register("w.local:8000", capacity_blocks=1 << 20)
            for _ in range(500):  # the publisher's task reads the router's answer after register()
                if pub.router_epoch:
                    break
                await asyncio.sleep(0.01)
        else:
            await register(running, "w")
        pub.stored(chain, engine_hashes=hashes)
        assert await pub.flush(timeout=30)
        assert (pub.batch_limits.max_bytes, pub.batch_limits.max_blocks) == (16384, 64)
        assert pub.stats.rejected == (0 if learned == "before publishing" else 1)
        assert pub.stats.batches_sealed >= 1000 // 64
    worker = running.router.workers.get("w")
    assert running.router.index.count(worker.slot) == 1000
    assert dict(worker.engine_keys.items()).keys() == set(hashes)
