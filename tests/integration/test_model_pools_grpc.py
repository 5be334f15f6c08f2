"""Model pools and LoRA residency over real grpc.aio (issue #31 items 1-2): RegisterWorker's
models and adapters, Route kept to its model's pool, ReportLoad's loaded adapters."""

from __future__ import annotations

import grpc
import pytest
from kvrouter_client import EventPublisher, WorkerRole

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
