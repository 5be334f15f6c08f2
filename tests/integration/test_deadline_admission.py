"""Deadline admission over gRPC: a Route that cannot meet its TTFT SLO is shed with a clear status."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

BS = 16


# 1 ms per prefill token, fixed: a 3,200-token prompt takes 3.2 s
LATENCY = {"prefill_ms_per_1k_tokens": 1000.0, "calibrate": False}


@pytest.fixture
def daemon_config():
    return {"admission": {"deadline": "shed", "latency": LATENCY}, "default_ttft_slo_ms": 5000.0}


def prompt(first: int, tokens: int = 3_200) -> list[int]:
    return list(range(first, first + tokens))


async def test_a_route_that_would_miss_its_slo_everywhere_is_shed(running):
    stub = running.stub
    await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="a:1", mode=pb.CACHE_STATE_MODE_EVENTS)))
    first = await stub.Route(pb.RouteRequest(token_ids=prompt(0)))  # 3.2 s: admitted
    assert first.worker_id == "a"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Route(pb.RouteRequest(token_ids=prompt(10_000), request_id="late", ttft_slo_ms=5_000))  # 6.4 s > 5 s
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # 6,400 ms less what the first prompt's prefill drained on the wall clock meanwhile
    found = re.search(r"predicted TTFT 6,(\d{3}) ms .* 5,000 ms SLO; retry after 1,(\d{3}) ms", err.value.details())
    assert found is not None and int(found[1]) > 200, err.value.details()
    assert dict(err.value.trailing_metadata())["retry-after-ms"] == f"1{found[2]}"
    assert running.router.request("late") is None
    assert running.daemon.admission.guard.shed == 1
    # a request with a looser SLO of its own is admitted
    loose = await stub.Route(pb.RouteRequest(token_ids=prompt(20_000), ttft_slo_ms=8_000))
    assert loose.worker_id == "a"
    # and once the first completes, the fleet takes tight requests again
    await stub.Complete(pb.CompleteRequest(request_id=first.request_id, success=True, ttft_ms=3_200))
    await stub.Complete(pb.CompleteRequest(request_id=loose.request_id, success=True, ttft_ms=6_400))
    assert (await stub.Route(pb.RouteRequest(token_ids=prompt(30_000)))).worker_id == "a"


@pytest.mark.parametrize("daemon_config", [
    {"admission": {"deadline": "shed", "latency": LATENCY}, "default_ttft_slo_ms": 5000.0},
    {"admission": {"deadline": "shed", "latency": LATENCY, "shed_without_slo": True}, "default_ttft_slo_ms": 5000.0},
], ids=["spared", "shed_without_slo"])
async def test_a_route_without_its_own_slo_is_refused_only_when_configured(running, daemon_config):
    """A caller that set no ``ttft_slo_ms`` never asked for a deadline: it is steered by the
    default SLO but refused by it only with ``admission.shed_without_slo``."""
    stub = running.stub
    await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="a:1", mode=pb.CACHE_STATE_MODE_EVENTS)))
    await stub.Route(pb.RouteRequest(token_ids=prompt(0)))
    late = pb.RouteRequest(token_ids=prompt(10_000), request_id="undeclared")  # 6.4 s > the 5 s default
    guard = running.daemon.admission.guard
    if daemon_config["admission"].get("shed_without_slo"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Route(late)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert running.router.request("undeclared") is None and (guard.shed, guard.spared) == (1, 0)
    else:
        assert (await stub.Route(late)).worker_id == "a"
        assert running.router.request("undeclared") is not None and (guard.shed, guard.spared) == (0, 1)


async def test_a_first_token_report_teaches_admission_before_the_request_ends(running):
    """A ``prefill_done`` Complete with ``ttft_ms`` on a request without a prefill hop: no
    error, deadline admission learns the TTFT at once, and the request stays in flight (its
    load counted) until its own Complete."""
    stub = running.stub
    await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="a:1", mode=pb.CACHE_STATE_MODE_EVENTS)))
    guard = running.daemon.admission.guard
    routed = await stub.Route(pb.RouteRequest(token_ids=prompt(0), ttft_slo_ms=5_000))
    before = guard.scale
    await stub.Complete(pb.CompleteRequest(request_id=routed.request_id, ttft_ms=9_600, prefill_done=True))
    assert guard.scale > before * 1.05  # observed 3x the modelled 3.2 s
    assert running.router.request(routed.request_id) is not None
    learned = guard.scale
    await stub.Complete(pb.CompleteRequest(request_id=routed.request_id, success=True, ttft_ms=9_600))
    assert running.router.request(routed.request_id) is None and guard.scale == learned


@pytest.mark.parametrize("daemon_config", [
    {"admission": {"deadline": "shed", "latency": LATENCY}, "default_ttft_slo_ms": 5000.0,
     "limits": {"inflight_timeout_s": 0.2}},
])
async def test_requests_released_unheard_leave_deadline_admissions_books(running, daemon_config):
    """Routes whose Complete never comes are released after ``inflight_timeout_s``; deadline
    admission forgets them then, so nothing of theirs lingers, not even where a later request
    reuses an id on another worker."""
    stub = running.stub
    for wid in ("a", "b"):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id=wid, address=f"{wid}:1",
                                                                            mode=pb.CACHE_STATE_MODE_EVENTS)))
    for i in range(3):
        await stub.Route(pb.RouteRequest(token_ids=prompt(1_000 * i, 320), request_id=f"lost-{i}",
                                         candidate_workers=["a"]))
    guard = running.daemon.admission.guard
    assert set(guard._where) == {"lost-0", "lost-1", "lost-2"}
    while running.router.workers.inflight_count:  # the maintenance tick expires them, about once a second
        await asyncio.sleep(0.05)
    await stub.Route(pb.RouteRequest(token_ids=prompt(9_000, 320), request_id="lost-0", candidate_workers=["b"]))
    await stub.Complete(pb.CompleteRequest(request_id="lost-0", success=True))
    assert not guard._where and not guard._predicted and not guard._judged
    assert all(not flight for flight in guard._flight.values())
