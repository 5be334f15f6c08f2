"""Model pools, LoRA residency and prefill/decode pools over real grpc.aio (issue #31): RegisterWorker's
models, adapters and roles, Route kept to its model's pool and split into its hops, ReportLoad's
loaded adapters."""

from __future__ import annotations

import grpc
import pytest
from kvrouter_client import EventPublisher, RouterClient, WorkerRole

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from tests.integration.test_sdk_against_daemon import target


async def register(stub, wid, models=(), loras=(), max_loras=0, role=pb.WORKER_ROLE_UNSPECIFIED):
    worker = pb.Worker(id=wid, address=f"{wid}.local:8000", models=models, loras=loras, max_loras=max_loras, role=role)
    return (await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=worker))).worker


async def test_register_worker_declares_a_pool_and_list_workers_shows_it(running):
    stub = running.stub
    answer = await register(stub, "a", ["A"], ["sql"], 2, pb.WORKER_ROLE_DECODE)
    assert (list(answer.models), list(answer.loras), answer.max_loras, answer.role) == (["A"], ["sql"], 2,
                                                                                         pb.WORKER_ROLE_DECODE)
    plain = await register(stub, "b")
    assert plain.role == pb.WORKER_ROLE_BOTH and not plain.models  # unspecified reads as both, any model


async def test_a_route_for_model_b_never_lands_on_an_a_only_worker(running):
    stub = running.stub
    await register(stub, "a1", ["A"])
    await register(stub, "a2", ["A"])
    await register(stub, "b1", ["B"])
    for n in range(12):
        answer = await stub.Route(pb.RouteRequest(token_ids=list(range(n * 100, n * 100 + 64)), model="B"))
        assert answer.worker_id == "b1"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Route(pb.RouteRequest(token_ids=[1] * 64, model="C"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'C'" in err.value.details()
    assert running.router.workers.inflight_count == 12


async def test_report_load_sets_the_loaded_adapters_and_a_lora_route_prefers_them(running):
    stub = running.stub
    await register(stub, "w1", ["A"], max_loras=2)
    await register(stub, "w2", ["A"], max_loras=2)
    await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w2", loaded_loras=pb.LoraAdapters(names=["sql", "chat"])))
    await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w1"))  # not reported: nothing changes
    listed = {w.id: list(w.loaded_loras) for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert listed == {"w1": [], "w2": ["sql", "chat"]}
    answer = await stub.Route(pb.RouteRequest(token_ids=list(range(64)), model="A", lora="sql"))
    assert answer.worker_id == "w2"
    # w2 is full (two adapters): a third goes to w1's free slots
    answer = await stub.Route(pb.RouteRequest(token_ids=list(range(64)), model="A", lora="new"))
    assert answer.worker_id == "w1"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w2", loaded_loras=pb.LoraAdapters(names=[""])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w2", loaded_loras=pb.LoraAdapters()))  # set, empty
    listed = {w.id: list(w.loaded_loras) for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert listed == {"w1": ["new"], "w2": []}


async def test_the_sdk_registers_a_pool_and_reports_loaded_adapters(running):
    async with EventPublisher(target(running), "p", block_size=16, timeout=2.0) as pub:
        info = await pub.register("p.local:8000", models=["A"], loras=["sql"], max_loras=4, role=WorkerRole.PREFILL)
        assert (info.models, info.loras, info.max_loras, info.role) == (("A",), ("sql",), 4, WorkerRole.PREFILL)
        await pub.report_load(0, 1, 0.2, loaded_loras=["sql"])
        assert list(running.router.workers.get("p").loras) == ["sql"]
        await pub.report_load(0, 1, 0.2)  # not reported: kept
        assert list(running.router.workers.get("p").loras) == ["sql"]


async def test_a_pd_pool_routes_both_hops_and_completes_each(running):
    """Issue #31 items 3, 4 and 6 end to end: the prefill hop while the decode worker publishes
    nothing (said in the reason and in ListWorkers), released on its own; once the decode worker
    publishes the prompt, the next turn prefills there."""
    stub = running.stub
    await register(stub, "p1", ["A"], role=pb.WORKER_ROLE_PREFILL)
    tokens = list(range(4096))
    async with EventPublisher(target(running), "d1", block_size=16, timeout=2.0) as pub, \
            RouterClient(target(running), timeout=2.0) as client:
        await pub.register("d1.local:8000", models=["A"], role=WorkerRole.DECODE)
        listed = {w.id: w for w in await client.list_workers()}
        assert (listed["d1"].event_batches, listed["d1"].last_event_age_s) == (0, 0.0)
        assert running.router.decode_workers_without_events() == 1

        answer = await stub.Route(pb.RouteRequest(token_ids=tokens, model="A", request_id="t1"))
        assert (answer.worker_id, answer.worker_address) == ("d1", "d1.local:8000")
        assert answer.disaggregated and answer.disaggregation_reason == "remote_prefill+decode_cache_unknown"
        assert (answer.prefill_worker_id, answer.prefill_worker_address) == ("p1", "p1.local:8000")
        assert answer.prefill_uncached_tokens == answer.decode_uncached_tokens == 4096
        p1, d1 = running.router.workers.get("p1"), running.router.workers.get("d1")
        assert (p1.pending_prefill_tokens, d1.pending_prefill_tokens) == (4096, 0)
        await stub.Complete(pb.CompleteRequest(request_id="t1", prefill_done=True, prefill_ms=120.0, kv_transfer_ms=8.0))
        assert (p1.inflight_requests, d1.inflight_requests) == (0, 1)
        await stub.Complete(pb.CompleteRequest(request_id="t1", ttft_ms=140.0, e2e_ms=900.0, success=True))
        assert d1.inflight_requests == 0
        assert running.daemon.metrics.pd_decisions.counts == {"remote_prefill+decode_cache_unknown": 1}

        # the decode worker now publishes what it holds (the prompt, received by transfer)
        pub.stored(tokens, model="A")
        assert await pub.flush(timeout=5)
        listed = {w.id: w for w in await client.list_workers()}
        assert listed["d1"].event_batches == 1 and running.router.decode_workers_without_events() == 0
        result = await client.route(tokens + list(range(10_000, 10_100)), model="A")
        assert (result.worker_id, result.disaggregated, result.prefill_worker_id) == ("d1", False, "")
        assert (result.disaggregation_reason, result.decode_uncached_tokens) == ("decode_cached", 100)
        assert await client.complete(result, ttft_ms=20.0, e2e_ms=300.0)

        # a long new prompt goes through p1 again; the SDK shows both hops
        result = await client.route(list(range(50_000, 54_096)), model="A")
        assert result.disaggregated and result.disaggregation_reason == "remote_prefill"
        assert (result.prefill_worker_address, result.prefill_uncached_tokens) == ("p1.local:8000", 4096)
        assert await client.complete(result, prefill_ms=100.0, kv_transfer_ms=5.0, ttft_ms=130.0)
        assert running.router.workers.inflight_count == 0


@pytest.mark.parametrize("daemon_config", [{"limits": {"off_loop_prompt_bytes": 4096}}])
async def test_a_route_naming_its_adapter_in_model_matches_what_the_engine_stored_for_it(running):
    """OpenAI-style requests name the adapter in ``model``; the engine (vLLM: the endpoint's
    base model and the request's lora_name) stores the blocks under (base, adapter). The keys
    must be the same on every hashing path: a small unary Route, a streamed one, and a prompt
    over ``off_loop_prompt_bytes`` hashed on a worker thread."""
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid, ["base"], ["sql"])
    small = list(range(100, 100 + 20 * 16))
    big = list(range(9000, 9000 + 80 * 16))  # 5,120 bytes packed: hashed off the loop
    for seq, prompt in enumerate((small, big)):
        event = pb.CacheEvent(stored=pb.StoredBlocks(token_ids=prompt, model="base", lora="sql"))
        await stub.PublishEvents(iter([pb.EventBatch(worker_id="a", sequence=seq, events=[event])]))
    blocks = {id(small): 20, id(big): 80}
    for prompt in (small, big):
        packed = b"".join(t.to_bytes(4, "little") for t in prompt)
        unary = await stub.Route(pb.RouteRequest(token_ids_le32=packed, model="sql"))
        assert (unary.worker_id, unary.matched_blocks) == ("a", blocks[id(prompt)])
        await stub.Complete(pb.CompleteRequest(request_id=unary.request_id))
        async with RouterClient(target(running), timeout=5) as client:
            streamed = await client.route(prompt, model="sql")
            await client.complete(streamed)
        assert (streamed.worker_id, streamed.matched_blocks) == ("a", blocks[id(prompt)])
    # the base model alone, or another adapter of it, never sees the adapter's blocks
    other = await stub.Route(pb.RouteRequest(token_ids=small, model="base"))
    assert other.matched_blocks == 0
