"""AdmissionGate: queued Routes wait, migrate on double overload, and dispatch where they land."""

from __future__ import annotations

import asyncio
import dataclasses
import random

from kvrouterd.clock import ManualClock
from kvrouterd.config import AdmissionConfig
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.base import RoutingContext, RoutingPolicyBase
from kvrouterd.protocols import CacheMode, Completion, Decision, Dispatch, RouteRequest
from kvrouterd.router import Router, RouterSettings, prefill_hop_id
from kvrouterd.server.admission import AdmissionGate


@dataclasses.dataclass(frozen=True)
class PairParams:
    pass


class FixedPair(RoutingPolicyBase):
    """A test double: the session id names "primary,alternative"; always both overloaded.

    Not registered (the registry is global); installed into one router only."""

    name = "test_fixed_pair"

    def select(self, ctx: RoutingContext) -> Decision:
        allowed = {w.id: w for w in ctx.candidates}
        first, second = ctx.request.session_id.split(",")
        chosen = allowed.get(first) or next(iter(allowed.values()))
        d = self.decide(ctx, chosen, "fixed", [])
        if second in allowed and chosen.id == first:
            d.alternative_worker_id = second
            d.attributes["both_overloaded"] = 1
        return d

    def slo_ms(self, request: RouteRequest | None) -> float:
        return 1000.0

    def queued_ttft_ms(self, worker, uncached: int, tokens_ahead: int, requests_ahead: int, now: float) -> float:
        # 1 ms per token waiting or in flight on the worker: a queue behind a busy worker is slow
        return float(worker.pending_prefill_tokens + tokens_ahead + uncached)


def make() -> tuple[Router, AdmissionGate]:
    router = Router(RouterSettings(block_size=4, routing={"name": "round_robin"}), ManualClock())
    router._policies.routing["round_robin"] = FixedPair(PairParams(), random.Random(0))
    for wid in ("a", "b", "c"):
        router.add_worker(WorkerSpec(wid, f"{wid}:1", mode=CacheMode.EVENTS))
    return router, AdmissionGate(router, AdmissionConfig(max_inflight=1, max_wait_s=5))


def request(rid: str, pair: str, tokens: int) -> RouteRequest:
    return RouteRequest(rid, [], tokens, session_id=pair)


async def test_a_queued_request_migrates_to_its_alternative_and_is_dispatched_there():
    router, gate = make()
    busy = await gate.route(request("r0", "a,b", 900), None, explain=False)  # a: 900 tokens in flight
    assert busy.worker.id == "a"
    await gate.route(request("r1", "b,c", 100), None, explain=False)  # b: full (max_inflight 1)
    # r2 waits on a behind 900 tokens; its alternative c is idle: 100 ms there vs ~1000 on a
    waiting = asyncio.ensure_future(gate.route(request("r2", "a,c", 100), None, explain=False))
    await asyncio.sleep(0)
    # the migration round of a's queue ran when r2 arrived (both candidates "overloaded")
    result = await asyncio.wait_for(waiting, 1)
    assert result.worker.id == "c" and gate.migrations == 1
    assert len(gate.queues) == 0


async def test_without_benefit_nothing_moves_and_complete_admits_in_order():
    router, gate = make()
    await gate.route(request("r0", "a,b", 10), None, explain=False)
    await gate.route(request("r1", "b,a", 10), None, explain=False)
    # r2's alternative b is as busy as a: no positive benefit, so it waits for a
    waiting = asyncio.ensure_future(gate.route(request("r2", "a,b", 10), None, explain=False))
    await asyncio.sleep(0.01)
    assert not waiting.done() and gate.migrations == 0
    router.complete(Completion("r0"))
    gate.on_complete("a")
    assert (await asyncio.wait_for(waiting, 1)).worker.id == "a"


def test_another_replicas_dispatch_joins_the_deadline_model_unless_replayed_long_after_its_prefill():
    router = Router(RouterSettings(block_size=16, routing={"name": "least_loaded"}), ManualClock())
    router.add_worker(WorkerSpec("a", "a:1", mode=CacheMode.EVENTS))
    gate = AdmissionGate(router, AdmissionConfig(max_inflight=0, deadline="shed"))
    guard = gate.guard
    assert guard is not None
    fresh = Dispatch("fresh", "a", prefill_tokens=4000, prompt_tokens=4000, age_s=0.002)
    assert router.apply_dispatch(fresh)
    gate.on_remote_dispatch(fresh)
    worker = router.workers.get("a")
    assert list(guard._flight["a"]) == ["fresh"]
    assert guard.backlog_ms(worker, router.clock.now()) == guard.prefill_ms(4000)
    # replayed by a replica starting up: prefilled long ago by the model, so no backlog now
    old = Dispatch("old", "a", prefill_tokens=4000, prompt_tokens=4000, age_s=60.0)
    assert router.apply_dispatch(old)
    gate.on_remote_dispatch(old, replaying=True)
    assert list(guard._flight["a"]) == ["fresh"]
    # live, a delta later than its own short prefill still waits behind the backlog: heard
    lagged = Dispatch("lagged", "a", prefill_tokens=64, prompt_tokens=64, age_s=0.01)
    assert router.apply_dispatch(lagged)
    gate.on_remote_dispatch(lagged)
    assert list(guard._flight["a"]) == ["fresh", "lagged"]
    # a prefill hop is charged to its worker, but its request's own dispatch carries the prefill
    hop = Dispatch(prefill_hop_id("fresh"), "a", prefill_tokens=4000, prompt_tokens=4000)
    assert router.apply_dispatch(hop)
    gate.on_remote_dispatch(hop)
    assert list(guard._flight["a"]) == ["fresh", "lagged"]
