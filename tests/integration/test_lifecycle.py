"""Daemon life cycle: config hot reload (call, file watch, SIGHUP) and graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import load_config
from kvrouterd.server.app import Daemon

from .test_daemon import BS, publish, register, stored

BASE = {
    "listen": "127.0.0.1:0",
    "routing": {"name": "cache_aware", "match_rule": "threshold", "cache_threshold": 0.5},
    "extra_routing": [{"name": "round_robin"}],
}


def write(path, doc: dict) -> None:
    # write-then-rename, as a ConfigMap update does; the watcher compares stat results
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


async def start(path, **cfg) -> tuple[Daemon, grpc.aio.Channel]:
    write(path, {**BASE, **cfg})
    daemon = Daemon(load_config(path, environ={}), config_path=str(path), seed=3)
    daemon.reloader.environ = {}
    port = await daemon.start()
    return daemon, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def quarter_cached_route(stub) -> pb.RouteResponse:
    """Worker a holds 2 of the prompt's 8 blocks: a 25% match."""
    prompt = list(range(700, 700 + 8 * BS))
    resp = await stub.Route(pb.RouteRequest(token_ids=prompt))
    await stub.Complete(pb.CompleteRequest(request_id=resp.request_id, success=True))
    return resp


async def test_reload_swaps_only_changed_policy_parameters(tmp_path):
    path = tmp_path / "kvrouterd.yaml"
    daemon, channel = await start(path, reload_interval_s=0)
    try:
        stub = router_pb2_grpc.KVRouterStub(channel)
        for wid in ("a", "b"):
            await register(stub, wid)
        await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(list(range(700, 700 + 2 * BS)), [1, 2])]))
        assert (await quarter_cached_route(stub)).reason != "prefix_match"  # 25% < 50%
        round_robin = daemon.router.routing_policies["round_robin"]

        write(path, {**BASE, "routing": {"name": "cache_aware", "match_rule": "threshold", "cache_threshold": 0.2}})
        assert daemon.reloader.reload() == ["cache_aware"]
        resp = await quarter_cached_route(stub)
        assert resp.reason == "prefix_match" and resp.worker_id == "a"
        assert daemon.router.routing_policies["round_robin"] is round_robin  # unchanged: kept with its state

        # a bad value changes nothing; sections that need a restart are left alone
        write(path, {**BASE, "routing": {"name": "cache_aware", "match_rule": "threshold", "cache_threshold": 7}})
        assert daemon.reloader.reload() == [] and daemon.reloader.rejected == 1
        assert daemon.router.routing_policy().params.cache_threshold == 0.2
        write(path, {**BASE, "listen": "127.0.0.1:1", "block_size": 32,
                     "routing": {"name": "least_loaded"}})
        assert daemon.reloader.reload() == ["least_loaded"]
        assert daemon.router.default_routing == "least_loaded"
        assert daemon.router.block_size == 16 and daemon.reloader.config.listen == "127.0.0.1:0"
        assert (await stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS))))).policy == "least_loaded"
    finally:
        await channel.close()
        await daemon.stop(grace=0.1)


async def test_file_watch_and_sighup_reload(tmp_path):
    path = tmp_path / "kvrouterd.yaml"
    write(path, {**BASE, "reload_interval_s": 0.05})
    daemon = Daemon(load_config(path, environ={}), config_path=str(path))
    daemon.reloader.environ = {}
    task = asyncio.create_task(daemon.run_until_signal(grace=0.1))
    try:
        while daemon.server is None:  # signal handlers are installed before start
            await asyncio.sleep(0.01)
        write(path, {**BASE, "reload_interval_s": 0.05, "routing": {"name": "cache_aware", "match_rule": "threshold", "cache_threshold": 0.9}})
        for _ in range(200):
            if daemon.router.routing_policy().params.cache_threshold == 0.9:
                break
            await asyncio.sleep(0.02)
        assert daemon.router.routing_policy().params.cache_threshold == 0.9

        # SIGHUP reloads at once, whatever the watch interval
        write(path, {**BASE, "reload_interval_s": 1000, "routing": {"name": "cache_aware", "match_rule": "threshold", "cache_threshold": 0.1}})
        applied = daemon.reloader.applied
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(200):
            if daemon.reloader.applied > applied:
                break
            await asyncio.sleep(0.01)
        assert daemon.router.routing_policy().params.cache_threshold == 0.1
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 10)


async def test_graceful_stop_drains_open_streams_and_refuses_new_calls(tmp_path):
    daemon, channel = await start(tmp_path / "kvrouterd.yaml", reload_interval_s=0)
    stub = router_pb2_grpc.KVRouterStub(channel)
    await register(stub, "a")
    queue: asyncio.Queue[pb.EventBatch | None] = asyncio.Queue()

    async def batches():
        while (b := await queue.get()) is not None:
            yield b

    async def call() -> pb.PublishEventsResponse:
        return await stub.PublishEvents(batches())

    stream = asyncio.create_task(call())
    await queue.put(pb.EventBatch(worker_id="a", sequence=0, events=[stored(list(range(BS)), [1])]))
    while len(daemon.router.index) < 1:
        await asyncio.sleep(0.01)

    stopping = asyncio.create_task(daemon.stop(grace=5.0))
    health = health_pb2_grpc.HealthStub(channel)
    await asyncio.sleep(0.1)
    assert not stopping.done()  # held open by the in-flight stream
    # new calls are refused while the open stream drains
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    # the in-flight stream keeps working until its client finishes it
    await queue.put(pb.EventBatch(worker_id="a", sequence=1, events=[stored(list(range(BS, 2 * BS)), [2], parent=1)]))
    await queue.put(None)
    summary = await asyncio.wait_for(stream, 5)
    assert summary.batches_applied == 2 and summary.blocks_stored == 2
    await asyncio.wait_for(stopping, 5)
    assert len(daemon.router.index) == 2
    await channel.close()
