"""Invariants of a Router's index and load that hold after any sequence of calls.

The reference-free checks of ``tests/unit/index/test_radix.py``'s state machine (no dead
block lingers, parent and child links agree, counts and leaves match the blocks a slot
holds), plus the worker registry's bookkeeping, so tests that drive a whole daemon (the
gRPC fuzz test) can assert them without a reference model.
"""

from __future__ import annotations

from typing import Any

from kvrouterd.index.radix import RadixIndex
from kvrouterd.router import Router, request_bytes


def index_blocks(index: RadixIndex) -> dict[int, tuple[Any, ...]]:
    """Every indexed block as two index paths must leave it alike: its parent's key, its
    children's keys, holders, last access, hits and pending accesses."""
    blocks = {}
    for key in list(index._blocks):
        b = index._blocks[key]
        c = b.children
        children = None if c is None else sorted(c) if type(c) is dict else c.key
        blocks[key] = (b.parent.key if b.parent is not None else None, children, b.holders,
                       b.last_access, b.hits, index._pending.get(b))
    return blocks


def check_router_invariants(router: Router) -> None:
    index = router.index
    owned = 0
    for w in router.workers:
        owned |= 1 << w.slot
    unheld = 0
    for key in list(index._blocks):
        block = index.get(key)
        unheld += not block.holders
        assert block is not None and block.key == key
        # every indexed block is held by someone or has a descendant that is
        assert block.holders or block.children is not None, f"dead block {key:#x}"
        # only registered workers hold blocks once a removal's drain has finished
        assert block.holders & ~owned == 0, f"block {key:#x} held by slots {block.holders & ~owned:#x} nobody owns"
        parent = block.parent
        if parent is not None:
            assert index.get(parent.key) is parent
            assert any(c is block for c in parent.iter_children()), f"block {key:#x} missing from its parent's children"
    assert index.unheld == unheld, "the index's count of blocks no slot holds"
    for w in router.workers:
        held = list(index.blocks_of(w.slot))
        assert index.count(w.slot) == len(held), w.id
        assert all(b.holders >> w.slot & 1 for b in held), w.id
        held_keys = {b.key for b in held}
        assert {b.key for b in index.leaves(w.slot)} <= held_keys, w.id
        assert w.inflight_requests >= 0 and w.pending_prefill_tokens >= 0, w.id
    assert sum(w.inflight_requests for w in router.workers) == router.workers.inflight_count
    requests = router._ledger.requests
    assert router.inflight_bytes == sum(request_bytes(router.request(rid)) for rid in requests)
    assert all(router.workers.inflight(rid) is not None for rid in requests)


def index_state(router: Router) -> tuple[dict[int, tuple[int | None, frozenset[str]]], dict[str, dict[int, int]], int]:
    """What a replica restored from ``router`` (a snapshot, ``warm_from``) must equal: every
    indexed block's parent key and holders (as worker ids: slots differ between replicas),
    held or not, each worker's engine-hash map, and the block count routing reports."""
    index = router.index
    by_slot = {w.slot: w.id for w in router.workers}
    blocks = {}
    for key in list(index._blocks):
        block = index.get(key)
        holders = frozenset(wid for slot, wid in by_slot.items() if block.holders >> slot & 1)
        blocks[key] = (block.parent.key if block.parent is not None else None, holders)
    engine_hashes = {w.id: dict(w.engine_keys.items()) for w in router.workers}
    return blocks, engine_hashes, router.indexed_blocks
