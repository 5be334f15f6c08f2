"""Admission queues and DualMap's hotspot-aware migration, as pure synchronous logic.

In *admission queue mode* (off by default) a worker takes at most ``max_inflight`` routed
requests at a time; further requests wait in that worker's FIFO inside the router, where
they can still be moved. That is what DualMap's hotspot-aware rebalancing (section 3.3,
appendix A.1.2) needs: when both candidates of a new request are overloaded, queued requests
on an overloaded worker migrate to *their own* alternative candidate, in descending order of
benefit ``B = TTFT(r, i) - TTFT(r, j)`` (Eq. 6), only when ``B > 0`` and ``TTFT(r, j)`` is
under the request's SLO, until every request left in the source queue is expected to meet
its SLO. One round, no recursion: a migrated request is not moved again in the same round
and the target queue is not rebalanced in turn. Decode-bottlenecked workers (A.7) need no
special case here: their estimator adds the observed stall, so their queue misses the SLO
and drains to the alternatives.

This module holds no clock, lock or future; the host (the gRPC daemon, the simulator)
drives it. The intended wiring, for the host:

1. ``decision, ctx, _ = router.decide(req)``. Build ``Waiting(request_id, worker_id=
   decision.worker_id, alternative_id=decision.alternative_worker_id, uncached={w.id:
   ctx.uncached_tokens(w) for the chosen and alternative worker}, slo_ms=..., enqueued_at=now,
   deadline=now + caller's remaining deadline, payload=<the host's future>)`` and
   ``queues.enqueue(entry)``.
2. If ``decision.attributes.get("both_overloaded")``: ``plan = queues.plan_rebalance(
   [chosen, alternative], load, estimator, now)`` then ``queues.apply(plan)``, recording the
   migrations (each a span event with source, target and both TTFTs).
3. ``for entry in queues.admit(worker_id, inflight)``: commit the request to
   ``entry.worker_id`` (e.g. ``router.route`` with ``candidate_workers=(entry.worker_id,)``)
   and resolve its future. Call ``admit`` after every enqueue, migration and ``Complete``.
4. On the caller's cancellation: ``queues.cancel(request_id)``. Periodically (the tick):
   ``queues.expire(now)`` and fail what it returns with DEADLINE_EXCEEDED; with deadline
   admission's ``defer`` (``kvrouterd.deadline``) also ``queues.drop_late(...)``, failing
   what it returns with RESOURCE_EXHAUSTED (``SloUnreachable``). When a worker
   leaves: ``queues.drop_worker(worker_id)`` and route those requests again.

``load`` maps a worker id to its dispatched ``(pending prefill tokens, inflight requests)``
(for DualMap the first is ``policy.latency.pending_tokens(worker, now)``);
``estimator(worker_id, uncached_tokens, tokens_ahead, requests_ahead)`` returns the TTFT in
ms of a request with ``uncached_tokens`` to prefill behind ``tokens_ahead`` prefill tokens of
``requests_ahead`` requests, its own not included (for DualMap:
``lambda w, u, t, r: policy.queued_ttft_ms(router.workers.get(w), u, t, r, now)``). A queued
request's TTFT also includes the time it has already waited.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import Conflict, InvalidRequest

if TYPE_CHECKING:
    from .protocols import RouteRequest
    from .router import Router

__all__ = ["AdmissionQueues", "Estimator", "Migration", "Waiting", "plan_hotspot_migration", "policy_slo_ms"]

Estimator = Callable[[str, int, int, int], float]


@dataclass(slots=True)
class Waiting:
    """A routed request waiting for its worker to admit it."""

    request_id: str
    worker_id: str
    #: DualMap's other candidate; "" = the request cannot migrate
    alternative_id: str
    #: prefill tokens the request needs on each candidate (worker id -> uncached tokens)
    uncached: dict[str, int]
    slo_ms: float
    enqueued_at: float
    #: clock time after which the caller no longer waits (None = no deadline)
    deadline: float | None = None
    payload: object = field(default=None, compare=False)
    migrations: int = 0


@dataclass(slots=True, frozen=True)
class Migration:
    request_id: str
    source: str
    target: str
    ttft_source_ms: float
    ttft_target_ms: float

    @property
    def benefit_ms(self) -> float:
        return self.ttft_source_ms - self.ttft_target_ms


class AdmissionQueues:
    """Per-worker FIFOs of waiting requests with an in-flight cap.

    ``on_change(worker_id, requests, prefill_tokens)`` (optional) hears every change of a
    worker's queue, so the host can show it to the policies (``Router.note_admission_queue``):
    a request waiting in the router is the instance's pending work in DualMap's sense (3.2),
    exactly as it would be waiting inside the engine.
    """

    def __init__(self, max_inflight: int, on_change: Callable[[str, int, int], None] | None = None) -> None:
        if max_inflight < 1:
            raise InvalidRequest(f"max_inflight must be >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self._queues: dict[str, deque[Waiting]] = {}
        self._by_id: dict[str, Waiting] = {}
        self._tokens: dict[str, int] = {}
        self._on_change = on_change

    def _account(self, worker_id: str, entry: Waiting, sign: int) -> None:
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + sign * entry.uncached[worker_id]
        if self._on_change is not None:
            self._on_change(worker_id, len(self._queues.get(worker_id, ())), self._tokens[worker_id])

    def queued_tokens(self, worker_id: str) -> int:
        """Prefill tokens the requests waiting for ``worker_id`` need there."""
        return self._tokens.get(worker_id, 0)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def queue(self, worker_id: str) -> tuple[Waiting, ...]:
        return tuple(self._queues.get(worker_id, ()))

    def workers(self) -> list[str]:
        return [w for w, q in self._queues.items() if q]

    # ---- membership -----------------------------------------------------------------
    def enqueue(self, entry: Waiting) -> None:
        if not entry.request_id:
            raise InvalidRequest("a waiting request needs a request_id")
        if entry.request_id in self._by_id:
            raise Conflict(f"request {entry.request_id!r} is already waiting")
        if entry.worker_id not in entry.uncached:
            raise InvalidRequest(f"request {entry.request_id!r}: no uncached-token count for {entry.worker_id!r}")
        if entry.alternative_id and entry.alternative_id not in entry.uncached:
            raise InvalidRequest(f"request {entry.request_id!r}: no uncached-token count for {entry.alternative_id!r}")
        if entry.slo_ms <= 0:
            raise InvalidRequest(f"request {entry.request_id!r}: slo_ms must be > 0")
        self._queues.setdefault(entry.worker_id, deque()).append(entry)
        self._by_id[entry.request_id] = entry
        self._account(entry.worker_id, entry, 1)

    def cancel(self, request_id: str) -> Waiting | None:
        """Remove a waiting request (the caller went away); None if it is not waiting."""
        entry = self._by_id.pop(request_id, None)
        if entry is not None:
            self._queues[entry.worker_id].remove(entry)
            self._account(entry.worker_id, entry, -1)
        return entry

    def expire(self, now: float) -> list[Waiting]:
        """Remove and return requests whose deadline has passed."""
        late = [e for e in self._by_id.values() if e.deadline is not None and e.deadline <= now]
        for entry in late:
            self.cancel(entry.request_id)
        return late

    def drop_late(self, load: Mapping[str, tuple[int, int]], estimator: Estimator, now: float) -> list[Waiting]:
        """Remove and return requests that can no longer meet their SLO where they wait
        (deadline admission's ``defer``, ``kvrouterd.deadline``): time waited plus the TTFT
        ``estimator`` predicts behind the worker's load and the requests kept ahead of them."""
        late: list[Waiting] = []
        for worker_id, q in self._queues.items():
            tokens, requests = load.get(worker_id, (0, 0))
            for entry in q:
                own = entry.uncached[worker_id]
                if (now - entry.enqueued_at) * 1000.0 + estimator(worker_id, own, tokens, requests) > entry.slo_ms:
                    late.append(entry)
                else:  # a dropped request no longer delays those behind it
                    tokens += own
                    requests += 1
        for entry in late:
            self.cancel(entry.request_id)
        return late

    def drop_worker(self, worker_id: str) -> list[Waiting]:
        """Everything waiting for ``worker_id``, removed, in queue order (to route again)."""
        entries = list(self._queues.pop(worker_id, ()))
        for entry in entries:
            del self._by_id[entry.request_id]
            self._account(worker_id, entry, -1)
        self._tokens.pop(worker_id, None)
        return entries

    # ---- admission ------------------------------------------------------------------
    def may_dispatch(self, inflight: int) -> bool:
        return inflight < self.max_inflight

    def admit(self, worker_id: str, inflight: int) -> list[Waiting]:
        """Pop, in FIFO order, the requests ``worker_id`` may start with ``inflight`` running."""
        q = self._queues.get(worker_id)
        admitted: list[Waiting] = []
        while q and inflight + len(admitted) < self.max_inflight:
            entry = q.popleft()
            del self._by_id[entry.request_id]
            admitted.append(entry)
            self._account(worker_id, entry, -1)
        return admitted

    # ---- TTFT of waiting requests ---------------------------------------------------
    def queue_ttfts(self, worker_id: str, load: Mapping[str, tuple[int, int]], estimator: Estimator, now: float,
                    skip: frozenset[str] = frozenset()) -> list[tuple[Waiting, float]]:
        """Each waiting request's expected TTFT where it stands (requests in ``skip`` left out)."""
        tokens, requests = load.get(worker_id, (0, 0))
        out = []
        for entry in self._queues.get(worker_id, ()):
            if entry.request_id in skip:
                continue
            own = entry.uncached[worker_id]
            out.append((entry, (now - entry.enqueued_at) * 1000.0 + estimator(worker_id, own, tokens, requests)))
            tokens += own
            requests += 1
        return out

    def meets_slo(self, worker_id: str, load: Mapping[str, tuple[int, int]], estimator: Estimator, now: float,
                  skip: frozenset[str] = frozenset()) -> bool:
        return all(t < e.slo_ms for e, t in self.queue_ttfts(worker_id, load, estimator, now, skip))

    def _tail_ttft(self, entry: Waiting, target: str, load: Mapping[str, tuple[int, int]], estimator: Estimator,
                   now: float, added: tuple[int, int]) -> float:
        tokens, requests = load.get(target, (0, 0))
        q = self._queues.get(target, ())
        tokens += sum(e.uncached[target] for e in q) + added[0]
        requests += len(q) + added[1]
        own = entry.uncached[target]
        return (now - entry.enqueued_at) * 1000.0 + estimator(target, own, tokens, requests)

    # ---- migration ------------------------------------------------------------------
    def plan_migration(self, source: str, load: Mapping[str, tuple[int, int]], estimator: Estimator, now: float,
                       allowed: Callable[[str], bool] | None = None,
                       frozen: Iterable[str] = ()) -> list[Migration]:
        """One round of DualMap's migration off ``source`` (A.1.2); changes nothing.

        Requests in ``frozen`` (already moved this round) stay put; targets must pass
        ``allowed`` (e.g. registered and not draining).
        """
        ok = allowed or (lambda _: True)
        stay = frozenset(frozen)
        if self.meets_slo(source, load, estimator, now):
            return []
        candidates = []
        for order, (entry, t_src) in enumerate(self.queue_ttfts(source, load, estimator, now)):
            target = entry.alternative_id
            if entry.request_id in stay or not target or target == source or not ok(target):
                continue
            t_dst = self._tail_ttft(entry, target, load, estimator, now, (0, 0))
            if t_src - t_dst > 0 and t_dst < entry.slo_ms:
                candidates.append((t_src - t_dst, order, entry))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        plan: list[Migration] = []
        moved: set[str] = set()
        added: dict[str, tuple[int, int]] = {}
        for _, _, entry in candidates:
            if self.meets_slo(source, load, estimator, now, frozenset(moved)):
                break
            target = entry.alternative_id
            # re-estimate both ends: earlier moves shortened this queue and lengthened the target's
            t_src = dict((e.request_id, t) for e, t in self.queue_ttfts(source, load, estimator, now, frozenset(moved)))[entry.request_id]
            t_dst = self._tail_ttft(entry, target, load, estimator, now, added.get(target, (0, 0)))
            if t_src - t_dst <= 0 or t_dst >= entry.slo_ms:
                continue
            plan.append(Migration(entry.request_id, source, target, t_src, t_dst))
            moved.add(entry.request_id)
            tok, req = added.get(target, (0, 0))
            added[target] = (tok + entry.uncached[target], req + 1)
        return plan

    def plan_rebalance(self, workers: Sequence[str], load: Mapping[str, tuple[int, int]], estimator: Estimator,
                       now: float, allowed: Callable[[str], bool] | None = None) -> list[Migration]:
        """Migration rounds off each overloaded worker in ``workers`` (both candidates of the
        request that found them overloaded). Planned sequentially on a scratch copy so the
        second source sees the first's moves; nothing moves twice. Changes nothing."""
        scratch = AdmissionQueues(self.max_inflight)
        scratch._queues = {w: deque(q) for w, q in self._queues.items()}
        scratch._by_id = dict(self._by_id)
        scratch._tokens = dict(self._tokens)
        plan: list[Migration] = []
        for source in dict.fromkeys(workers):
            step = scratch.plan_migration(source, load, estimator, now, allowed, {m.request_id for m in plan})
            scratch._move(step, copy=True)
            plan += step
        return plan

    def apply(self, plan: Sequence[Migration]) -> list[Waiting]:
        """Carry out a plan: each request moves to the tail of its target's queue."""
        for m in plan:
            entry = self._by_id.get(m.request_id)
            if entry is None or entry.worker_id != m.source:
                raise Conflict(f"request {m.request_id!r} is no longer waiting on {m.source!r}; plan again")
        return self._move(plan, copy=False)

    def _move(self, plan: Sequence[Migration], copy: bool) -> list[Waiting]:
        moved = []
        for m in plan:
            entry = self._by_id[m.request_id]
            self._queues[m.source].remove(entry)
            self._account(m.source, entry, -1)
            if copy:  # a scratch queue must not mutate the caller's entries
                entry = Waiting(entry.request_id, entry.worker_id, entry.alternative_id, entry.uncached,
                                entry.slo_ms, entry.enqueued_at, entry.deadline, entry.payload, entry.migrations)
                self._by_id[m.request_id] = entry
            # the old primary becomes the alternative: the pair is preserved
            entry.worker_id, entry.alternative_id = m.target, m.source
            entry.migrations += 1
            self._queues.setdefault(m.target, deque()).append(entry)
            self._account(m.target, entry, 1)
            moved.append(entry)
        return moved


# ---- what every host does the same way --------------------------------------------------

def policy_slo_ms(policy: object, req: RouteRequest, default_ms: float) -> float:
    """The SLO a waiting request is held to: the policy's own (DualMap has a default), else
    the request's, else ``default_ms``."""
    own = getattr(policy, "slo_ms", None)
    if callable(own):
        return float(own(req))
    return req.ttft_slo_ms or default_ms


def plan_hotspot_migration(queues: AdmissionQueues, router: Router, workers: Sequence[str], policy: object,
                           now: float) -> list[Migration]:
    """DualMap's migration round (A.1.2) off ``workers`` (a decision's two overloaded
    candidates), with the policy's own TTFT estimates; changes nothing. Empty for a policy
    without a queue-aware estimate (``queued_ttft_ms``). The daemon's admission gate and the
    simulator both call this, then ``queues.apply``."""
    queued_ttft = getattr(policy, "queued_ttft_ms", None)
    if queued_ttft is None:
        return []

    def estimator(w: str, uncached: int, tokens_ahead: int, requests_ahead: int) -> float:
        return float(queued_ttft(router.workers.get(w), uncached, tokens_ahead, requests_ahead, now))

    # the policy's own view of pending prefill (DualMap drains it at the modelled prefill
    # rate), so migration estimates agree with the estimates that chose the candidates
    latency = getattr(policy, "latency", None)
    if latency is not None and hasattr(latency, "pending_tokens"):
        load = {w.id: (int(latency.pending_tokens(w, now)), w.inflight_requests) for w in router.workers}
    else:
        load = {w.id: (w.pending_prefill_tokens, w.inflight_requests) for w in router.workers}
    return queues.plan_rebalance(workers, load, estimator, now)
