"""DualMap and LBGR selected by config, driven end to end through the gRPC daemon."""

from __future__ import annotations

import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

BS = 16


@pytest.fixture(params=["dualmap", "lbgr"])
def daemon_config(request):
    return {"routing": {"name": request.param}, "extra_routing": [{"name": "cache_aware"}]}


async def test_configured_paper_policy_routes_completes_and_traces(running, daemon_config):
    policy = daemon_config["routing"]["name"]
    stub = running.stub
    for i in range(4):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
            id=f"w{i}", address=f"10.0.0.{i}:8000", capacity_blocks=10_000, mode=pb.CACHE_STATE_MODE_APPROXIMATE)))
    system = list(range(100_000, 100_000 + 64 * BS))  # a shared 1,024-token system prompt
    chosen = []
    for turn in range(12):
        resp = await stub.Route(pb.RouteRequest(token_ids=system + list(range(turn * 1000, turn * 1000 + 4 * BS)),
                                                session_id=f"s{turn % 3}", ttft_slo_ms=5000))
        assert resp.policy == policy and resp.reason
        chosen.append(resp.worker_id)
        await stub.Complete(pb.CompleteRequest(request_id=resp.request_id, ttft_ms=80.0, e2e_ms=400.0, success=True))
    # the shared prefix is reused after the first request
    assert any(c == chosen[0] for c in chosen[1:])
    if policy == "dualmap":
        # every request of one prefix stays within its candidate pair
        assert len(set(chosen)) <= 2
    workers = (await stub.ListWorkers(pb.ListWorkersRequest())).workers
    assert all(w.inflight_requests == 0 for w in workers)
    spans = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
    assert len(spans) == 12 and all(s.attributes["kvrouter.policy"] == policy for s in spans)
    terms = [k for k in spans[-1].attributes if k.startswith("kvrouter.candidates.term.")]
    assert terms, "the policy's own cost terms are on the span"
    # a request may still name another configured policy
    other = await stub.Route(pb.RouteRequest(token_ids=system, policy="cache_aware"))
    assert other.policy == "cache_aware"
