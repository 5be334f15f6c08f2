"""Hostile calls over real gRPC (issue #16): bounded work per call, precise statuses, no state change."""

from __future__ import annotations

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.protocols import EventBatch, Stored

from .test_daemon import BS, register


@pytest.fixture
def daemon_config() -> dict:
    return {"limits": {"max_evict_blocks": 100, "max_evict_pinned": 1000}, "extra_routing": [{"name": "dualmap"}, {"name": "min_ttft"}]}


async def test_evict_hint_for_four_billion_blocks_answers_the_cap(running):
    await register(running.stub, "big")
    for c in range(30):
        tokens = list(range(c * 10_000, c * 10_000 + 10 * BS))
        running.router.apply(EventBatch("big", c, (Stored(token_ids=tokens, engine_hashes=None),)))
    resp = await running.stub.EvictHint(pb.EvictHintRequest(worker_id="big", blocks=4294967295))
    assert len(resp.keys) == 100 and not resp.exhausted
    resp = await running.stub.EvictHint(pb.EvictHintRequest(worker_id="big", tokens=4294967295))
    assert len(resp.keys) == 100 and not resp.exhausted
    # the index is untouched: a hint only advises
    assert running.router.index.count(running.router.workers.get("big").slot) == 300
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.EvictHint(pb.EvictHintRequest(worker_id="nobody", blocks=4294967295))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("policy", ["lru", "tlru", "unicache"])
async def test_evict_hint_pinning_more_than_the_cap_is_resource_exhausted_and_ranks_nothing(running, policy):
    await register(running.stub, "big")
    tokens = list(range(10 * BS))
    running.router.apply(EventBatch("big", 0, (Stored(token_ids=tokens, engine_hashes=tuple(range(1, 11))),)))
    before = dict(running.router._engine_hashes.by_slot), running.router.index.count(running.router.workers.get("big").slot)
    over = pb.EvictHintRequest(worker_id="big", blocks=5, pinned_keys=range(600),
                               pinned_engine_hashes=[1, 2, 3, *range(1000, 1398)],
                               policy=policy if policy != "lru" else "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.EvictHint(over)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "600 pinned_keys and 401 pinned_engine_hashes exceed limits.max_evict_pinned=1000"
    # nothing ranked: the reverse engine-hash map a first hint builds is not there
    assert (dict(running.router._engine_hashes.by_slot), running.router.index.count(running.router.workers.get("big").slot)) == before
    # at the cap the hint is answered, pins honoured (engine hashes 1-3 are the first blocks)
    del over.pinned_engine_hashes[-1]
    resp = await running.stub.EvictHint(over)
    assert len(resp.keys) == 5 and not set(resp.engine_hashes) & {1, 2, 3}


@pytest.mark.parametrize("slo", [float("inf"), float("nan"), 1e308, -1.0])
@pytest.mark.parametrize("policy", ["dualmap", "min_ttft", "cache_aware"])
async def test_every_policy_rejects_the_same_unusable_ttft_slo(running, policy, slo):
    await register(running.stub, "a")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), ttft_slo_ms=slo, policy=policy))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert running.router.workers.get("a").inflight_requests == 0 and running.router.workers.inflight_count == 0


# ---- item 2: the daemon dials only what events.allowed_endpoints allows ----------------------

def _snapshot(running) -> tuple:  # type: ignore[no-untyped-def]
    r = running.router
    subs = tuple(sorted(running.daemon.events.subscribers)) if running.daemon.events is not None else ()
    return (tuple((w.id, w.spec, w.state) for w in r.workers), len(r.index), r.workers.inflight_count,
            r.inflight_bytes, subs)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://169.254.169.254:80",                      # another host than the worker's address
        "tcp://10.0.0.5:5557?replay=tcp://10.0.0.9:5558",  # the replay endpoint on another host
        "ipc:///tmp/kvrouterd-engine.sock",               # a file on the daemon's machine
        "inproc://events",
    ],
)
async def test_register_worker_with_an_endpoint_outside_the_allow_list_is_permission_denied(running, endpoint):
    before = _snapshot(running)
    worker = pb.Worker(id="w", address="10.0.0.5:8000", mode=pb.CACHE_STATE_MODE_EVENTS, kv_events_endpoint=endpoint)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=worker))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "events.allowed_endpoints" in err.value.details()
    assert _snapshot(running) == before
    # the worker's own host is allowed by default
    worker.kv_events_endpoint = "tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:5558"
    await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=worker))
    assert running.daemon.events is not None and "w" in running.daemon.events.subscribers


async def test_a_malformed_endpoint_is_invalid_argument_and_registers_nothing(running):
    """Issue #16 item 2: ``tcp://127.0.0.1?dp_rank=1`` answered UNKNOWN after registering the worker."""
    before = _snapshot(running)
    worker = pb.Worker(id="w", address="127.0.0.1:8000", kv_events_endpoint="tcp://127.0.0.1?dp_rank=1")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=worker))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _snapshot(running) == before


async def test_a_discovered_pod_outside_the_allow_list_is_not_routed_to(running):
    """Kubernetes discovery goes through the same check (here the daemon's own callback)."""
    from kvrouterd.index.workers import WorkerSpec
    from kvrouterd.protocols import CacheMode

    before = _snapshot(running)
    running.daemon._discovered(WorkerSpec("pod-a", "10.1.0.7:8000", mode=CacheMode.EVENTS,
                                          kv_events_endpoint="tcp://10.1.0.8:5557"))
    assert _snapshot(running) == before
    running.daemon._discovered(WorkerSpec("pod-b", "10.1.0.7:8000", mode=CacheMode.EVENTS,
                                          kv_events_endpoint="tcp://10.1.0.7:5557"))
    assert "pod-b" in running.router.workers and "pod-b" in running.daemon.events.subscribers
