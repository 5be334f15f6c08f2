"""Charging a routed request to its worker, and releasing it: the native passes as the reference.

Every Route charges its request to its worker (``WorkerRegistry.charge``: an entry in the
registry's in-flight table, oldest first too, and the worker's load) and every Complete releases
it (``release``). Where the extension is built those are ``registry_charge`` and
``registry_release`` (``index/_native.c``), and ``_charge_py`` and ``_release_py`` are their
references. Two registries over one random life of requests, one driven through each, must hold
equal tables (entries of equal types, their order) and loads after every step, and answer a
release, or refuse a charge or a release, alike. Also what the native passes decline, leaving
everything as it was.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvrouterd.errors import Conflict, NotFound
from kvrouterd.index import native
from kvrouterd.index.workers import Worker, WorkerRegistry, WorkerSpec, new_inflight

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

WORKERS = ("w0", "w1", "wörker-2", "w3")


class StrId(str):
    """A str subclass: the reference keeps ``str(value)``, the native pass declines it."""


class IntCount(int):
    """An int subclass: the reference keeps ``int(value)``, the native pass declines it."""


def state(registry: WorkerRegistry) -> tuple[Any, ...]:
    """What the registry keeps between calls: the table with its values' types, its order, the loads."""
    def typed(entry: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple((type(v), v) for v in entry)

    return ([(k, typed(e)) for k, e in registry._inflight.items()], [typed(e) for e in registry._inflight_order],
            [(w.id, w.inflight_requests, w.pending_prefill_tokens) for w in registry])


def fleet() -> WorkerRegistry:
    registry = WorkerRegistry()
    for name in WORKERS:
        registry.add(WorkerSpec(name, f"{name}:1"), 0.0)
    return registry


def outcome(call: Any, *args: Any) -> Any:
    """What a call answered, or the error it raised (type and message)."""
    try:
        return call(*args)
    except (Conflict, NotFound) as exc:
        return type(exc), str(exc)


def random_charge(rng: random.Random, n: int, ids: list[str]) -> tuple[str, Any, int, int, float, str]:
    request_id: Any = rng.choice(ids) if ids and rng.random() < 0.05 else rng.choice((f"r{n}", f"rq-é{n}"))
    prefill: Any = rng.randrange(0, 5_000)
    started: Any = rng.uniform(0, 1e6)
    policy: Any = rng.choice(("cache_aware", "lbgr", "pólicy"))
    roll = rng.random()
    if roll < 0.03:
        request_id = StrId(request_id)
    elif roll < 0.06:
        prefill = IntCount(prefill)
    elif roll < 0.09:
        started = int(started)  # an int: float() in the reference, declined natively
    elif roll < 0.10:
        prefill = True  # a bool is an int to the reference
    return request_id, prefill, rng.randrange(1, 9_000), rng.randrange(0, 500), started, policy


@pytest.mark.parametrize("seed", range(4))
def test_the_native_passes_charge_and_release_as_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    fast, ref = fleet(), fleet()
    ids: list[str] = []
    answered = declined = refused = 0
    for n in range(1_000):
        if rng.random() < 0.45 or not ids:
            worker_id = rng.choice(WORKERS)
            rid, prefill, prompt, overlap, started, policy = random_charge(rng, n, ids)
            before = state(fast)
            answer = native.module.registry_charge(fast, fast.get(worker_id), rid, prefill, prompt, overlap, started,
                                                   policy)
            if answer is NotImplemented:
                declined += 1
                assert state(fast) == before  # declined: nothing changed
                got = outcome(fast._charge_py, fast.get(worker_id), rid, prefill, prompt, overlap, started, policy)
            else:
                answered += 1
                got = answer
            want = outcome(ref._charge_py, ref.get(worker_id), rid, prefill, prompt, overlap, started, policy)
            assert got == want
            refused += got is not None
            if got is None:
                ids.append(str(rid))
        else:
            rid = rng.choice(ids) if rng.random() < 0.9 else f"never-{n}"
            before = state(fast)
            answer = native.module.registry_release(fast, rid, new_inflight)
            if answer is NotImplemented:
                declined += 1
                assert state(fast) == before
                got = outcome(fast._release_py, rid)
            else:
                answered += 1
                got = answer
            want = outcome(ref._release_py, rid)
            assert got == want
            if rid in ids:
                ids.remove(rid)
        assert state(fast) == state(ref)
    assert answered > 600 and declined > 20 and refused > 5  # every way was taken


def test_an_entry_naming_no_registered_worker_is_released_from_the_table_alone() -> None:
    # ``remove`` takes a worker's entries with it; an entry left naming none (the registry's
    # own dict changed under it) still leaves the table as the reference has it leave
    fast, ref = fleet(), fleet()
    for registry in (fast, ref):
        registry.charge(registry.get("w1"), "r1", 300, 400, 6, 1.5, "cache_aware")
        del registry._workers["w1"]
    released = native.module.registry_release(fast, "r1", new_inflight)
    assert released == ref._release_py("r1") and released.worker_id == "w1"
    assert state(fast) == state(ref) and not fast._inflight


def test_charge_and_release_take_the_native_passes_and_keep_the_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = fleet()
    worker = registry.get("w3")
    # the references would fail the test if called: the public methods must answer natively
    monkeypatch.setattr(WorkerRegistry, "_charge_py", None)
    monkeypatch.setattr(WorkerRegistry, "_release_py", None)
    registry.charge(worker, "a", 120, 300, 2, 10.0, "cache_aware")
    registry.charge(worker, "b", 30, 90, 1, 11.0, "cache_aware")
    assert (worker.inflight_requests, worker.pending_prefill_tokens) == (2, 150)
    entry = registry.release("a")
    assert (entry.request_id, entry.worker_id, entry.prefill_tokens, entry.started_at) == ("a", "w3", 120, 10.0)
    assert (worker.inflight_requests, worker.pending_prefill_tokens) == (1, 30)
    assert [e[0] for e in registry._inflight_order] == ["a", "b"]  # the order drops entries lazily (``expire``)


def test_a_worker_whose_members_are_not_a_registered_workers_is_declined() -> None:
    registry = fleet()
    stray = Worker(WorkerSpec("stray", "s:1"), 7, 0.0)
    stray.id = StrId("stray")  # type: ignore[assignment]
    before = state(registry)
    assert native.module.registry_charge(registry, stray, "r", 1, 2, 0, 1.0, "p") is NotImplemented
    assert state(registry) == before
