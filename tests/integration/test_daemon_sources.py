"""The daemon wired to its membership and event sources: Kubernetes discovery and ZMQ engines.

A fake engine on real ZMQ sockets and a fake Kubernetes API server stand in for the cluster;
everything else is the real daemon on port 0, driven over gRPC.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon
from tests.integration.test_zmq_events import BS, FakeEngine, tokens
from tests.unit.discovery.fake_kube import FakeKubeApi, event, pod, pod_list

import grpc


async def eventually(cond, timeout=5.0):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_a_registered_engine_publishing_over_zmq_attracts_its_prefix():
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx)
    # the engine publishes on loopback, the workers' addresses name other hosts: allow the network
    cfg = parse_config({"listen": "127.0.0.1:0", "block_size": BS,
                        "events": {"topic": "kv@", "replay_timeout_s": 0.5, "allowed_endpoints": ["127.0.0.0/8"]}})
    daemon = Daemon(cfg)
    port = await daemon.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.KVRouterStub(ch)
            for wid, endpoint in (("cold", ""), ("hot", f"{engine.endpoint}?replay={engine.replay_endpoint}")):
                await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                    id=wid, address=f"{wid}:8000", mode=pb.CACHE_STATE_MODE_EVENTS, kv_events_endpoint=endpoint)))
            assert set(daemon.events.subscribers) == {"hot"}
            await engine.wait_subscribed()
            await engine.publish(engine.stored([11, 12, 13], tokens(0, 3)))
            await eventually(lambda: daemon.router.index.count(daemon.router.workers.get("hot").slot) == 3)
            resp = await stub.Route(pb.RouteRequest(token_ids=tokens(0, 5)))
            assert resp.worker_id == "hot" and resp.matched_blocks == 3
            await engine.publish(engine.removed([13]))
            await eventually(lambda: daemon.router.index.count(daemon.router.workers.get("hot").slot) == 2)
            # deregistering stops the subscription
            await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="hot"))
            assert daemon.events.subscribers == {}
    finally:
        await daemon.stop(0)
        await engine.close()
        ctx.term()


async def test_discovered_pods_become_workers_before_serving_and_follow_the_cluster(tmp_path: Path):
    api = FakeKubeApi()
    await api.start()
    token = tmp_path / "token"
    token.write_text("t\n")
    api.lists.append(pod_list([pod("vllm-0", "10.0.0.1"), pod("vllm-1", "10.0.0.2", ready=False)], rv="5"))
    watch = api.watch()
    cfg = parse_config({"listen": "127.0.0.1:0", "discovery": {"kubernetes": {
        "enabled": True, "namespace": "llm", "label_selector": "app=vllm", "port": "http",
        "api_server": f"http://127.0.0.1:{api.port}", "token_file": str(token),
        "backoff_initial_s": 0.01, "backoff_max_s": 0.05}}})
    daemon = Daemon(cfg)
    try:
        await daemon.start()
        # the first listing is applied before start() returns (and before SERVING)
        assert [w.id for w in daemon.router.workers] == ["vllm-0"]
        assert daemon.router.workers.get("vllm-0").address == "10.0.0.1:8000"
        await watch.put(event("MODIFIED", pod("vllm-1", "10.0.0.2", rv="6")))
        await eventually(lambda: "vllm-1" in daemon.router.workers)
        await watch.put(event("DELETED", pod("vllm-0", "10.0.0.1", rv="7")))
        await eventually(lambda: "vllm-0" not in daemon.router.workers)
    finally:
        await daemon.stop(0)
        await api.stop()


async def test_rejected_engine_events_show_in_list_workers_get_stats_and_metrics():
    """Issue #11 item 4: what the router could not apply is visible where operators look."""
    from tests.integration.engine_wire import VLLM_026
    from tests.integration.test_metrics_endpoint import _get, sample

    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx)
    cfg = parse_config({"listen": "127.0.0.1:0", "block_size": BS, "metrics": {"listen": "127.0.0.1:0"},
                        "events": {"topic": "kv@", "replay_timeout_s": 0.5}})
    daemon = Daemon(cfg)
    port = await daemon.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.KVRouterStub(ch)
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                id="gpu", address="127.0.0.1:8000", mode=pb.CACHE_STATE_MODE_EVENTS, kv_events_endpoint=engine.endpoint)))
            await engine.wait_subscribed()
            wire = VLLM_026
            for _ in range(3):  # a stream of stores the router cannot key: token pairs
                await engine.publish(raw=wire.batch(wire.stored([7], [[1, 2]] * BS, page=BS)))
            await eventually(lambda: daemon.events.subscribers["gpu"].stats.last_sequence == 2)
            listed = (await stub.ListWorkers(pb.ListWorkersRequest())).workers[0]
            assert dict(listed.events_rejected) == {"malformed_stored": 3}
            assert listed.state == pb.WORKER_STATE_DEGRADED and listed.state_reason == "stored events rejected"
            stats = await stub.GetStats(pb.GetStatsRequest())
            assert dict(stats.events_rejected) == {"malformed_stored": 3}
            _, _, text = await asyncio.to_thread(_get, daemon.metrics_endpoint.port)
            assert sample(text, "kvrouter_worker_events_rejected_total", worker="gpu", reason="malformed_stored") == 3
    finally:
        await daemon.stop(0)
        await engine.close()
        ctx.term()
