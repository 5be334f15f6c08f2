"""Router.apply on the native ingest path and on the pure-Python one: the same result, step by step.

The native path hashes a stored chain, stores its new blocks and maps its engine hashes in one C
call (``BlockTable.store_hashed``), else runs the store loop in C (``BlockTable.store_chain``: new
blocks and blocks other workers hold, keys read in place from an ``array('Q')``) and maps engine
hashes in C (``U64Map.map_pairs``),
removes lone leaves in C
(``BlockTable.remove_held``) and keeps the default policy's (``lru``) leaves in C
(``LeafOrder``: its stored hook is one C call). The reference is the Python code each of those
replaces: a ``RadixIndex(pure=True)`` (PyBlocks in a dict), whose leaves go in ``PyLeafOrder``,
a dict of engine hashes and ``chain_split_py``.
Two routers get the same random batches of Stored / Removed / Cleared events (chains from the
root and continuing a parent, shared prefixes, unknown parents, removals of any block, engine
hashes or our keys as hashes); after every batch they must agree on the outcome, every block
(links, holders, stats, pending accesses), each slot's leaves and count, the engine-hash map,
the calls the default eviction policy (``lru``) received, and its eviction order.
CI runs this on the native build and again with ``KVROUTERD_PURE_PYTHON=1`` (both sides pure).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.index.keys import ROOT_SEED, chain_keys_py
from kvrouterd.index.radix import RadixIndex
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies.eviction import _leaves
from kvrouterd.protocols import CacheMode, Cleared, EventBatch, EvictRequest, Removed, Stored
from kvrouterd.router import Router, RouterSettings
from tests.invariants import index_blocks

BLOCK = 16
PROMPTS = 5  # prompts 0 and 1 share their first block, 2 and 3 too
DEPTH = 5  # blocks per prompt


def _block_tokens(prompt: int, j: int) -> bytes:
    owner = prompt // 2 if j == 0 else prompt + 10
    return array("I", [(owner * 100 + j) * BLOCK + t for t in range(BLOCK)]).tobytes()


def _our_key(prompt: int, j: int) -> int:
    data = b"".join(_block_tokens(prompt, i) for i in range(j + 1))
    return chain_keys_py(data, BLOCK, ROOT_SEED)[-1]


def _engine_hash(prompt: int, j: int) -> int:
    # distinct per block content (shared first blocks share it), spread over the whole uint64 range
    owner = prompt // 2 if j == 0 else prompt + 10
    return (0x9E3779B97F4A7C15 * (owner * 100 + j + 1)) % 2**64


class _Recorder:
    """Wraps the router's eviction policy: every hook call, by the keys it was given."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def on_stored(self, index, slot, blocks, info, now):  # type: ignore[no-untyped-def]
        self.calls.append(("stored", slot, [b.key for b in blocks], now))
        self.policy.on_stored(index, slot, blocks, info, now)

    def on_removed_many(self, index, slot, blocks):  # type: ignore[no-untyped-def]
        self.calls.append(("removed", slot, [b.key for b in blocks]))
        self.policy.on_removed_many(index, slot, blocks)

    def on_cleared(self, slot):  # type: ignore[no-untyped-def]
        self.calls.append(("cleared", slot))
        self.policy.on_cleared(slot)


def _router(pure: bool) -> tuple[Router, _Recorder]:
    router = Router(RouterSettings(block_size=BLOCK), ManualClock())
    if pure:
        router.index = RadixIndex(pure=True)
    recorder = _Recorder(router.eviction)
    router.eviction = recorder  # type: ignore[assignment]
    router._policies.eviction_by_name[recorder.policy.name] = recorder  # type: ignore[assignment]
    for wid in ("engine", "sdk"):  # engine hashes of its own / our keys as its hashes
        worker = router.add_worker(WorkerSpec(wid, "h:1", mode=CacheMode.EVENTS))
        if pure:
            worker.engine_keys = {}
    return router, recorder


@contextmanager
def _pure_leaf_tracker(pure: bool) -> Iterator[None]:
    saved = _leaves.chain_split
    if pure:
        _leaves.chain_split = _leaves.chain_split_py
    try:
        yield
    finally:
        _leaves.chain_split = saved


def _snapshot(router: Router) -> dict[str, Any]:
    index = router.index
    blocks = index_blocks(index)
    workers = {}
    for w in router.workers:
        workers[w.id] = (sorted(b.key for b in index.leaves(w.slot)), index.count(w.slot),
                         sorted(w.engine_keys.items()), w.last_sequence, w.state)
    return {"blocks": blocks, "workers": workers}


def _eviction_order(router: Router) -> dict[str, list[int]]:
    out = {}
    for w in router.workers:
        n = router.index.count(w.slot)
        out[w.id] = router.evict_hint(EvictRequest(w.id, n)).keys if n else []
    return out


stored_ev = st.tuples(st.just("stored"), st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1), st.integers(1, DEPTH))
removed_ev = st.tuples(st.just("removed"), st.lists(st.tuples(st.integers(0, PROMPTS - 1), st.integers(0, DEPTH - 1)),
                                                     min_size=1, max_size=6))
cleared_ev = st.tuples(st.just("cleared"))
batch = st.tuples(st.sampled_from(["engine", "sdk"]),
                  st.lists(st.one_of(stored_ev, stored_ev, stored_ev, removed_ev, removed_ev, cleared_ev), min_size=1, max_size=5))


def _event(worker: str, spec: tuple[Any, ...]) -> Any:
    engine = worker == "engine"
    name = _engine_hash if engine else _our_key
    if spec[0] == "stored":
        _, prompt, start, n = spec
        blocks = range(start, min(DEPTH, start + n))
        return Stored(
            token_ids=b"".join(_block_tokens(prompt, j) for j in blocks),
            engine_hashes=tuple(_engine_hash(prompt, j) for j in blocks) if engine else None,
            parent_engine_hash=name(prompt, start - 1) if start else None,
        )
    if spec[0] == "removed":
        return Removed(tuple(name(p, j) for p, j in spec[1]))
    return Cleared()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batch, min_size=1, max_size=12))
def test_apply_gives_the_same_index_hooks_and_eviction_order_on_both_paths(batches):
    routers = [_router(pure=False), _router(pure=True)]
    assert type(routers[1][0].index._blocks) is dict
    sequence = {"engine": 0, "sdk": 0}
    for step, (worker, specs) in enumerate(batches):
        eb = EventBatch(worker, sequence[worker], tuple(_event(worker, s) for s in specs))
        sequence[worker] += 1
        outcomes = []
        for pure, (router, _) in zip((False, True), routers):
            router.clock.advance(1.0)  # type: ignore[attr-defined]
            with _pure_leaf_tracker(pure):
                outcomes.append(router.apply(eb))
        assert outcomes[0] == outcomes[1], step
        (native, native_calls), (pure, pure_calls) = routers
        assert native_calls.calls == pure_calls.calls, step
        assert _snapshot(native) == _snapshot(pure), step
        with _pure_leaf_tracker(False):
            native_order = _eviction_order(native)
        with _pure_leaf_tracker(True):
            assert native_order == _eviction_order(pure), step


def test_the_two_sides_really_take_different_paths():
    """The native router stores through the C loops; the reference does not have them."""
    (native, _), (pure, _) = _router(pure=False), _router(pure=True)
    from kvrouterd.index import native as native_mod

    if native_mod.module is None:  # KVROUTERD_PURE_PYTHON=1: both sides are the reference
        assert not hasattr(native.index._blocks, "store_chain")
        return
    assert hasattr(native.index._blocks, "store_chain") and hasattr(native.workers.get("engine").engine_keys, "map_pairs")
    assert hasattr(native.index._blocks, "store_hashed")
    assert not hasattr(pure.index._blocks, "store_chain") and type(pure.workers.get("engine").engine_keys) is dict
    assert not hasattr(pure.index._blocks, "store_hashed")
    assert _leaves.chain_split is not _leaves.chain_split_py
    for router in (native, pure):
        router.apply(EventBatch("sdk", 0, (_event("sdk", ("stored", 0, 0, 2)),)))
    assert type(native.eviction._leaves._slots[native.workers.get("sdk").slot]) is _leaves.LeafOrder
    assert type(pure.eviction._leaves._slots[pure.workers.get("sdk").slot]) is _leaves.PyLeafOrder
