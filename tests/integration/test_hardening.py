"""Hostile calls over real gRPC (issue #16): bounded work per call, precise statuses, no state change."""

from __future__ import annotations

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.protocols import EventBatch, Stored

from .test_daemon import BS, register


@pytest.fixture
def daemon_config() -> dict:
    return {"limits": {"max_evict_blocks": 100}, "extra_routing": [{"name": "dualmap"}, {"name": "min_ttft"}]}


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


@pytest.mark.parametrize("slo", [float("inf"), float("nan"), 1e308, -1.0])
@pytest.mark.parametrize("policy", ["dualmap", "min_ttft", "cache_aware"])
async def test_every_policy_rejects_the_same_unusable_ttft_slo(running, policy, slo):
    await register(running.stub, "a")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS)), ttft_slo_ms=slo, policy=policy))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert running.router.workers.get("a").inflight_requests == 0 and running.router.workers.inflight_count == 0
