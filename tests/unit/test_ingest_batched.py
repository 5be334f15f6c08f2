"""Router.apply's native runs of Stored events against its per-event path and the pure-Python one.

An engine batch's plain Stored events (token bytes, pages of the router's blocks, no hybrid group,
no extra keys) are checked by one native call (``events_plain``) and applied in runs, one native
call each (``RadixIndex.store_events``: parent resolution, hashing, store, engine-hash map and
lru's leaf hook). ``EventApplier``'s per-event path is the reference: with ``batched = False``
the same native index takes the events one at a time, and ``RadixIndex(pure=True)`` is the
Python reference of everything under it. Three routers get the same random batches (chains from
the root, salted by model / LoRA / cache salt, continuing a parent, unknown parents, duplicate
stores, engine hashes that collide with other blocks' hashes or equal our keys, a block nobody
holds being stored again, hybrid groups, extra keys, pages larger than a block, removals, clears,
events that are rejected); after every batch they must agree on the outcome, every block, each
slot's leaves, counts and engine-hash maps (both ways), the recent accesses, lru's leaf order and the
eviction order. CI runs this on the native build and again with ``KVROUTERD_PURE_PYTHON=1``.
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import InvalidRequest
from kvrouterd.index import native
from kvrouterd.index.keys import chain_keys_py, namespace_seed
from kvrouterd.index.radix import RadixIndex
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.base import EvictionContext, EvictionPolicyBase
from kvrouterd.protocols import CacheMode, Cleared, EventBatch, EvictRequest, Removed, RouteRequest, Stored
from kvrouterd.router import Router, RouterSettings
from tests.invariants import index_blocks

BLOCK = 4
PROMPTS = 4  # prompts 0 and 1 share their first block, 2 and 3 too
DEPTH = 5  # blocks per prompt
NAMESPACES = [("", "", ""), ("m", "", ""), ("m", "ad", ""), ("mé", "", "salt")]
WORKERS = ("engine", "sdk", "paged")  # engine hashes / our keys as hashes / pages of 2 blocks


def _tokens(prompt: int, j: int) -> list[int]:
    owner = prompt // 2 if j == 0 else prompt + 10
    return [(owner * 100 + j) * BLOCK + t for t in range(BLOCK)]


def _engine_hash(prompt: int, j: int, collide: bool) -> int:
    # distinct per block content (shared first blocks share it); `collide` gives every block of a
    # prompt the hash of that prompt's first block
    owner = prompt // 2 if j == 0 or collide else prompt + 10
    return (0x9E3779B97F4A7C15 * (owner * 100 + (0 if collide else j) + 1)) % 2**64


def _our_key(prompt: int, j: int, ns: int) -> int:
    data = array("I", [t for i in range(j + 1) for t in _tokens(prompt, i)]).tobytes()
    return chain_keys_py(data, BLOCK, namespace_seed(*NAMESPACES[ns]))[-1]


class _NoStoredHook(EvictionPolicyBase):
    """An eviction policy whose stored hook is the base's no-op: its runs make no hook call."""

    name = "no_stored_hook"

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Any]:
        return []


def _router(kind: str, policy: str = "lru") -> Router:
    """A router of three workers, each holding one block stored by the per-event path: lru's leaf
    order for a slot is made by its first stored chain, and only a slot that has one takes runs."""
    router = Router(RouterSettings(block_size=BLOCK), ManualClock())
    if kind == "pure":
        router.index = RadixIndex(pure=True)
    if policy != "lru":
        router.eviction = _NoStoredHook(None, random.Random(0))
    for wid in WORKERS:
        spec = WorkerSpec(wid, "h:1", mode=CacheMode.EVENTS, block_size=2 * BLOCK if wid == "paged" else 0)
        worker = router.add_worker(spec)
        if kind == "pure":
            worker.engine_keys = {}
        page = 2 * BLOCK if wid == "paged" else BLOCK
        first = Stored(array("I", range(10**6, 10**6 + page)).tobytes(), None if wid == "sdk" else (12345,))
        router.apply(EventBatch(wid, 0, (first,)))
    router._events.batched = kind == "batched"
    return router


# (kind, prompt, first block, blocks, namespace, parent: "chain" | "unknown" | "ours", collide, extra)
stored_ev = st.tuples(st.just("stored"), st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1), st.integers(1, DEPTH),
                      st.sampled_from([0, 0, 0, 1, 2, 3]),
                      st.sampled_from(["chain", "chain", "ours", "ours", "unknown"]),
                      st.booleans(), st.sampled_from([None] * 9 + ["group", "extra", "bad"]))
removed_ev = st.tuples(st.just("removed"), st.lists(st.tuples(st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1)),
                                                     min_size=1, max_size=6), st.sampled_from([0, 0, 0, 1, 2, 3]),
                       st.booleans())
cleared_ev = st.tuples(st.just("cleared"))
event = st.one_of(*[stored_ev] * 20, *[removed_ev] * 6, cleared_ev)
batch = st.tuples(st.sampled_from(WORKERS), st.lists(event, min_size=1, max_size=6), st.booleans(), st.booleans())


def _event(worker: str, spec: tuple[Any, ...]) -> Any:
    engine = worker != "sdk"
    if spec[0] == "stored":
        _, prompt, start, n, ns, parent, collide, odd = spec
        if worker == "paged":  # pages of two blocks, starting at an even block
            start -= start % 2
            n = 2
        blocks = range(start, min(DEPTH, start + n))
        if worker == "paged" and len(blocks) < 2:
            blocks = range(DEPTH - 3, DEPTH - 1)
            start = blocks[0]
        model, lora, salt = NAMESPACES[ns]
        hashes: tuple[int, ...] | None = None
        if engine:
            step = 2 if worker == "paged" else 1
            hashes = tuple(_engine_hash(prompt, j, collide) for j in blocks[::step])
        parent_hash = None
        if start:
            if parent == "unknown":
                parent_hash = 0xDEAD0000 + prompt
            elif parent == "ours" or not engine:
                parent_hash = _our_key(prompt, start - 1, ns)
            else:
                parent_hash = _engine_hash(prompt, start - 1, collide)
        tokens = array("I", [t for j in blocks for t in _tokens(prompt, j)]).tobytes()
        return Stored(
            token_ids=tokens if odd != "bad" else tokens[:-4],  # "bad": not whole pages, rejected
            engine_hashes=hashes,
            parent_engine_hash=parent_hash,
            model=model, lora=lora, salt=salt,
            group=1 if odd == "group" else None,
            group_kind="full_attention" if odd == "group" else None,
            extra_hashes=tuple(range(1, len(blocks) + 1)) if odd == "extra" and worker != "paged" else None,
        )
    if spec[0] == "removed":
        _, blocks, ns, collide = spec
        if engine:
            return Removed(tuple(_engine_hash(p, j, collide) for p, j in blocks))
        return Removed(tuple(_our_key(p, j, ns) for p, j in blocks))
    return Cleared()


def _snapshot(router: Router) -> dict[str, Any]:
    index = router.index
    blocks = index_blocks(index)
    workers = {}
    leaves = getattr(router.eviction, "_leaves", None)  # lru's
    for w in router.workers:
        order = None if leaves is None else leaves._slots.get(w.slot)
        leaf_order = None if order is None else [(p, k) for p, k, _ in order]
        reverse = router._engine_hashes.by_slot.get(w.slot)  # kept once the worker asked for a hint
        workers[w.id] = (sorted(b.key for b in index.leaves(w.slot)), index.count(w.slot), index.count_alone(w.slot),
                         sorted(w.engine_keys.items()), None if reverse is None else sorted(reverse.items()),
                         w.last_sequence, w.state, dict(w.events_rejected), leaf_order)
    return {"blocks": blocks, "workers": workers, "unheld": index.unheld, "len": len(index),
            "recent": dict(router._events._recent.entries), "counters": dict(router._shared.counters)}


def _eviction_order(router: Router) -> dict[str, list[int]]:
    out = {}
    for w in router.workers:
        n = router.index.count(w.slot)
        out[w.id] = router.evict_hint(EvictRequest(w.id, n)).keys if n else []
    return out


def _apply(router: Router, eb: EventBatch, per_event: bool) -> Any:
    try:
        return router.apply(eb, per_event=per_event)
    except InvalidRequest as exc:
        return ("rejected", str(exc))


@pytest.mark.parametrize("policy", ["lru", "no_stored_hook"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batch, min_size=1, max_size=12))
def test_native_runs_of_stored_events_match_the_per_event_path_and_pure_python(policy, batches):
    routers = [_router("batched", policy), _router("per_event", policy), _router("pure", policy)]
    sequence = dict.fromkeys(WORKERS, 1)
    for step, (worker, specs, per_event, remember) in enumerate(batches):
        events = tuple(_event(worker, s) for s in specs)
        eb = EventBatch(worker, sequence[worker], events)
        outcomes = []
        for router in routers:
            router.clock.advance(1.0)  # type: ignore[attr-defined]
            if remember:  # recent accesses are read for every stored chain while there are any
                keys = [_our_key(0, j, 0) for j in range(3)]
                router._events._recent.remember(RouteRequest("r", keys, 3 * BLOCK, session_id="s"))
            outcomes.append(_apply(router, eb, per_event))
        if not (isinstance(outcomes[0], tuple) and outcomes[0][0] == "rejected"):
            sequence[worker] += 1
        assert outcomes[0] == outcomes[1] == outcomes[2], step
        snapshots = [_snapshot(r) for r in routers]
        # the pure index keeps its leaves in the Python order: compare it by its contents
        assert snapshots[0] == snapshots[1], step
        for snap in (snapshots[0], snapshots[2]):
            for wid, state in snap["workers"].items():
                snap["workers"][wid] = state[:-1] + (None if state[-1] is None else sorted(state[-1]),)
        assert snapshots[0] == snapshots[2], step
        if policy == "lru":
            orders = [_eviction_order(r) for r in routers]
            assert orders[0] == orders[1] == orders[2], step


def _plain_batch(seq: int, parent: int | None = None) -> EventBatch:
    tokens = array("I", range(seq * 100, seq * 100 + 3 * BLOCK)).tobytes()
    return EventBatch("engine", seq, (Stored(tokens, (seq * 10 + 1, seq * 10 + 2, seq * 10 + 3), parent),))


def test_plain_stored_events_go_through_the_native_runs():
    """The batched router stores through ``RadixIndex.store_events`` (once per run, not per event),
    the per-event one never does; pure Python has no runs at all."""
    if native.module is None:  # KVROUTERD_PURE_PYTHON=1: the reference only
        assert not _router("batched").index.stores_events
        return
    calls: dict[str, int] = {}
    for kind in ("batched", "per_event"):
        router = _router(kind)
        store_events = router.index.store_events
        calls[kind] = 0

        def counted(*args: Any, _store: Any = store_events, _kind: str = kind) -> Any:
            calls[_kind] += 1
            return _store(*args)

        router.index.store_events = counted  # type: ignore[method-assign]
        router.apply(_plain_batch(1))
        events = _plain_batch(2).events + _plain_batch(3, parent=13).events + _plain_batch(4).events
        outcome = router.apply(EventBatch("engine", 2, events))
        assert (outcome.blocks_stored, outcome.orphan_blocks) == (9, 0)
    assert calls == {"batched": 2, "per_event": 0}
    assert not _router("pure").index.stores_events


def test_a_chain_salt_that_does_not_encode_is_the_per_event_path_s_error():
    """A model name UTF-8 cannot encode leaves the event to the Python path, which raises as
    ``namespace_seed`` does, on both paths alike."""
    errors = []
    for kind in ("batched", "per_event"):
        router = _router(kind)
        bad = Stored(array("I", range(BLOCK)).tobytes(), (7,), model="\ud800")
        with pytest.raises(UnicodeEncodeError) as exc:
            router.apply(EventBatch("engine", 1, (bad,)))
        errors.append(str(exc.value))
    assert errors[0] == errors[1]


def test_a_run_hands_a_block_nobody_holds_to_the_python_store_loop_and_goes_on():
    """A chain whose first blocks an engine evicted above blocks it kept (held by nobody, still
    indexed) is stored again in a run: the native store stops at the first such block, the
    Python loop (``RadixIndex.store``) stores the rest of that event, its engine hashes are
    mapped and its hook runs, and the run goes on with the next event; the same as one at a time."""
    ev = lambda p, start, n, parent=True: _event("engine", ("stored", p, start, n, 0, "chain" if parent else "unknown",
                                                           False, None))  # noqa: E731
    batches = [
        (ev(0, 0, 5),),
        (Removed((_engine_hash(0, 0, False), _engine_hash(0, 1, False))),),  # blocks 2-4 stay held
        (ev(2, 0, 2), ev(0, 0, 3), ev(0, 3, 2), ev(3, 0, 1)),
    ]
    partials = []
    routers = [_router(kind) for kind in ("batched", "per_event", "pure")]
    if routers[0].index.stores_events:
        store_events = routers[0].index.store_events

        def spied(*args: Any) -> Any:
            result = store_events(*args)
            partials.append(result[3] is not None)
            return result

        routers[0].index.store_events = spied  # type: ignore[method-assign]
    for seq, events in enumerate(batches, start=1):
        outcomes = [r.apply(EventBatch("engine", seq, events)) for r in routers]
        assert outcomes[0] == outcomes[1] == outcomes[2]
    if routers[0].index.stores_events:
        assert partials == [False, True, False]  # the first batch, then the run that met the gap
    snapshots = [_snapshot(r) for r in routers]
    assert snapshots[0] == snapshots[1]
    for snap in (snapshots[0], snapshots[2]):
        snap["workers"] = {wid: state[:-1] + (sorted(state[-1] or []),) for wid, state in snap["workers"].items()}
    assert snapshots[0] == snapshots[2]
    assert [_eviction_order(r) for r in routers[1:]] == [_eviction_order(routers[0])] * 2
