"""A RouteStream batch's Complete applied in one native call is the Complete the Python path applies.

``GatewayCalls._stream_item`` hands a batch's Complete to ``stream_complete`` (``index/_native.c``)
with the batch's ``_complete_plan``: the natives ``convert.completion``, ``LoadLedger._finish``
and ``DeadlineGuard.on_complete`` end in, called in one pass. Two daemons' RouteStream handlers,
one of them without the plan (every Complete through ``_complete``), are fed the same batches:
Routes, and Completes of what they routed, of what they never routed, of what completed already,
with reported latencies that teach deadline admission and ones out of bounds, ending sessions,
prefill hops done, policies that hear their completions, replica sync, and a disaggregated fleet
whose prefill hops, once charged, take every Complete to the Python path. They must write the same answers
byte for byte and keep the same router, ledger and deadline-admission books; and the native pass
must have answered most Completes, so the comparison is not of the Python path with itself.
"""

from __future__ import annotations

import asyncio
import math
import random
from array import array
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.clock import ManualClock
from kvrouterd.config import AdmissionConfig
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, WorkerRole
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server import gateway_calls, stream_wire
from kvrouterd.server.admission import AdmissionGate
from kvrouterd.server.service import MAX_STREAM_BATCH_ITEMS, KVRouterService
from kvrouterd.telemetry.metrics import Metrics
from tests.unit.server.test_stream_wire import _Call
from tests.unit.test_deadline_books import books

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

BS = 16


def _daemon(policy: str, deadline: bool, native_completes: bool, published: list[Any] | None = None,
            disaggregated: bool = False) -> tuple[KVRouterService, Router]:
    clock = ManualClock()
    # T-LRU hears a Complete that ends its session (end-aware eviction), through the Python path
    settings = RouterSettings(block_size=BS, max_id_length=64, routing={"name": policy}, eviction={"name": "tlru"})
    router = Router(settings, clock, random.Random(3))
    for i in range(4):
        # disaggregated: two prefill and two decode workers, so long prompts charge a prefill hop
        role = (WorkerRole.PREFILL if i < 2 else WorkerRole.DECODE) if disaggregated else WorkerRole.BOTH
        router.add_worker(WorkerSpec(id=f"w{i}", address=f"w{i}:1", role=role,
                                     mode=CacheMode.APPROXIMATE if i % 2 else CacheMode.EVENTS))
    service = KVRouterService(router, None, Metrics(MeterProvider(), lambda: len(router.index), lambda: ()), 65536)
    if deadline:
        service.admission = AdmissionGate(router, AdmissionConfig(max_inflight=0, deadline="shed"))
    if not native_completes:
        service._complete_plan = lambda: None  # type: ignore[method-assign]
    if published is not None:  # replica sync: every completion is published, through the Python path
        router.on_completed = published.append
    return service, router


def _batches(seed: int) -> list[bytes]:
    """Sixty batches of Routes and Completes, as a gateway (and a careless one) sends them."""
    rng = random.Random(seed)
    routed: list[str] = []
    done: list[str] = []
    out = []
    for step in range(60):
        items = []
        for n in range(rng.randrange(1, 10)):
            item_id = step * 16 + n
            if routed and rng.random() < 0.45:
                roll = rng.random()
                if roll < 0.05 and done:
                    rid = rng.choice(done)  # completed already
                elif roll < 0.1:
                    rid = f"never-{step}-{n}"
                else:
                    rid = routed.pop(rng.randrange(len(routed)))
                    done.append(rid)
                ttft = rng.choice((0.0, 12.5, 180.0, 2_000.0, -1.0, math.nan))
                complete = pb.CompleteRequest(
                    request_id=rid, ttft_ms=ttft, e2e_ms=rng.choice((0.0, ttft + 400.0, ttft + 0.5, 9e9)),
                    success=rng.random() < 0.85, session_ended=rng.random() < 0.1, prefill_done=rng.random() < 0.08,
                    cached_tokens=rng.choice((-1, 0, 64)), output_tokens=rng.choice((0, 100)),
                )
                items.append(pb.RouteStreamRequest(id=item_id, complete=complete))
            else:
                rid = f"r{step}-{n}"
                tokens = array("I", (rng.randrange(40) for _ in range(rng.choice((BS * 4, BS * 12, 900)))))
                route = pb.RouteStreamRequest(id=item_id, route=pb.RouteRequest(
                    request_id=rid, session_id=f"s{rng.randrange(5)}", token_ids_le32=tokens.tobytes(),
                    ttft_slo_ms=rng.choice((0.0, 0.0, 50.0, 5_000.0))))
                routed.append(rid)
                items.append(route)
        out.append(pb.RouteStreamRequest(id=step, batch=pb.RouteStreamRequestBatch(items=items)).SerializeToString())
    return out


def _state(router: Router, service: KVRouterService) -> tuple[Any, ...]:
    ledger = router._ledger
    gate = service.admission
    return (
        list(ledger.requests), ledger.inflight_bytes, dict(ledger.decisions_by_policy),
        [(w.id, w.inflight_requests, w.pending_prefill_tokens) for w in router.workers],
        sorted(router.speculative._by_request), dict(router.counters), router.prefix_hits,
        books(gate.guard) if gate is not None and gate.guard is not None else None,
        sorted((slot, sid, conv.ended) for slot, convs in router.eviction._convs.items()
               for sid, conv in convs.items()),
    )


def _run(service: KVRouterService, batches: list[bytes], parsed: bool) -> list[bytes]:
    call = _Call()

    async def requests() -> AsyncIterator[Any]:
        for data in batches:
            yield (pb.RouteStreamRequest.FromString(data) if parsed
                   else stream_wire.stream_message(data, MAX_STREAM_BATCH_ITEMS))

    asyncio.run(service.RouteStream(requests(), call))
    return call.replies


@pytest.mark.parametrize("policy, deadline, parsed, synced, disaggregated", [
    ("cache_aware", True, False, False, False), ("cache_aware", False, False, False, False),
    ("cache_aware", True, True, False, False), ("least_loaded", True, False, False, False),
    ("lbgr", True, False, False, False), ("cache_aware", True, False, True, False),
    ("cache_aware", True, False, False, True),
])
def test_a_complete_applied_natively_is_the_one_the_python_path_applies(
        policy: str, deadline: bool, parsed: bool, synced: bool, disaggregated: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    answered = []
    real = gateway_calls._native_stream_complete

    def counted(plan: Any, item_id: int, msg: Any) -> Any:
        out = real(plan, item_id, msg)
        answered.append(out is not NotImplemented)
        return out

    monkeypatch.setattr(gateway_calls, "_native_stream_complete", counted)
    for seed in range(3):
        batches = _batches(seed)
        published: tuple[list[Any], list[Any]] | tuple[None, None] = ([], []) if synced else (None, None)
        (fast, fast_router), (slow, slow_router) = (_daemon(policy, deadline, on, sent, disaggregated)
                                                    for on, sent in zip((True, False), published, strict=True))
        assert _run(fast, batches, parsed) == _run(slow, batches, parsed)
        assert _state(fast_router, fast) == _state(slow_router, slow)
        assert published[0] == published[1] and (not synced or published[0])
        assert fast_router._ledger._hops_charged is disaggregated  # prefill hops were charged
    if policy == "lbgr" or synced:  # it hears its completions / each is published: the Python path's
        assert not any(answered)
    elif disaggregated:  # until the first prefill hop is charged; its release is the Python path's after
        assert any(answered) and not all(answered)
    else:
        assert sum(answered) > 100 and not all(answered)  # most natively, some left to the Python path
