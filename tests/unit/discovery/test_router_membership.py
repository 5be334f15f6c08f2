"""Discovery driving a real Router: the specs it builds are ones the Router accepts, and pod
lifecycle turns into worker membership with the index following (a recreated pod's blocks go)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

from kvrouterd.clock import ManualClock
from kvrouterd.discovery import KubernetesDiscovery, KubernetesDiscoveryConfig
from kvrouterd.index.keys import block_keys
from kvrouterd.protocols import CacheMode, EventBatch, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings

from .fake_kube import FakeKubeApi, event, eventually, pod, pod_list


async def test_pods_become_router_workers_and_a_recreated_pod_loses_its_blocks(tmp_path: Path) -> None:
    fake = FakeKubeApi(lists=[pod_list([pod("vllm-0", "10.0.0.1", uid="u0"), pod("vllm-1", "10.0.0.2")], rv="1")])
    url = await fake.start()
    watch = fake.watch()
    router = Router(RouterSettings(block_size=16), ManualClock(), random.Random(0))
    cfg = KubernetesDiscoveryConfig(enabled=True, namespace="llm", label_selector="app=vllm", port="http",
                                    kv_events_port="kv-events", capacity_blocks=1000, api_server=url,
                                    token_file=str(tmp_path / "token"))
    disc = KubernetesDiscovery(cfg, router.add_worker, router.remove_worker, block_size=16)
    task = asyncio.create_task(disc.run())
    try:
        await asyncio.wait_for(disc.synced.wait(), 5)
        assert sorted(w.id for w in router.workers) == ["vllm-0", "vllm-1"]
        w0 = router.workers.get("vllm-0")
        assert w0.spec.mode is CacheMode.EVENTS and w0.spec.address == "10.0.0.1:8000"

        tokens = tuple(range(64))
        router.apply(EventBatch("vllm-0", 0, (Stored(tokens, None),)))
        assert router.index.count(w0.slot) == 4
        keys = block_keys(tokens, 16)
        decision = router.route(RouteRequest("r1", keys, len(tokens))).decision
        assert decision.worker_id == "vllm-0" and decision.overlap_blocks == 4

        # the StatefulSet recreates vllm-0: same name, new pod, empty cache
        await watch.put(event("ADDED", pod("vllm-0", "10.0.0.9", uid="u1", rv="2")))
        await eventually(lambda: router.workers.get("vllm-0").spec.address == "10.0.0.9:8000")
        assert router.index.count(router.workers.get("vllm-0").slot) == 0

        # vllm-1 fails its readiness probe: no more traffic
        await watch.put(event("MODIFIED", pod("vllm-1", "10.0.0.2", ready=False, rv="3")))
        await eventually(lambda: router.workers.find("vllm-1") is None)
        assert [w.id for w in router.workers] == ["vllm-0"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await fake.stop()
