"""Parity: one request/event log, replayed through the gRPC daemon, gives the simulator's decisions.

The simulator records every call it makes into its Router (routes, event batches,
completions, load reports, maintenance ticks). The log is replayed into a real ``Daemon`` on 127.0.0.1:0
over grpc.aio (Route, PublishEvents, ReportLoad, Complete), with a manual clock set to each call's
simulated time and the same seed. The daemon's own maintenance loop is kept out of the way
with a 10 s tick interval (the test ends first); the recorded ticks (every 50 ms of simulated
time) are replayed by calling its router's ``tick`` as that loop would. Same config, same registry, same decisions.
"""

from __future__ import annotations

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
from kvrouterd.sim.workloads import gsp

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


async def replay(sim: Simulation) -> list[str]:
    assert sim.log is not None
    clock = ManualClock()
    # the daemon's wall-clock maintenance loop must not fire mid-replay: the recorded ticks stand in for it
    daemon = Daemon(dataclasses.replace(sim.cfg, tick_interval_s=10.0), clock=clock, seed=SEED)
    port = await daemon.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = router_pb2_grpc.KVRouterStub(channel)
    decisions = []
    try:
        for engine in sim.engines:
            spec = sim.router.workers.get(engine.worker_id).spec
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                id=spec.id, address=spec.address, capacity_blocks=spec.capacity_blocks,
                mode=pb.CACHE_STATE_MODE_EVENTS)))
        for op, t, payload, _ in sim.log:
            clock.set(t)
            if op == "route":
                resp = await stub.Route(pb.RouteRequest(
                    request_id=payload.request_id, block_keys=payload.keys, prompt_tokens=payload.prompt_tokens,
                    session_id=payload.session_id, task=int(payload.task), ttft_slo_ms=payload.ttft_slo_ms,
                    expected_output_tokens=payload.expected_output_tokens))
                decisions.append(resp.worker_id)
            elif op == "events":
                await stub.PublishEvents(iter([batch_message(payload)]))
            elif op == "load":
                worker_id, queued, running, kv = payload
                await stub.ReportLoad(pb.ReportLoadRequest(worker_id=worker_id, queued_requests=queued,
                                                           running_requests=running, kv_utilization=kv))
            elif op == "complete":
                await stub.Complete(pb.CompleteRequest(
                    request_id=payload.request_id, ttft_ms=payload.ttft_ms, e2e_ms=payload.e2e_ms,
                    cached_tokens=payload.cached_tokens, output_tokens=payload.output_tokens, success=True,
                    session_ended=payload.session_ended))
            else:
                daemon.router.tick()
    finally:
        await channel.close()
        await daemon.stop(grace=0.2)
    return decisions


@pytest.mark.parametrize("routing", registry.names("routing"))
async def test_daemon_replaying_the_sim_log_makes_the_same_decisions(routing):
    cfg = parse_config({"listen": "127.0.0.1:0", "tick_interval_s": 0.05, "routing": {"name": routing}})
    wl = gsp(random.Random(SEED), rate=60.0, groups=6, queries_per_group=6, block_tokens=64, lengths=(512, 1024, 2048))
    settings = ClusterSettings(workers=3, engine=EngineParams(capacity_blocks=60), slo_ms=200.0,
                               load_report_interval_s=0.1, signal_session_end=True)
    sim = Simulation(cfg, wl, settings, routing=routing, eviction="lru", seed=SEED, record=True)
    result = sim.run()
    assert sim.log is not None
    ops = {op for op, *_ in sim.log}
    assert {"route", "events", "complete", "tick", "load"} <= ops
    expected = [worker for op, _, _, worker in sim.log if op == "route"]
    assert [result.records[i].worker for i in range(len(expected))] == [int(w[1:]) for w in expected]
    assert await replay(sim) == expected
