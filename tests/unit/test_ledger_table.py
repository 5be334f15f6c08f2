"""The in-flight table: the native passes keep a routed request, and forget it, as the reference.

Every Route puts its request in the ledger's table, packed, with what it costs, and counts it
against its client (``LoadLedger._keep``); every Complete takes it out (``forget_request``).
Where the extension is built those are ``ledger_keep`` and ``ledger_forget``
(``index/_native.c``), and ``_keep_py`` and ``_forget_py`` are their references. Two ledgers
over one random life of requests, one driven through each, must hold equal tables (entries,
their order, bytes, clients' counts) after every step, and answer a forget alike. Also what
the native passes decline (leaving the tables as they were) and what they raise; and the check
before a Route (``check_admissible``): natively ``ledger_admissible`` admits only what its
reference, ``_check_admissible_py``, admits, and through the method the two answer alike.
And a Route's commit and a Complete's release (``LoadLedger.commit``, ``_finish``): natively
``ledger_commit`` and ``ledger_finish`` write what ``_commit_py`` and ``_finish_py`` do, two
routers over one random life of Routes and Completes.
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from typing import Any

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.base import NONE_CLAIMED
from kvrouterd.protocols import CacheMode, Completion, RouteRequest, TaskCategory, WorkerRole
from kvrouterd.router import Router, RouterSettings, request_bytes
from kvrouterd.router import ledger as ledger_module
from kvrouterd.router.ledger import LoadLedger, PrefixHits, unpack_request
from kvrouterd.router.settings import DisaggregationSettings

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)


def table(ledger: LoadLedger) -> tuple[Any, ...]:
    """Everything the table keeps between calls, orders included."""
    return list(ledger.requests.items()), list(ledger.by_client.items()), ledger.inflight_bytes


def ledgers() -> tuple[LoadLedger, LoadLedger]:
    """Two ledgers over one router's parts: only their tables are compared."""
    parts = Router(RouterSettings(block_size=16), ManualClock())._ledger
    return (LoadLedger(parts._shared, parts._recent, parts._speculative),
            LoadLedger(parts._shared, parts._recent, parts._speculative))


class StrId(str):
    """A str subclass: the reference keeps ``str(value)``, the native passes decline it."""


def random_request(rng: random.Random, n: int) -> RouteRequest:
    keys: Any = array("Q", (rng.getrandbits(64) for _ in range(rng.randrange(0, 40))))
    roll = rng.random()
    if roll < 0.05:
        keys = keys.tolist()  # packed key by key: declined
    elif roll < 0.08:
        keys = array("q", (k >> 1 for k in keys))  # another typecode: kept as a list, declined
    client = rng.choice(("", "", "ipv4:127.0.0.1:5000", "ipv6:[::1]:6000", "çlient-é"))
    request_id = rng.choice((f"r{n}", f"rq-é{n}", f"r{n}" * 30))
    task: Any = rng.choice(list(TaskCategory))
    slo: Any = rng.choice((0.0, 250.5, 1e4))
    if rng.random() < 0.05:
        request_id = StrId(request_id)
    if rng.random() < 0.05:
        slo = 300  # an int: float() in the reference, declined natively
    if rng.random() < 0.05:
        task = int(task)  # an int is kept as it is
    candidates = tuple(rng.sample([f"w{i}" for i in range(12)] + ["wörker-ü"], rng.choice((0, 0, 1, 5))))
    return RouteRequest(request_id, keys, rng.randrange(1, 5_000), rng.choice(("", "s1", "sess-ø")), task, slo,
                        rng.randrange(0, 900), rng.choice(("", "cache_aware", "lbgr")), candidates,
                        rng.choice(("", "llama")), rng.choice(("", "ad-1")), client)


@pytest.mark.parametrize("seed", range(4))
def test_the_native_passes_keep_the_table_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    fast, ref = ledgers()
    in_flight: list[str] = []
    declined = kept = forgotten = 0
    for n in range(1_500):
        if rng.random() < 0.55 or not in_flight:
            req = random_request(rng, n)
            if req.request_id in fast.requests:
                continue
            answer = native.module.ledger_keep(fast, req)
            if answer is NotImplemented:
                declined += 1
                assert table(fast) == table(ref), "a decline wrote the table"
                fast._keep_py(req)
            else:
                assert answer is None
                kept += 1
            ref._keep_py(req)
            in_flight.append(req.request_id)
            got = fast.requests[req.request_id]
            assert got == ref.requests[req.request_id]
            assert [type(v) for v in got] == [type(v) for v in ref.requests[req.request_id]]
            assert unpack_request(got) == unpack_request(ref.requests[req.request_id])
            assert got[11] == request_bytes(req)
        else:
            rid = in_flight.pop(rng.randrange(len(in_flight))) if rng.random() < 0.9 else f"gone-{n}"
            assert fast.forget_request(rid) == ref._forget_py(rid)
            forgotten += 1
        assert table(fast) == table(ref)
    # every path ran: kept natively, declined to the reference, forgotten, unknown ids
    assert kept > 300 and declined > 20 and forgotten > 300


def test_a_kept_request_reads_back_equal_and_costs_what_request_bytes_says() -> None:
    fast, _ = ledgers()
    req = RouteRequest("r1", array("Q", [1, 2, 2**64 - 1]), 48, "s", TaskCategory.AGENTIC, 120.0, 7, "lbgr",
                       ("w1", "wö"), "m", "l", "c1")
    assert native.module.ledger_keep(fast, req) is None
    assert unpack_request(fast.requests["r1"]) == req
    assert fast.inflight_bytes == request_bytes(req) and fast.by_client == {"c1": 1}
    assert fast.forget_request("r1") is not None
    assert (fast.requests, fast.by_client, fast.inflight_bytes) == ({}, {}, 0)
    assert fast.forget_request("r1") is None


def test_what_the_native_passes_decline_leaves_the_table_as_it_was() -> None:
    fast, _ = ledgers()
    req = RouteRequest("r1", array("Q", [1, 2]), 32, client="c")
    fast._keep_py(req)
    before = table(fast)
    declined = [
        RouteRequest("r2", [1, 2], 32),  # a list of keys
        RouteRequest("r2", array("Q", [1]), 32, ttft_slo_ms=5),  # an int where a float is kept
        RouteRequest(StrId("r2"), array("Q", [1]), 32),
        RouteRequest("r2", array("Q", [1]), 32, candidate_workers=("w1", StrId("w2"))),
        RouteRequest("r2", array("Q", [1]), 32, candidate_workers=["w1"]),  # type: ignore[arg-type]
        RouteRequest("r2", array("Q", [1]), 32, task="chat"),  # type: ignore[arg-type]
    ]
    for bad in declined:
        assert native.module.ledger_keep(fast, bad) is NotImplemented
        assert table(fast) == before
    fast.by_client["c"] = 1.0  # a count that is no int: the reference's arithmetic, not ours
    assert native.module.ledger_keep(fast, RouteRequest("r3", array("Q"), 16, client="c")) is NotImplemented
    assert native.module.ledger_forget(fast, "r1") is NotImplemented
    assert native.module.ledger_forget(fast, StrId("r1")) is NotImplemented
    assert "r1" in fast.requests
    fast.by_client.clear()  # a client the count lost: the reference raises its KeyError
    assert native.module.ledger_forget(fast, "r1") is NotImplemented
    with pytest.raises(KeyError):
        fast._forget_py("r1")


def test_the_native_passes_raise_what_reading_the_request_raises() -> None:
    fast, _ = ledgers()

    class Broken:
        """A request whose adapter cannot be read."""

        request_id, keys, prompt_tokens, session_id, task = "r1", array("Q", [1]), 16, "", 0
        ttft_slo_ms, expected_output_tokens, policy, candidate_workers, model, client = 0.0, 0, "", (), "", ""

        @property
        def lora(self) -> str:
            raise RuntimeError("lora unreadable")

    with pytest.raises(RuntimeError, match="lora unreadable"):
        native.module.ledger_keep(fast, Broken())
    assert table(fast) == ([], [], 0)
    class Later(RouteRequest):
        """A request class changed after the native pass read it: its fields are found again."""

        __slots__ = ()

    first, second = Later("r2", array("Q", [1]), 16), Later("r3", array("Q", [1]), 16)
    assert native.module.ledger_keep(fast, first) is None

    def unreadable(self: Later) -> str:
        raise RuntimeError("lora unreadable")

    Later.lora = property(unreadable)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="lora unreadable"):
        native.module.ledger_keep(fast, second)
    assert list(fast.requests) == ["r2"]
    with pytest.raises(TypeError, match="2 arguments"):
        native.module.ledger_keep(fast)
    with pytest.raises(TypeError, match="2 arguments"):
        native.module.ledger_forget(fast, "r1", "r2")


def admitted(ledger: LoadLedger, req: RouteRequest) -> str:
    """What the reference answers: "" when it admits ``req``, else its error."""
    try:
        ledger._check_admissible_py(req)
    except KVRouterError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.mark.parametrize("seed", range(3))
def test_the_native_admission_check_admits_only_what_the_reference_admits(seed: int) -> None:
    rng = random.Random(seed)
    fast, _ = ledgers()
    base = fast._shared.settings
    answered = refused = 0
    for n in range(1_500):
        req = random_request(rng, n)
        per_client, byte_limit = rng.choice((0, 0, 2, 5)), rng.choice((0, 20_000, 60_000, 10**9))
        settings = fast._shared.settings = dataclasses.replace(base, max_inflight_per_client=per_client,
                                                               max_inflight_bytes=byte_limit)
        if rng.random() < 0.1 and fast.requests:
            req.request_id = rng.choice(list(fast.requests))  # already in flight
        fast.waiting_bytes = rng.choice((0, 0, 5_000))
        want = admitted(fast, req)
        if native.module.ledger_admissible(fast, req, per_client, byte_limit, settings.max_id_length):
            assert want == ""  # admitted natively: the reference admits it too
            answered += 1
        refused += want != ""
        try:
            fast.check_admissible(req)
            got = ""
        except KVRouterError as exc:
            got = f"{type(exc).__name__}: {exc}"
        assert got == want
        if want == "" and rng.random() < 0.6 and native.module.ledger_keep(fast, req) is NotImplemented:
            fast._keep_py(req)
        if fast.requests and rng.random() < 0.3:
            fast.forget_request(rng.choice(list(fast.requests)))
    assert answered > 300 and refused > 100


# ---- a commit's books: ledger_commit against _commit_py -----------------------------------

def fleet(kind: str) -> Router:
    """A router over five workers: events-mode with speculative blocks, approximate-mode with a
    small capacity, or a prefill/decode pool (two hops, the decode hop charged no prefill)."""
    pd = DisaggregationSettings(mode="conditional", local_prefill_max_uncached_tokens=32)
    settings = {"events": RouterSettings(block_size=16, speculative_ttl_s=5.0),
                "approximate": RouterSettings(block_size=16, approximate_capacity_blocks=40),
                "disaggregated": RouterSettings(block_size=16, disaggregation=pd)}[kind]
    router = Router(settings, ManualClock())
    for i in range(5):
        role = (WorkerRole.PREFILL if i < 2 else WorkerRole.DECODE) if kind == "disaggregated" else WorkerRole.BOTH
        mode = CacheMode.EVENTS if kind == "events" else CacheMode.APPROXIMATE
        router.add_worker(WorkerSpec(f"w{i}", f"h{i}:1", mode=mode, role=role))
    return router


def books(router: Router) -> tuple[Any, ...]:
    """What commits and completions write: the ledger's table and counts, the registry's table
    and loads, the speculative blocks' claims."""
    ledger, registry = router._ledger, router.workers
    return (table(ledger), dict(ledger.prefix_hits), dict(ledger.decisions_by_policy), dict(router.counters),
            list(registry._inflight.items()), [(w.id, w.inflight_requests, w.pending_prefill_tokens) for w in registry],
            router.speculative.live, dict(router.speculative.outcomes))


def settled(call: Any, arg: Any) -> Any:
    """A Route's or a Complete's answer, or the error it raised (type and message)."""
    try:
        result = call(arg)
    except KVRouterError as exc:
        return type(exc), str(exc)
    if hasattr(result, "decision"):
        d = result.decision
        return (result.worker.id, d.overlap_blocks, d.reason, d.policy, result.evicted,
                result.prefill_worker.id if result.prefill_worker is not None else None)
    return result


@pytest.mark.parametrize("kind", ["events", "approximate", "disaggregated"])
def test_the_native_commit_and_finish_keep_the_books_as_the_references(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two routers over one random life of Routes (shared prefixes, several policies, ids
    reused while in flight) and Completes (some failed, some of ids not in flight): one commits
    through ``ledger_commit`` and finishes through ``ledger_finish``, the other through
    ``_commit_py`` and ``_finish_py``; their answers and everything they write stay equal."""
    rng = random.Random(7)
    fast, ref = fleet(kind), fleet(kind)
    answered: dict[str, int] = {"commit": 0, "finish": 0}
    declined: dict[str, int] = {"commit": 0, "finish": 0}

    def counted(name: str) -> Any:
        def call(*args: Any) -> Any:
            out = getattr(native.module, f"ledger_{name}")(*args)
            (declined if out is NotImplemented else answered)[name] += 1
            return out
        return call

    def through(native_passes: bool) -> None:
        for name in ("commit", "finish"):
            monkeypatch.setattr(ledger_module, f"_ledger_{name}", counted(name) if native_passes else None)

    prefixes = [list(range(p * 1_000, p * 1_000 + 16 * rng.randrange(1, 6))) for p in range(4)]
    in_flight: list[str] = []
    for n in range(600):
        if rng.random() < 0.6 or not in_flight:
            tokens = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(16 * rng.randrange(0, 3))]
            rid = rng.choice(in_flight) if in_flight and rng.random() < 0.05 else rng.choice((f"r{n}", ""))
            policy = rng.choice(("", "", "cache_aware", "least_loaded", "lbgr"))
            twins = [RouteRequest(rid, r.keys_for_tokens(tokens), len(tokens), policy=policy) for r in (fast, ref)]
            through(True)
            got = settled(fast.route, twins[0])
            through(False)
            assert got == settled(ref.route, twins[1])
            if not isinstance(got[0], type):
                assert twins[0].request_id == twins[1].request_id  # an unnamed one's, from equal rngs
                in_flight.append(twins[0].request_id)
        else:
            rid = in_flight.pop(rng.randrange(len(in_flight))) if rng.random() < 0.95 else f"gone-{n}"
            done = Completion(rid, ttft_ms=rng.uniform(1, 50), e2e_ms=100.0, success=rng.random() < 0.9)
            through(True)
            got = settled(fast.complete, done)
            through(False)
            assert got == settled(ref.complete, done)
        assert books(fast) == books(ref)
    # the native passes answered most; a policy's first decision, ids in flight and unknown
    # ids declined to the references; a P/D pool's Completes (hops charged) run the reference
    assert answered["commit"] > 250 and declined["commit"] >= 3
    if kind == "disaggregated":
        assert answered["finish"] == 0
    else:
        assert answered["finish"] > 100 and declined["finish"] >= 3


def test_what_the_native_commit_declines_is_left_as_it_was() -> None:
    router = fleet("events")
    decision, ctx, _ = router.decide(RouteRequest("r1", router.keys_for_tokens(list(range(64))), 64))
    worker = router.workers.get(decision.worker_id)
    ledger = router._ledger
    args = (decision, ctx, worker, router.workers, router.counters, NONE_CLAIMED)
    before = books(router), decision.overlap_blocks
    # the policy's first decision: no prefix-hit record yet, the reference makes it
    assert native.module.ledger_commit(ledger, *args) is NotImplemented
    assert (books(router), decision.overlap_blocks) == before
    ledger.prefix_hits[decision.policy] = PrefixHits()
    router.counters["decisions"] = 1.0  # type: ignore[assignment]  # a count that is no int
    before = books(router), decision.overlap_blocks
    assert native.module.ledger_commit(ledger, *args) is NotImplemented
    assert (books(router), decision.overlap_blocks) == before
    router.counters["decisions"] = 0
    ledger._commit_py(dataclasses.replace(decision), ctx, worker)  # r1 in flight now
    before = books(router), decision.overlap_blocks
    # in flight already: the reference raises its Conflict
    assert native.module.ledger_commit(ledger, *args) is NotImplemented
    assert (books(router), decision.overlap_blocks) == before


def test_the_native_request_id_is_the_references() -> None:
    """``ledger_request_id`` makes the id ``_new_request_id_py`` makes, from equal counters and
    rngs, moving both alike; a counter it cannot read it leaves to the reference."""
    fast, ref = fleet("events"), fleet("events")
    for start in (0, 15, 2**32 - 2, 2**63 - 60, 2**62):  # one hex digit to 16
        fast._ledger._request_counter = ref._ledger._request_counter = start
        for _ in range(50):
            made = native.module.ledger_request_id(fast._ledger, fast.rng)
            assert made == ref._ledger._new_request_id_py()
            assert fast._ledger._request_counter == ref._ledger._request_counter
        assert fast.rng.getstate() == ref.rng.getstate()
    assert made.startswith(f"kvr-{2**62 + 50:x}-") and len(made.rsplit("-", 1)[1]) == 8
    for unread in (2**63 - 1, 2**64, 3.0):
        fast._ledger._request_counter = unread  # type: ignore[assignment]
        assert native.module.ledger_request_id(fast._ledger, fast.rng) is NotImplemented
        assert fast._ledger._request_counter == unread
    fast._ledger._request_counter = 2**63 - 1  # past what the native pass reads: the reference's
    assert fast._ledger.new_request_id().startswith(f"kvr-{2**63:x}-")
