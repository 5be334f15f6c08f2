"""Replica sync of a disaggregated request's prefill hop (issue #31): other replicas charge the
prefill worker as the routing one did, release it on ``prefill_done``, and never twice or below
zero whatever order the deltas come in. The deltas go through the daemon's wire format
(``server/convert``), as on the bus."""

from __future__ import annotations

import random

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.errors import NotFound
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Completion, Dispatch, RouteRequest, WorkerRole
from kvrouterd.router import RouteResult, Router, RouterSettings, prefill_hop_id
from kvrouterd.router.settings import DisaggregationSettings
from kvrouterd.server import convert

BS = 4
PROMPT = list(range(12 * BS))


class Replica:
    """A router whose replica-sync hooks publish into ``stream`` as the daemon's do (app.py)."""

    def __init__(self, name: str, clock: ManualClock, stream: list[bytes], capacity: int = 0) -> None:
        self.name = name
        pd = DisaggregationSettings(mode="always")
        self.router = r = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"},
                                                inflight_timeout_s=10.0, disaggregation=pd), clock, random.Random(1))
        for wid, role in (("p1", WorkerRole.PREFILL), ("p2", WorkerRole.PREFILL), ("d1", WorkerRole.DECODE),
                          ("d2", WorkerRole.DECODE)):
            r.add_worker(WorkerSpec(id=wid, address=f"{wid}:8000", role=role, mode=CacheMode.APPROXIMATE,
                                    capacity_blocks=capacity))

        def committed(result: RouteResult) -> None:
            entry = r.workers.inflight(result.request.request_id)
            stream.append(convert.dispatched_delta(name, result, entry.prefill_tokens if entry else 0))
            if result.prefill_worker is not None:
                stream.append(convert.prefill_hop_delta(name, result))

        r.on_committed = committed
        r.on_completed = lambda done: stream.append(convert.completed_delta(name, done))

    def read(self, data: bytes) -> None:
        """Apply one delta from the stream, as ``Daemon._apply_load_delta`` does."""
        replica, delta = convert.load_delta(data, 0.0)
        own = replica == self.name
        if isinstance(delta, Dispatch):
            self.router.apply_dispatch(delta, own=own)
        elif isinstance(delta, Completion):
            self.router.apply_completion(delta, own=own)

    def view(self) -> dict[str, tuple[int, int]]:
        """Each worker's (in-flight requests, pending prefill tokens)."""
        return {w.id: (w.inflight_requests, w.pending_prefill_tokens) for w in self.router.workers}

    def blocks(self) -> dict[str, set[int]]:
        return {w.id: {k for k, _, _ in self.router.export_blocks(w.id)} for w in self.router.workers}


def route(replica: Replica, rid: str, tokens: list[int] = PROMPT) -> RouteResult:
    return replica.router.route(RouteRequest(rid, block_keys(tokens, BS), len(tokens)))


def test_other_replicas_charge_the_prefill_worker_and_release_it_on_prefill_done() -> None:
    clock = ManualClock()
    stream: list[bytes] = []
    a, b = Replica("a", clock, stream, capacity=10), Replica("b", clock, stream, capacity=10)
    result = route(a, "r1")
    assert result.prefill_worker is not None
    p, d = result.prefill_worker.id, result.worker.id
    assert len(stream) == 2  # the decode hop's Dispatch, then the prefill hop's
    for data in stream:
        a.read(data)
        b.read(data)
    # B charges both hops as A did: the prefill worker the prompt's tokens, the decode worker none
    assert b.view() == a.view()
    assert b.view()[p] == (1, len(PROMPT)) and b.view()[d] == (1, 0)
    # the hop is a charge, not a request: B's request table holds the request alone, as A's
    assert b.router.request(prefill_hop_id("r1")) is None and b.router.request("r1") is not None
    # and the prefill worker's modelled cache (approximate mode), evictions included, matches
    assert b.blocks() == a.blocks() and len(a.blocks()[p]) == 10

    hop = a.router.release_prefill(Completion("r1", prefill_ms=30.0, kv_transfer_ms=4.0, prefill_done=True))
    assert hop is not None and hop.worker_id == p
    b.read(stream[2])
    assert b.view()[p] == (0, 0) and b.view()[d] == (1, 0) and b.view() == a.view()
    assert b.router.counters["remote_prefill_releases"] == 1

    # everything read again (a resubscribed consumer): nothing is charged twice, nothing goes negative
    for data in list(stream):
        b.read(data)
    assert b.view() == a.view() and b.router.counters["remote_late_dispatches"] == 1
    # a second prefill_done is no error and is not published again, here or on B
    assert a.router.release_prefill(Completion("r1", prefill_done=True)) is None
    assert b.router.release_prefill(Completion("r1", prefill_done=True)) is None
    assert len(stream) == 3

    a.router.complete(Completion("r1", ttft_ms=50.0, e2e_ms=800.0))
    b.read(stream[3])
    assert all(v == (0, 0) for v in b.view().values()) and b.router.workers.inflight_count == 0
    with pytest.raises(NotFound, match="already completed"):
        b.router.release_prefill(Completion("r1", prefill_done=True))


def test_a_prefill_done_that_overtakes_the_hops_dispatch_charges_nothing_anywhere() -> None:
    clock = ManualClock()
    stream: list[bytes] = []
    a, b, c = (Replica(n, clock, stream) for n in "abc")
    result = route(a, "r1")
    assert result.prefill_worker is not None
    dispatched = stream[:]
    # the gateway reports the prefill done to C before A's deltas reach the bus
    del stream[:]
    assert c.router.release_prefill(Completion("r1", prefill_done=True)) is None
    assert len(stream) == 1
    for data in stream + dispatched:
        b.read(data)
        c.read(data)
    for replica in (b, c):
        assert replica.view()[result.prefill_worker.id] == (0, 0)
        assert replica.view()[result.worker.id] == (1, 0)
        assert replica.router.counters["remote_late_dispatches"] == 1
    # A released the hop when C's delta came, the request itself stays charged
    a.read(stream[0])
    assert a.view() == b.view() == c.view()


def test_a_complete_that_overtakes_both_hops_dispatches_charges_nothing() -> None:
    clock = ManualClock()
    stream: list[bytes] = []
    a, b = Replica("a", clock, stream), Replica("b", clock, stream)
    route(a, "r1")
    dispatched = stream[:]
    del stream[:]
    assert b.router.complete_anywhere(Completion("r1")) is None
    for data in stream + dispatched:
        b.read(data)
    assert all(v == (0, 0) for v in b.view().values())
    assert b.router.counters["remote_late_dispatches"] == 2


def test_a_remote_prefill_hop_whose_release_is_lost_expires() -> None:
    clock = ManualClock(100.0)
    stream: list[bytes] = []
    a, b = Replica("a", clock, stream), Replica("b", clock, stream)
    route(a, "r1")
    for data in stream:
        b.read(data)
    assert b.router.workers.inflight_count == 2
    clock.advance(11.0)
    expired = {e.request_id for e in b.router.expire_inflight()}
    assert expired == {"r1", prefill_hop_id("r1")}
    assert all(v == (0, 0) for v in b.view().values())
