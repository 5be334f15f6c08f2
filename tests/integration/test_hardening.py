"""Hostile calls over real gRPC (issue #16): bounded work per call, precise statuses, no state change."""

from __future__ import annotations

import logging

import grpc
import pytest
from kvrouterd._generated.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvrouterd._generated.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.protocols import EventBatch, Stored
from kvrouterd.server.call_errors import LOG_BURST
from kvrouterd.server.ext_proc import ExtProcService

from .test_daemon import BS, register


@pytest.fixture
def daemon_config() -> dict:
    return {"limits": {"max_evict_blocks": 100, "max_evict_pinned": 1000}, "extra_routing": [{"name": "dualmap"}, {"name": "min_ttft"}],
            "ext_proc": {"enabled": True}}


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


class Boom(RuntimeError):
    """What a handler bug raises in these tests."""


def _explode(*_args, **_kwargs):  # type: ignore[no-untyped-def]
    raise Boom("a bug, not the caller's fault")


async def _call(running, rpc: str):  # type: ignore[no-untyped-def]
    stub = running.stub
    if rpc == "Route":
        await stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS))))
    elif rpc == "GetStats":
        await stub.GetStats(pb.GetStatsRequest())
    elif rpc == "ExportIndex":
        async for _ in stub.ExportIndex(pb.ExportIndexRequest()):
            pass
    elif rpc == "PublishEvents":
        await stub.PublishEvents(iter([pb.EventBatch(worker_id="a", sequence=0)]))
    elif rpc == "Process":
        async for _ in ep_grpc.ExternalProcessorStub(running.channel).Process(iter([ep.ProcessingRequest()])):
            pass


#: rpc -> (object, attribute) whose call the test makes raise
_BUGS = {"Route": ("router", "decide"), "GetStats": ("router class", "indexed_blocks"), "ExportIndex": ("router", "export_steps"),
         "PublishEvents": ("router", "apply"), "Process": ("ext_proc", "_on_message")}


@pytest.mark.parametrize("rpc", list(_BUGS))
async def test_an_unexpected_exception_is_internal_counted_and_logged_once_with_its_traceback(running, rpc, monkeypatch, caplog):
    """Issue #28 item 5: every handler bug was a bare UNKNOWN with no log line of ours."""
    await register(running.stub, "a")
    owner, name = _BUGS[rpc]
    if owner == "router":
        monkeypatch.setattr(running.router, name, _explode)
    elif owner == "router class":  # a property
        monkeypatch.setattr(type(running.router), name, property(_explode))
    else:
        monkeypatch.setattr(ExtProcService, name, _explode)
    caplog.set_level(logging.INFO)
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _call(running, rpc)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value
        assert "Boom" in err.value.details() and len(err.value.details()) < 200
    assert running.daemon.service.call_errors.internal_count(rpc) == 3
    ours = [r for r in caplog.records if r.name.startswith("kvrouterd") and r.levelno >= logging.ERROR]
    assert len(ours) == 3 and all(r.exc_info and r.exc_info[0] is Boom for r in ours), ours
    assert not [r for r in caplog.records if r.name.startswith("grpc")]  # not logged twice


async def test_internal_errors_are_logged_rate_limited(running, monkeypatch, caplog):
    await register(running.stub, "a")
    monkeypatch.setattr(running.router, "decide", _explode)  # every Route decides
    caplog.set_level(logging.INFO)
    for _ in range(LOG_BURST + 20):
        with pytest.raises(grpc.aio.AioRpcError):
            await _call(running, "Route")
    assert running.daemon.service.call_errors.internal_count("Route") == LOG_BURST + 20
    assert len([r for r in caplog.records if r.name.startswith("kvrouterd") and r.exc_info]) == LOG_BURST


async def test_rejections_are_counted_and_logged_sampled(running, caplog):
    """Issue #28 item 9: every rejected call was an INFO line (~500 B), unbounded."""
    # the ledger's own logger: a daemon an earlier test configured may have left it at WARNING
    caplog.set_level(logging.INFO, logger="kvrouterd.server")
    ledger = running.daemon.service.call_errors
    # one sampling interval for the whole test: on a loaded machine 300 calls can outlast its
    # 10 s, and the daemon's maintenance tick would then summarise and start a second burst
    ledger._rejections.clock = lambda: 0.0
    for i in range(300):
        with pytest.raises(grpc.aio.AioRpcError):
            await running.stub.Route(pb.RouteRequest(request_id=f"r{i}"))  # no prompt
    call = running.stub.RouteStream()
    for i in range(50):
        await call.write(pb.RouteStreamRequest(id=i, complete=pb.CompleteRequest(request_id=f"never-{i}")))
        assert (await call.read()).error.code == grpc.StatusCode.NOT_FOUND.value[0]
    await call.done_writing()
    assert ledger.rejected_count("Route", "INVALID_ARGUMENT") == 300
    assert ledger.rejected_count("RouteStream", "NOT_FOUND") == 50
    lines = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 2 * LOG_BURST, [r.getMessage() for r in lines]
    ledger.flush(now=float("inf"))  # the interval is over: one summary per key
    summaries = [r.getMessage() for r in caplog.records if "suppressed" in r.getMessage()]
    assert sorted(summaries) == sorted([f"Route INVALID_ARGUMENT: suppressed {300 - LOG_BURST} more rejections",
                                        f"RouteStream NOT_FOUND: suppressed {50 - LOG_BURST} more rejections"])
