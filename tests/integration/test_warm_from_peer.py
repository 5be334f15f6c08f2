"""A new replica copies a running one's index (ExportIndex) before it reports SERVING."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon

from ..invariants import index_state
from .test_daemon import BS, publish, register, stored


async def test_new_replica_warms_from_a_peer_and_routes_like_it(running):
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    prompt = list(range(3000, 3000 + 12 * BS))
    await publish(
        stub,
        pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt[: 10 * BS], list(range(1, 11)))]),
        pb.EventBatch(worker_id="b", sequence=0, events=[stored(prompt[: 4 * BS], list(range(21, 25)))]),
    )
    chunks = [c async for c in stub.ExportIndex(pb.ExportIndexRequest(max_blocks_per_chunk=3))]
    assert sorted(c.worker.id for c in chunks) == ["a"] * 4 + ["b"] * 2
    assert sum(len(c.keys) for c in chunks) == 14

    replica = Daemon(parse_config({"listen": "127.0.0.1:0", "warm_from": f"127.0.0.1:{running.daemon.port}"}), seed=2)
    port = await replica.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            rstub = router_pb2_grpc.KVRouterStub(ch)
            workers = {w.id: w for w in (await rstub.ListWorkers(pb.ListWorkersRequest())).workers}
            assert workers["a"].cached_blocks == 10 and workers["b"].cached_blocks == 4
            assert workers["a"].address == "a.local:8000" and workers["a"].mode == pb.CACHE_STATE_MODE_EVENTS
            resp = await rstub.Route(pb.RouteRequest(token_ids=prompt))
            assert resp.worker_id == "a" and resp.matched_blocks == 10
            # engine hashes came along: the engine's removal by its own hash applies on the replica
            await publish(rstub, pb.EventBatch(worker_id="a", sequence=0,
                                               events=[pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[10]))]))
            assert replica.router.index.count(replica.router.workers.get("a").slot) == 9
    finally:
        await replica.stop(grace=0.1)


async def test_unreachable_peer_means_a_cold_start():
    replica = Daemon(parse_config({"listen": "127.0.0.1:0", "warm_from": "127.0.0.1:1", "warm_timeout_s": 2}))
    await replica.start()
    try:
        assert len(replica.router.workers) == 0
        assert (await replica.health.Check(health_pb2.HealthCheckRequest(), None)).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await replica.stop(grace=0.1)


async def test_unknown_worker_export_is_not_found(running):
    import pytest

    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [c async for c in running.stub.ExportIndex(pb.ExportIndexRequest(worker_ids=["ghost"]))]
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_worker_deregistered_mid_export_ends_its_part_and_the_export_finishes(running):
    """Deregistering a worker while its chunks stream (issue #28 item 4: the export answered
    UNKNOWN KeyError(slot) once the drain had freed the worker's slot) leaves its part short
    and the stream goes on to the other workers."""
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    # 40 chains of 100 blocks: chunks of one block are far more than the transport buffers
    events = [stored(list(range(i * 10_000, i * 10_000 + 100 * BS)), list(range(i * 1000 + 1, i * 1000 + 101)))
              for i in range(40)]
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=events),
                  pb.EventBatch(worker_id="b", sequence=0, events=[stored(list(range(BS * 3)), [7, 8, 9])]))
    call = stub.ExportIndex(pb.ExportIndexRequest(max_blocks_per_chunk=1))
    first = await call.read()
    assert first.worker.id == "a"
    await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="a"))
    assert "a" not in running.router.workers  # and its blocks are gone: the call waits for the drain
    rest = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        rest.append(chunk)
    assert await call.code() == grpc.StatusCode.OK
    a_keys = 1 + sum(len(c.keys) for c in rest if c.worker.id == "a")
    assert a_keys < 4000  # the export stopped at the deregistration, not at the end of the worker
    assert sum(len(c.keys) for c in rest if c.worker.id == "b") == 3


async def test_a_warmed_replica_keeps_what_hangs_under_an_evicted_first_block(running):
    """The engine evicted a chain's first block and kept the rest: the replica skipped the rest
    as unreachable and, once the engine stored the first block again, matched 1 block where its
    peer matched 10 (issue #28 item 12)."""
    stub = running.stub
    await register(stub, "a")
    prompt = list(range(3000, 3000 + 10 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, list(range(1, 11)))]),
                  pb.EventBatch(worker_id="a", sequence=1, events=[pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[1]))]))
    replica = Daemon(parse_config({"listen": "127.0.0.1:0", "warm_from": f"127.0.0.1:{running.daemon.port}"}), seed=2)
    port = await replica.start()
    try:
        assert index_state(replica.router) == index_state(running.router)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            rstub = router_pb2_grpc.KVRouterStub(ch)
            for s in (stub, rstub):  # the engine computes the first block again
                await publish(s, pb.EventBatch(worker_id="a", sequence=2, events=[stored(prompt[:BS], [1])]))
                assert (await s.Route(pb.RouteRequest(token_ids=prompt))).matched_blocks == 10
        assert index_state(replica.router) == index_state(running.router)
    finally:
        await replica.stop(grace=0.1)


async def test_a_warmed_replica_knows_which_adapters_each_worker_has_loaded(running):
    """The peer learned from ReportLoad that b holds adapter "sql": the replica's LoRA stage
    keeps the request there although a, with a free adapter slot, is the less loaded."""
    stub = running.stub
    for wid in ("a", "b"):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
            id=wid, address=f"{wid}.local:8000", mode=pb.CACHE_STATE_MODE_EVENTS, models=["A"], max_loras=2)))
    await stub.ReportLoad(pb.ReportLoadRequest(worker_id="b", loaded_loras=pb.LoraAdapters(names=["chat", "sql"])))
    replica = Daemon(parse_config({"listen": "127.0.0.1:0", "warm_from": f"127.0.0.1:{running.daemon.port}"}), seed=2)
    port = await replica.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            rstub = router_pb2_grpc.KVRouterStub(ch)
            workers = {w.id: w for w in (await rstub.ListWorkers(pb.ListWorkersRequest())).workers}
            assert list(workers["b"].loaded_loras) == ["chat", "sql"] and not workers["a"].loaded_loras
            busy = await rstub.Route(pb.RouteRequest(token_ids=list(range(8 * BS)), model="A", candidate_workers=["b"]))
            assert busy.worker_id == "b"
            resp = await rstub.Route(pb.RouteRequest(token_ids=list(range(9000, 9000 + 8 * BS)), model="A", lora="sql"))
            assert resp.worker_id == "b"
    finally:
        await replica.stop(grace=0.1)
