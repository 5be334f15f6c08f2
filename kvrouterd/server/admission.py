"""Admission queue mode for the daemon: ``Route`` waits in its worker's queue until admitted.

Off by default (``admission.max_inflight: 0``). With ``max_inflight = N`` a worker takes at
most N routed, uncompleted requests; a Route whose chosen worker is full waits, as a future,
in that worker's FIFO (``kvrouterd.admission.AdmissionQueues``, the pure logic). While it
waits it can be moved: when a decision reports both DualMap candidates overloaded
(``both_overloaded``), one migration round (DualMap A.1.2) moves queued requests to their own
alternative where that lowers their estimated TTFT and keeps it under the SLO.

A waiting request is admitted when its worker completes one (``Complete``), when an in-flight
request expires, or when migration frees room. It is then re-decided on the admitted worker
alone, so its overlap and prefill load reflect the cache at dispatch time. It gives up, with
the queue entry removed, when the caller cancels or its gRPC deadline passes, or after
``max_wait_s`` (RESOURCE_EXHAUSTED: the router is shedding load, Envoy answers 429).

A waiting request holds its keys and ids as an in-flight one does, so from enqueue until it
leaves the queue its bytes count against ``limits.max_inflight_bytes`` (``Router.hold_waiting``):
a full queue cannot grow memory past the budget the in-flight table keeps.

Deadline admission (``admission.deadline``, ``kvrouterd.deadline``) runs here too, with or
without queues: a Route predicted to miss its TTFT SLO on the chosen worker is re-decided
among the workers predicted to meet it, and shed with ``SloUnreachable`` (RESOURCE_EXHAUSTED,
``retry-after-ms`` trailer) when none does; with ``defer`` a queued Route is dropped the same
way, at the tick, once it can no longer meet its SLO.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ..admission import AdmissionQueues, Migration, Waiting, plan_hotspot_migration, policy_slo_ms
from ..config import AdmissionConfig
from ..deadline import DeadlineGuard, Pricing, admit_priced, nothing_queued
from ..errors import InvalidRequest, KVRouterError, NoEligibleWorker, Overloaded
from ..policies.base import RoutingContext, RoutingPolicy
from ..protocols import Completion, Decision, Dispatch, RouteRequest
from ..router import PREFILL_HOP_PREFIX, Router, RouteResult

__all__ = ["AdmissionConfig", "AdmissionGate"]

log = logging.getLogger("kvrouterd.admission")


@dataclass(slots=True)
class _Held:
    """A waiting request's payload: the future its Route awaits, and the bytes it holds."""

    future: asyncio.Future[RouteResult]
    request: RouteRequest
    explain: bool
    #: charged by Router.hold_waiting; 0 once released
    bytes: int


class AdmissionGate:
    def __init__(self, router: Router, config: AdmissionConfig) -> None:
        self.router = router
        self.config = config
        #: None without queue mode (``max_inflight: 0``): only deadline admission runs
        self.queues = (AdmissionQueues(config.max_inflight, on_change=router.note_admission_queue)
                       if config.max_inflight > 0 else None)
        #: None with ``deadline: off``
        self.guard = (DeadlineGuard(config.deadline, config.latency_params(), config.deadline_quantile,  # type: ignore[arg-type]
                                    router.block_size)
                      if config.deadline != "off" else None)
        self.migrations = 0
        self.shed = 0

    @property
    def waits(self) -> bool:
        """Whether a Route may wait here (admission queues); without them admission is one
        synchronous step (``route_now``) and callers keep their in-order fast paths."""
        return self.queues is not None

    def route_now(self, req: RouteRequest, explain: bool) -> RouteResult:
        """Deadline admission without queues: decide, shed what cannot meet its SLO, commit."""
        assert self.queues is None
        (decision, ctx, policy), priced = self._decide(req, explain)
        return self._dispatched(self.router.commit(decision, ctx, policy), ctx.now, priced)

    def _decide(self, req: RouteRequest,
                explain: bool) -> tuple[tuple[Decision, RoutingContext, RoutingPolicy], Pricing | None]:
        """The decision, and what deadline admission priced for it (``admit_priced``)."""
        router = self.router
        decided = router.decide(req, explain)
        if self.guard is None:
            return decided, None
        slo_ms = req.ttft_slo_ms or router.settings.default_ttft_slo_ms
        refuse = req.ttft_slo_ms > 0 or self.config.shed_without_slo
        queued = self._queued if self.queues is not None else nothing_queued
        return admit_priced(self.guard, router, req, decided, slo_ms, queued, refuse)

    async def route(self, req: RouteRequest, timeout_s: float | None, explain: bool) -> RouteResult:
        """Decide (shedding what cannot meet its SLO); dispatch now if the worker has room,
        else wait in its queue."""
        router = self.router
        (decision, ctx, policy), priced = self._decide(req, explain)
        wid = decision.worker_id
        worker = router.workers.get(wid)
        if self.queues is None or (not self.queues.queue(wid) and self.queues.may_dispatch(worker.inflight_requests)):
            return self._dispatched(router.commit(decision, ctx, policy), ctx.now, priced)
        if not req.request_id:
            req.request_id = router.new_request_id()
        if req.request_id in self.queues:
            raise InvalidRequest(f"request_id {req.request_id!r} is already waiting")
        now = ctx.now
        wait = self.config.max_wait_s
        if timeout_s is not None and timeout_s < wait:
            # the caller's deadline comes first: gRPC cancels this handler then and the caller
            # sees DEADLINE_EXCEEDED; the extra second is only a safety net
            wait = timeout_s + 1.0
        alt = router.workers.find(decision.alternative_worker_id) if decision.alternative_worker_id else None
        uncached = {wid: ctx.uncached_tokens(worker)}
        if alt is not None:
            uncached[alt.id] = ctx.uncached_tokens(alt)
        future: asyncio.Future[RouteResult] = asyncio.get_running_loop().create_future()
        queues = self.queues
        held = _Held(future, req, explain, router.hold_waiting(req))
        entry = Waiting(
            request_id=req.request_id,
            worker_id=wid,
            alternative_id=alt.id if alt is not None else "",
            uncached=uncached,
            slo_ms=self._slo_ms(policy, req),
            enqueued_at=now,
            deadline=now + wait,
            payload=held,
        )
        try:
            queues.enqueue(entry)
            if decision.attributes.get("both_overloaded") and alt is not None:
                self._rebalance([wid, alt.id], policy, now)
            self._admit_all([wid] + ([alt.id] if alt is not None else []))
            return await asyncio.wait_for(asyncio.shield(future), wait)
        except TimeoutError:
            queues.cancel(req.request_id)
            self.shed += 1
            raise Overloaded(f"waited {wait:.3g}s in {entry.worker_id!r}'s admission queue without being admitted") from None
        except asyncio.CancelledError:
            queues.cancel(req.request_id)
            raise
        finally:
            self._release(held)

    def waiting(self, request_id: str) -> bool:
        """Whether ``request_id`` waits in an admission queue now."""
        return self.queues is not None and request_id in self.queues

    def _queued(self, worker_id: str) -> tuple[int, int]:
        """Requests and prefill tokens waiting for ``worker_id`` in this gate's queue."""
        if self.queues is None:
            return (0, 0)
        return (len(self.queues.queue(worker_id)), self.queues.queued_tokens(worker_id))

    def _dispatched(self, result: RouteResult, now: float, priced: Pricing | None = None) -> RouteResult:
        """A committed Route: deadline admission's model hears of the work it adds (``priced``:
        what admission priced for it, when the decision committed in the same step)."""
        if self.guard is not None:
            cached = result.decision.overlap_blocks * self.router.block_size
            uncached = max(0, result.request.prompt_tokens - cached)
            self.guard.on_dispatch(result.worker, result.request.request_id, uncached, now, cached, priced)
        return result

    def on_remote_dispatch(self, dispatch: Dispatch, replaying: bool = False) -> None:
        """Another replica committed ``dispatch``, charged here (``Router.apply_dispatch``):
        deadline admission's model hears of the prefill it adds, as ``_dispatched`` does of one
        routed here. Unheard, a replica's backlog held only its own share of each worker's
        prefill, so with N replicas each admitted about N times what the SLO allows until the
        engines' load reports caught up (and those re-anchor only the requests routed here).
        A prefill hop's dispatch is left out, as a local commit leaves it out. So is, while
        ``replaying`` (a replica starting replays the fleet's in-flight requests), one older
        than its own modelled prefill: most are long past it, and counted as dispatched now
        they would have priced every worker seconds behind and shed what the fleet could
        serve. Live deltas are all heard: a few ms of bus lag is longer than a cached prompt's
        own prefill, yet its prefill waits behind the worker's backlog like any other."""
        guard = self.guard
        if guard is None or dispatch.request_id.startswith(PREFILL_HOP_PREFIX):
            return
        worker = self.router.workers.find(dispatch.worker_id)
        if worker is None:
            return
        cached = dispatch.overlap_blocks * self.router.block_size
        uncached = max(0, dispatch.prompt_tokens - cached)
        if replaying and dispatch.age_s * 1000.0 >= guard.prefill_ms(uncached, cached) * guard.scale:
            return
        guard.on_dispatch(worker, dispatch.request_id, uncached, self.router.clock.now(), cached)

    def _release(self, held: _Held) -> None:
        if held.bytes:
            self.router.release_waiting(held.bytes)
            held.bytes = 0

    def _slo_ms(self, policy: object, req: RouteRequest) -> float:
        """The SLO the policy itself applies (DualMap has its own default), else the router's."""
        return policy_slo_ms(policy, req, self.router.settings.default_ttft_slo_ms)

    def _rebalance(self, workers: list[str], policy: object, now: float) -> None:
        assert self.queues is not None
        plan: list[Migration] = plan_hotspot_migration(self.queues, self.router, workers, policy, now)
        if plan:
            self.queues.apply(plan)
            self.migrations += len(plan)
            for m in plan:
                log.info(
                    "migrated queued request", extra={"request_id": m.request_id, "source": m.source,
                                                      "target": m.target, "benefit_ms": round(m.benefit_ms, 1)},
                )
            self._admit_all({m.target for m in plan})

    def _admit_all(self, worker_ids: Iterable[str]) -> None:
        if self.queues is None:
            return
        for wid in worker_ids:
            worker = self.router.workers.find(wid)
            if worker is None:
                continue
            for entry in self.queues.admit(wid, worker.inflight_requests):
                self._dispatch(entry)

    def _dispatch(self, entry: Waiting) -> None:
        held: _Held = entry.payload  # type: ignore[assignment]
        future, req = held.future, held.request
        if future.done():
            return
        # out of the queue: its bytes move to the in-flight table (route checks the budget without them)
        self._release(held)
        req.candidate_workers = (entry.worker_id,)
        try:
            future.set_result(self._dispatched(self.router.route(req, held.explain), self.router.clock.now()))
        except KVRouterError as exc:
            future.set_exception(exc)

    def on_complete(self, worker_id: str, completion: Completion | None = None) -> None:
        """A routed request completed on ``worker_id`` (its ``completion``, when the caller has
        it, calibrates deadline admission's model)."""
        if self.guard is not None and completion is not None:
            self.guard.on_complete(completion.request_id, completion.ttft_ms, self.router.clock.now(), completion.e2e_ms)
        if self.queues is not None:  # the room it freed goes to the worker's queue
            self._admit_all((worker_id,))

    def on_expired(self, request_id: str) -> None:
        """A routed request was released after ``inflight_timeout_s`` without its Complete
        (``Router.expire_inflight``); the tick admits into the room it freed."""
        if self.guard is not None:
            self.guard.on_expired(request_id)

    def on_first_token(self, completion: Completion) -> None:
        """A routed request's first token is out (``completion.ttft_ms``): deadline admission
        learns its TTFT now rather than when the request ends."""
        if self.guard is not None and completion.ttft_ms > 0:
            self.guard.on_first_token(completion.request_id, completion.ttft_ms, self.router.clock.now())

    def tick(self, now: float) -> None:
        """Give up on entries past their deadline (their waiters time out themselves), with
        ``deadline: defer`` drop those that can no longer meet their SLO, and admit wherever
        expired in-flight requests freed room."""
        if self.queues is None:
            return
        self.queues.expire(now)
        if self.guard is not None and self.guard.mode == "defer":
            load, estimator = self.guard.queue_estimator(self.router, now)
            for entry in self.queues.drop_late(load, estimator, now):
                future = entry.payload.future  # type: ignore[attr-defined]
                if not future.done():
                    future.set_exception(self.guard.late_refusal((now - entry.enqueued_at) * 1000.0, entry.slo_ms))
        self._admit_all(self.queues.workers())

    def drop_worker(self, worker_id: str) -> None:
        """A worker left: its waiting requests fail fast (UNAVAILABLE via the caller's retry)."""
        if self.guard is not None:
            self.guard.forget_worker(worker_id)
        if self.queues is None:
            return
        for entry in self.queues.drop_worker(worker_id):
            future = entry.payload.future  # type: ignore[attr-defined]
            if not future.done():
                future.set_exception(NoEligibleWorker(f"worker {worker_id!r} left while the request waited"))
