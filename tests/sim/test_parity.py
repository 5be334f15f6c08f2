"""Parity: one request/event log, replayed through the gRPC daemon, gives the simulator's decisions.

The simulator records every call it makes into its Router (routes, event batches,
completions, load reports, maintenance ticks). The log is replayed into a real ``Daemon`` on 127.0.0.1:0
over grpc.aio (Route, PublishEvents, ReportLoad, Complete), with a manual clock set to each call's
simulated time and the same seed. The daemon's own maintenance loop is kept out of the way
with a 10 s tick interval (the test ends first); the recorded ticks (every 50 ms of simulated
time) are replayed by calling its router's ``tick`` as that loop would. Same config, same registry, same decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.policies import registry
from kvrouterd.protocols import Cleared, EventBatch, Removed, Stored
from kvrouterd.server.app import Daemon
from kvrouterd.sim.cluster import ClusterSettings, Simulation
from kvrouterd.sim.engine import EngineParams
from kvrouterd.sim.workloads import build_workload, gsp

SEED = 5


def batch_message(batch: EventBatch) -> pb.EventBatch:
    msg = pb.EventBatch(worker_id=batch.worker_id, sequence=batch.sequence)
    for ev in batch.events:
        if isinstance(ev, Stored):
            assert isinstance(ev.token_ids, bytes)
            tokens = [int.from_bytes(ev.token_ids[i:i + 4], "little") for i in range(0, len(ev.token_ids), 4)]
            stored = pb.StoredBlocks(token_ids=tokens, block_size=ev.block_size)
            if ev.parent_engine_hash is not None:
                stored.parent_engine_hash = ev.parent_engine_hash
            msg.events.append(pb.CacheEvent(stored=stored))
        elif isinstance(ev, Removed):
            msg.events.append(pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=list(ev.engine_hashes))))
        else:
            assert isinstance(ev, Cleared)
            msg.events.append(pb.CacheEvent(cleared=pb.AllBlocksCleared()))
    return msg


def route_message(rr) -> pb.RouteRequest:
    return pb.RouteRequest(request_id=rr.request_id, block_keys=rr.keys, prompt_tokens=rr.prompt_tokens,
                           session_id=rr.session_id, task=int(rr.task), ttft_slo_ms=rr.ttft_slo_ms,
                           expected_output_tokens=rr.expected_output_tokens)


async def replay(sim: Simulation) -> dict[str, str]:
    """Each request's worker, as the daemon decides it replaying ``sim``'s log.

    In admission queue mode a Route call may wait in the daemon's queue: it is started as a
    task at its "arrive", the replay moves on once the daemon has queued or answered it, and
    the Complete (or tick) that frees room later admits it, as in the simulation."""
    assert sim.log is not None
    clock = ManualClock()
    # the daemon's wall-clock maintenance loop must not fire mid-replay: the recorded ticks stand in for it
    # deadline admission (on by default) judges by the engines' profile in the simulator: the
    # daemon is configured with the same one, as an operator sets admission.latency
    admission = dataclasses.replace(sim.cfg.admission, latency=dict(sim.settings.engine.latency_fields(), calibrate=False))
    daemon = Daemon(dataclasses.replace(sim.cfg, tick_interval_s=10.0, admission=admission), clock=clock, seed=SEED)
    port = await daemon.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = router_pb2_grpc.KVRouterStub(channel)
    decisions: dict[str, str] = {}
    waiting: dict[str, asyncio.Task] = {}
    try:
        for engine in sim.engines:
            spec = sim.router.workers.get(engine.worker_id).spec
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                id=spec.id, address=spec.address, capacity_blocks=spec.capacity_blocks,
                mode=pb.CACHE_STATE_MODE_EVENTS)))
        for op, t, payload, _ in sim.log:
            clock.set(t)
            if op == "arrive":
                assert daemon.admission is not None
                task = asyncio.ensure_future(stub.Route(route_message(payload)))
                while not task.done() and payload.request_id not in daemon.admission.queues:
                    await asyncio.sleep(0.001)
                waiting[payload.request_id] = task
            elif op == "route":
                if payload.request_id not in waiting:  # dispatched at once, without a queue
                    decisions[payload.request_id] = (await stub.Route(route_message(payload))).worker_id
            elif op == "shed":
                if payload.request_id not in waiting:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Route(route_message(payload))
                    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
                    decisions[payload.request_id] = "shed"
            elif op == "events":
                await stub.PublishEvents(iter([batch_message(payload)]))
            elif op == "load":
                worker_id, queued, running, kv = payload
                await stub.ReportLoad(pb.ReportLoadRequest(worker_id=worker_id, queued_requests=queued,
                                                           running_requests=running, kv_utilization=kv))
            elif op == "first_token":  # the gateway's prefill_done Complete at the first token
                await stub.Complete(pb.CompleteRequest(request_id=payload.request_id, ttft_ms=payload.ttft_ms,
                                                       prefill_done=True))
            elif op == "complete":
                await stub.Complete(pb.CompleteRequest(
                    request_id=payload.request_id, ttft_ms=payload.ttft_ms, e2e_ms=payload.e2e_ms,
                    cached_tokens=payload.cached_tokens, output_tokens=payload.output_tokens, success=True,
                    session_ended=payload.session_ended))
            else:
                daemon.router.tick()
                if daemon.admission is not None:
                    daemon.admission.tick(clock.now())
        for rid, task in waiting.items():
            decisions[rid] = (await asyncio.wait_for(task, 10.0)).worker_id
    finally:
        await channel.close()
        await daemon.stop(grace=0.2)
    return decisions


def routed(sim: Simulation) -> dict[str, str]:
    assert sim.log is not None
    return {rr.request_id: worker or "shed" for op, _, rr, worker in sim.log if op in ("route", "shed")}


@pytest.mark.parametrize("routing", registry.names("routing"))
async def test_daemon_replaying_the_sim_log_makes_the_same_decisions(routing):
    cfg = parse_config({"listen": "127.0.0.1:0", "tick_interval_s": 0.05, "routing": {"name": routing},
                        "admission": {"deadline": "off"}})  # test_deadline_admission_parity has it on
    wl = gsp(random.Random(SEED), rate=60.0, groups=6, queries_per_group=6, block_tokens=64, lengths=(512, 1024, 2048))
    settings = ClusterSettings(workers=3, engine=EngineParams(capacity_blocks=60), slo_ms=200.0,
                               load_report_interval_s=0.1, signal_session_end=True)
    sim = Simulation(cfg, wl, settings, routing=routing, eviction="lru", seed=SEED, record=True)
    result = sim.run()
    assert sim.log is not None
    ops = {op for op, *_ in sim.log}
    assert {"route", "events", "complete", "tick", "load"} <= ops
    expected = routed(sim)
    assert {f"r{i}": f"w{r.worker}" for i, r in enumerate(result.records)} == expected
    assert await replay(sim) == expected


@pytest.mark.parametrize("routing", ["dualmap", "cache_aware"])
async def test_daemon_with_admission_queues_replaying_the_sim_log_admits_the_same(routing):
    # the daemon's admission queue mode (and DualMap's migration within pairs) against the
    # simulator's use of the same kvrouterd.admission objects: same queueing, same workers
    cfg = parse_config({"listen": "127.0.0.1:0", "tick_interval_s": 0.05, "routing": {"name": routing},
                        "admission": {"max_inflight": 2, "deadline": "off"}})
    wl = gsp(random.Random(SEED), rate=120.0, groups=6, queries_per_group=6, block_tokens=64,
             lengths=(512, 1024, 2048))
    settings = ClusterSettings(workers=3, engine=EngineParams(capacity_blocks=60), slo_ms=200.0,
                               load_report_interval_s=0.1, admission_max_inflight=2)
    sim = Simulation(cfg, wl, settings, routing=routing, eviction="lru", seed=SEED, record=True)
    result = sim.run()
    assert result.counters["admission_queued"] > 0 and result.counters["unfinished"] == 0
    assert sum(op == "arrive" for op, *_ in sim.log) == len(wl.requests)
    expected = routed(sim)
    assert len(expected) == len(wl.requests)
    assert await replay(sim) == expected


@pytest.mark.slow
async def test_daemon_replaying_dualmaps_migrations_moves_the_same_requests():
    # Zipf-hot tool prompts at 80 req/s on 8 workers, at most 16 in flight each: the traffic
    # of the simulator's migration test, where both candidates of hot prefixes overload
    cfg = parse_config({"listen": "127.0.0.1:0", "tick_interval_s": 0.05, "routing": {"name": "dualmap"},
                        "admission": {"max_inflight": 16, "deadline": "off"}})
    wl = build_workload("toolagent", 0, 80.0, requests=600)
    settings = ClusterSettings(workers=8, engine=EngineParams(), slo_ms=5000.0, load_report_interval_s=0.1,
                               admission_max_inflight=16)
    sim = Simulation(cfg, wl, settings, routing="dualmap", eviction="lru", seed=0, record=True)
    result = sim.run()
    assert result.counters["migrations"] > 0 and result.counters["unfinished"] == 0
    expected = routed(sim)
    # a migrated request is answered by the worker it moved to, in the daemon as in the simulator
    assert await replay(sim) == expected


@pytest.mark.parametrize("routing", ["cache_aware", "dualmap", "random"])
async def test_deadline_admission_parity(routing):
    """Deadline admission (on by default) refuses in the daemon exactly what it refuses in
    the simulator, and routes the rest to the same workers: the sheds are replayed too, as a
    shed Route still draws on a policy's state (the random policy's generator)."""
    cfg = parse_config({"listen": "127.0.0.1:0", "tick_interval_s": 0.05, "routing": {"name": routing}})
    assert cfg.admission.deadline == "shed"
    wl = gsp(random.Random(SEED), rate=240.0, groups=6, queries_per_group=6, block_tokens=64, lengths=(512, 1024, 2048))
    settings = ClusterSettings(workers=3, engine=EngineParams(capacity_blocks=60), slo_ms=200.0,
                               load_report_interval_s=0.1, signal_session_end=True)
    sim = Simulation(cfg, wl, settings, routing=routing, eviction="lru", seed=SEED, record=True)
    sim.run()
    expected = routed(sim)
    assert len(expected) == len(wl.requests) and "shed" in expected.values()
    assert any(op == "first_token" for op, *_ in sim.log)  # admission learns TTFTs as they happen
    assert await replay(sim) == expected
