"""Leaf-ordered eviction shared by the leaf policies (LRU, LFU, hybrid, T-LRU, ...).

Every leaf policy evicts the worker's *leaves* (held blocks with no held child) lowest
priority first, and a parent joins the candidates once its last held child has been chosen.
They differ only in the priority. Two ways to produce that order:

- ``rank_leaves_by``: stateless; heapifies all leaves per call, O(L + k log L).
- ``SortedLeaves``: a per-slot sorted set of the leaves, kept current by the policy hooks
  (``on_stored``/``on_accessed``/``on_removed``/``on_cleared``), so a call costs O(k log L).
  It only works for priorities that change when a hook fires (recency, hit counts), not for
  ones that drift with the clock. A policy instance that has not seen every hook for a slot
  (e.g. one built lazily for a single ``EvictHint``) is detected by its leaf count differing
  from the index's and falls back to ``rank_leaves_by``, so ``rank`` is always correct.

Neither changes the index.

An ``EvictHint`` ranks in parts, the daemon serving its loop between them (issue #16 item 1:
1,024 blocks ranked at once held it 4-58 ms at 400k blocks): ``merge_promoting_steps`` takes
``step // MERGE_DIVISOR`` entries of work a part, reading a private copy of the policy's order
(``copy_steps``, made in parts too) or the runs the host scored, so events applied between parts
cannot change what it iterates; the host then drops what they made wrong to name
(``still_evictable``). Run at once (``step`` None) the same code gives what ``rank`` gives.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from sortedcontainers import SortedList

from ...index import native
from ...index.radix import Block, Pending, RadixIndex, fold_pending
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from ._release import release_steps

__all__ = [
    "SortedLeaves", "SortedRun", "chain_split", "copy_steps", "guarded", "held_child_other_than", "merge_part",
    "merge_promoting", "merge_promoting_steps", "rank_leaves_by", "rank_leaves_by_steps", "run_steps",
    "score_leaves_steps", "still_evictable",
]

_T = TypeVar("_T")


def chain_split_py(blocks: Sequence[Block], prio: dict[Block, Any]) -> tuple[list[Block], list[Block]]:
    """The blocks a stored chain continues from (``blocks[i + 1].parent is blocks[i]``) that
    are in ``prio``, and the blocks it does not continue from (the last one included)."""
    continued: list[Block] = []
    ends: list[Block] = []
    last = len(blocks) - 1
    for i, b in enumerate(blocks):
        if i < last and blocks[i + 1].parent is b:
            if b in prio:
                continued.append(b)
        else:
            ends.append(b)
    return continued, ends


def _chain_split_native(blocks: Sequence[Block], prio: dict[Block, Any]) -> tuple[list[Block], list[Block]]:
    if type(blocks) is list and type(prio) is dict:
        return native.module.chain_split(blocks, prio)  # type: ignore[union-attr,no-any-return]
    return chain_split_py(blocks, prio)


#: chain_split_py, or the same loop in C (``_native.c``) where the extension is built
chain_split = _chain_split_native if native.module is not None else chain_split_py
#: the C loop itself, for callers that know their arguments are a list and a dict (and call it
#: only while ``chain_split`` is the native one: a test swaps in the reference)
_native_split = native.module.chain_split if native.module is not None else None


def held_child_other_than(node: Block, bit: int, exclude: Block | None) -> bool:
    for c in node.iter_children():
        if c is not exclude and c.holders & bit:
            return True
    return False


def merge_promoting(
    ctx: EvictionContext,
    ordered: Iterator[tuple[Any, int, Block]],
    count: int,
    pinned: frozenset[int],
    priority: Callable[[Block], Any],
) -> list[Block]:
    """``merge_promoting_steps`` at once (no part ends early)."""
    return run_steps(merge_promoting_steps(ctx, ordered, count, pinned, priority, None))


def merge_promoting_steps(
    ctx: EvictionContext,
    ordered: Iterator[tuple[Any, int, Block]],
    count: int,
    pinned: frozenset[int],
    priority: Callable[[Block], Any],
    part: int | None,
) -> Generator[None, None, list[Block]]:
    """Take up to ``count`` blocks from ``ordered`` (leaves, ascending ``(priority, key, block)``),
    merging in parents as their last held child is taken. Pinned blocks are never taken, and
    a pinned block's ancestors never become leaves. Yields after every ``part`` entries read
    from ``ordered`` or parents promoted (None: never), so a host can serve its loop between
    parts; ``ordered`` must then stay valid across them (a private copy, ``copy_steps``).

    A promoted parent is scored as the leaf it becomes once the chosen blocks are removed:
    with the path accesses pending below it folded in (``RadixIndex.as_leaf``), which are
    carried up as blocks are chosen rather than found again by walking the chosen subtree.
    A key read twice (an entry copied again after its priority rose between parts) is taken once."""
    slot = ctx.slot
    bit = 1 << slot
    pending, as_leaf = ctx.index.pending, ctx.index.as_leaf
    promoted: list[tuple[Any, int, Block]] = []
    chosen: list[Block] = []
    taken: set[int] = set()
    # key of a chosen promoted parent -> the accesses pending in its subtree
    folded: dict[int, Pending | None] = {}
    work = 0  # entries read and parents scored since the last part ended
    nxt = next(ordered, None)
    while len(chosen) < count:
        while nxt is not None and (nxt[1] in pinned or nxt[1] in taken):
            nxt = next(ordered, None)
            work += 1
        if promoted and (nxt is None or promoted[0][:2] < nxt[:2]):
            _, key, block = heapq.heappop(promoted)
            if key in taken:  # read from the stream meanwhile (events between parts made it a leaf)
                continue
        elif nxt is not None:
            _, key, block = nxt
            nxt = next(ordered, None)
        else:
            break
        chosen.append(block)
        taken.add(key)
        work += 1
        if part is not None and work >= part:
            work = 0
            yield
        parent = block.parent
        if parent is None or not parent.holders & bit or parent.key in pinned or parent.key in taken:
            continue
        if all(not (c.holders & bit) or c.key in taken for c in parent.iter_children()):
            up = pending(parent, slot)
            for c in parent.iter_children():
                if c.holders & bit:
                    up = fold_pending(up, folded[c.key] if c.key in folded else pending(c, slot))
            folded[parent.key] = up
            heapq.heappush(promoted, (priority(as_leaf(parent, slot, up)), parent.key, parent))
            work += 1
    return chosen


def run_steps(steps: Generator[None, None, _T]) -> _T:
    """What a steps generator returns, run to the end at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


class SortedRun(list):  # type: ignore[type-arg]
    """A private sorted copy of a policy's leaf order (``copy_steps``), read by the same code that
    reads the live ``SortedList`` (``bisect_left``, ``islice``), which events may change between
    the parts of a hint while this stays as it was copied."""

    def bisect_left(self, value: Any) -> int:
        return bisect.bisect_left(self, value)

    def islice(self, start: int, stop: int) -> Iterator[Any]:
        return map(self.__getitem__, range(start, stop))


def copy_steps(order: LeafOrder | PyLeafOrder, step: int) -> Generator[None, None, SortedRun]:
    """``order`` (``(priority, key, block)`` entries, distinct keys) copied ``step`` entries per
    part, yielding between parts. Each part continues after the last entry copied by value, not
    position (``part``), so events between parts never make the copy unsorted: an entry added or
    re-scored behind the cursor is missed (the hint is advice about the order as it was being
    read), one re-scored ahead of it may be copied twice (``merge_promoting_steps`` takes a key once)."""
    out = SortedRun()
    cursor: tuple[Any, int] | None = None
    while True:
        part = order.part(cursor, step)
        out.extend(part)
        if len(part) < step:
            return out
        prio, key, _ = part[-1]
        cursor = (prio, key)
        yield


def still_evictable(ctx: EvictionContext, ranked: Sequence[Block]) -> list[Block]:
    """``ranked`` less what events applied while it was ranked in parts made wrong to name: a
    block the slot no longer holds (or whose key now names another block), and a block that has
    a held child not named before it (stored below it meanwhile, or a child dropped here). What
    is left keeps the order, so every held child of a named block is still named before it."""
    bit, get = 1 << ctx.slot, ctx.index.get
    kept: list[Block] = []
    named: set[int] = set()
    for b in ranked:
        key = b.key
        if not b.holders & bit or get(key) is not b:
            continue
        if b.children is not None and any(c.holders & bit and c.key not in named for c in b.iter_children()):
            continue
        kept.append(b)
        named.add(key)
    return kept


def rank_leaves_by(ctx: EvictionContext, count: int, pinned: frozenset[int], priority) -> list[Block]:  # type: ignore[no-untyped-def]
    """Pop up to ``count`` leaves lowest ``priority(block)`` first, promoting parents as they empty.
    Leaves the host already scored (``ctx.scored``) are read from there instead."""
    return run_steps(rank_leaves_by_steps(ctx, count, pinned, priority, None))


def rank_leaves_by_steps(ctx: EvictionContext, count: int, pinned: frozenset[int], priority: Callable[[Block], Any],
                         step: int | None) -> Generator[None, None, list[Block]]:
    """``rank_leaves_by`` taking the blocks in parts (``merge_part(step)``) when the host scored
    the leaves in steps (``ctx.scored``); scoring them here is done at once."""
    if ctx.scored is not None:
        return (yield from merge_promoting_steps(ctx, _still_leaves(ctx, ctx.scored), count, pinned, priority,
                                                 merge_part(step)))
    heap = [(priority(b), b.key, b) for b in ctx.leaves() if b.key not in pinned]
    heapq.heapify(heap)

    def drain() -> Iterator[tuple[Any, int, Block]]:
        while heap:
            yield heapq.heappop(heap)

    return (yield from merge_promoting_steps(ctx, drain(), count, pinned, priority, merge_part(step)))


#: a part of a ranking in steps takes ``step // MERGE_DIVISOR`` entries (read or promoted): each
#: costs a priority, heap operations and a leaf check in Python, about 4 times what scoring a leaf
#: in ``score_leaves_steps`` costs, so a part is about as long as a scoring part
MERGE_DIVISOR = 4
#: copying a policy's own order costs ~50 ns an entry against a few us for scoring or merging one,
#: so ``copy_steps`` takes this many times ``step`` entries a part
COPY_FACTOR = 16


def merge_part(step: int | None) -> int | None:
    return None if step is None else max(1, step // MERGE_DIVISOR)


def guarded(ctx: EvictionContext, ordered: Iterator[tuple[Any, int, Block]], step: int | None,
            ) -> Iterator[tuple[Any, int, Block]]:
    """``ordered`` as ``merge_promoting_steps`` reads it: at once, as it is; in parts (a copy of
    the order, events between them), without the entries that stopped being leaves meanwhile."""
    return ordered if step is None else _still_leaves(ctx, ordered)


def _still_leaves(ctx: EvictionContext, scored: Iterator[tuple[Any, int, Block]]) -> Iterator[tuple[Any, int, Block]]:
    """``scored`` without the blocks that stopped being leaves of the slot since they were
    scored (the host applied events between its steps). Leaves that appeared meanwhile are not
    in it: the hint is advice about the cache as it was while it was being scored."""
    bit, get = 1 << ctx.slot, ctx.index.get
    for entry in scored:
        b = entry[2]
        if b.holders & bit and get(entry[1]) is b and not held_child_other_than(b, bit, None):
            yield entry


def score_leaves_steps(ctx: EvictionContext, priority: Callable[[Block], Any], pinned: frozenset[int],
                       step: int) -> Iterator[list[tuple[Any, int, Block]]]:
    """The slot's leaves as sorted runs of ``(priority(block), key, block)``, scoring at most
    ``step`` per part; each part yields the run it made. Merged (``heapq.merge``) they are the
    order ``rank_leaves_by`` pops; between parts the index may change (``_still_leaves``)."""
    bit = 1 << ctx.slot
    leaves = list(ctx.leaves())
    for start in range(0, len(leaves), step):
        run = [(priority(b), b.key, b) for b in leaves[start : start + step] if b.holders & bit and b.key not in pinned]
        run.sort()
        yield run


#: a leaf's priority: ``(index, block, slot) -> comparable``; it reads the block's stats through
#: the index, which keeps the accesses pending on it (``RadixIndex.recency``/``hits``)
Priority = Callable[[RadixIndex, Block, int], Any]


class PyLeafOrder(SortedList):
    """A slot's leaves as ``(priority, key, block)`` in order (a ``SortedList``) and each leaf's
    priority by Block (``prio``, hashed by identity as the index's leaf sets are: a native
    Block's key would be a new int object at every lookup). The reference of the native
    ``LeafOrder`` (``_native.c``), which has the same methods below for priorities that are real
    numbers; any other priority (a tuple) is kept here."""

    def __init__(self) -> None:
        super().__init__()
        self.prio: dict[Block, Any] = {}

    def put(self, block: Block, priority: Any) -> None:
        """``block`` is a leaf at ``priority`` (re-scored if it was one)."""
        old = self.prio.get(block, _MISSING)
        key = block.key
        if old is not _MISSING:
            if old == priority:
                return
            self.remove((old, key, block))
        self.prio[block] = priority
        self.add((priority, key, block))

    def drop(self, block: Block) -> None:
        """``block`` is no leaf (nothing if it was none)."""
        old = self.prio.pop(block, _MISSING)
        if old is not _MISSING:
            self.remove((old, block.key, block))

    def holds(self, block: Block) -> bool:
        return block in self.prio

    def accessed(self, index: RadixIndex, slot: int, block: Block, priority: Priority) -> None:
        """A Route reused ``slot``'s chain ending at ``block``: a leaf here is re-scored."""
        if block in self.prio:
            self.put(block, priority(index, block, slot))

    def get(self, block: Block, default: Any = None) -> Any:
        """``block``'s priority."""
        return self.prio.get(block, default)

    def part(self, after: tuple[Any, int] | None, n: int) -> list[tuple[Any, int, Block]]:
        """Up to ``n`` entries in order, those above ``after`` (``(priority, key)``; None: from the
        first). ``(priority, key + 1)`` is the least value above every ``(priority, key, block)``."""
        return list(itertools.islice(self.irange(minimum=None if after is None else (after[0], after[1] + 1)), n))

    def clear(self) -> None:
        super().clear()
        self.prio.clear()

    def stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], priority: Priority) -> None:
        """The leaf tracker's hook for a chain ``slot`` just stored (``SortedLeaves.stored``)."""
        # A block whose successor in the stored chain is its child has a held child now, so it
        # is no leaf: drop it (a no-op for the usual brand-new block) without scanning its
        # children. Only the chain's parent, its last block and any block the chain does not
        # continue from need the full check. This hook runs for every stored block of every
        # engine event, so the difference is most of its cost.
        prio = self.prio
        if chain_split is _chain_split_native and type(blocks) is list:
            continued, ends = _native_split(blocks, prio)
        else:
            continued, ends = chain_split(blocks, prio)
        for b in continued:
            self.drop(b)
        first = blocks[0].parent
        bit = 1 << slot
        for b in ends if first is None else [first, *ends]:
            # a block with no children has no held child: no need to look
            if b.holders & bit and (b.children is None or not held_child_other_than(b, bit, None)):
                self.put(b, priority(index, b, slot))
            else:
                self.drop(b)


#: the native container of a slot's leaves by a numeric priority (``_native.c``), or None
LeafOrder = None if native.module is None else native.module.LeafOrder


def leaf_order(index: RadixIndex, numeric: bool) -> LeafOrder | PyLeafOrder:
    """An empty container for a slot's leaves: the native ``LeafOrder`` for a ``numeric``
    priority (a float or an int: what it keeps as a double) over the extension's Blocks, else the
    reference ``PyLeafOrder`` (any priority, any Block)."""
    if numeric and LeafOrder is not None and index.native_blocks:
        return LeafOrder()
    return PyLeafOrder()


class SortedLeaves:
    """Per-slot leaves sorted by ``priority(index, block, slot)``; see the module docstring.
    ``numeric``: the priority is always a real number (lru's recency), so a slot's leaves are
    kept in the native ``LeafOrder`` where the index's Blocks are native (``leaf_order``)."""

    def __init__(self, priority: Priority, numeric: bool = False) -> None:
        self.priority = priority
        self.numeric = numeric
        self._slots: dict[int, LeafOrder | PyLeafOrder] = {}

    def _slot(self, index: RadixIndex, slot: int) -> LeafOrder | PyLeafOrder:
        s = self._slots.get(slot)
        if s is None:
            s = self._slots[slot] = leaf_order(index, self.numeric)
        return s

    def refresh(self, index: RadixIndex, slot: int, blocks: Iterable[Block], exclude: Block | None = None) -> None:
        """Recompute leaf status and priority of ``blocks`` (``exclude``: a child being removed)."""
        s = self._slot(index, slot)
        bit = 1 << slot
        for b in blocks:
            if b.holders & bit and not held_child_other_than(b, bit, exclude):
                s.put(b, self.priority(index, b, slot))
            else:
                s.drop(b)

    def rescore(self, index: RadixIndex, slot: int, keys: Iterable[int]) -> None:
        """Recompute the priority of those of ``keys`` that are leaves of ``slot`` (what the
        priority reads changed; which blocks are leaves did not)."""
        s = self._slots.get(slot)
        if s is None:
            return
        for k in keys:
            b = index.get(k)
            if b is not None and s.holds(b):
                s.put(b, self.priority(index, b, slot))

    # ---- hooks ---------------------------------------------------------------------------
    def stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        """``slot`` stored the chain ``blocks`` (``EvictionPolicy.on_stored``): one call into its
        container (natively, the whole hook in C: it runs for every stored engine event)."""
        if blocks:
            s = self._slots.get(slot)  # _slot written out: once per stored event
            if s is None:
                s = self._slot(index, slot)
            s.stored(index, slot, blocks, self.priority)

    def native_stored(self, slot: int) -> tuple[LeafOrder, Priority] | None:
        """``(container, priority)`` when ``stored`` for ``slot`` is one native call,
        ``container.stored(index, slot, blocks, priority)`` (the slot's leaves are in a native
        ``LeafOrder``), for a host that makes that call itself in C; else None. A slot with no
        container yet has none: ``stored`` makes it."""
        s = self._slots.get(slot)
        if s is None or type(s) is not LeafOrder:
            return None
        return s, self.priority

    def accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        """``blocks`` is a chain the slot holds (``EvictionPolicy.on_accessed``): only its last
        block can be a leaf, and only leaves' priorities are kept."""
        s = self._slots.get(slot)
        if s is not None and blocks:
            s.accessed(index, slot, blocks[-1], self.priority)

    def removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        """Called before the index drops ``block`` from ``slot``."""
        self._slot(index, slot).drop(block)
        if block.parent is not None:
            self.refresh(index, slot, (block.parent,), exclude=block)

    def removed_many(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        """``removed`` for each of ``blocks`` in turn, the index dropping each after its call
        (``EvictionPolicy.on_removed_many``), in one pass: leaf status depends only on what the
        slot still holds once all are gone, and a parent's score does not change as its children
        go (the index moves their pending accesses up to it), so only parents that stay are
        re-scored, each once, where per block a chain removed leaf first would make each of its
        blocks a leaf and then drop it again."""
        s = self._slot(index, slot)
        if len(blocks) == 1:
            self.removed(index, slot, blocks[0])
            return
        gone = {b.key for b in blocks}
        for b in blocks:
            s.drop(b)
        bit = 1 << slot
        seen: set[int] = set()
        for b in blocks:
            parent = b.parent
            if parent is None or parent.key in gone or parent.key in seen or not parent.holders & bit:
                continue
            seen.add(parent.key)
            # it held b, so it was no leaf: it is one now unless a child it keeps is held
            if not any(c.holders & bit and c.key not in gone for c in parent.iter_children()):
                s.put(parent, self.priority(index, parent, slot))

    def cleared(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def detach(self, slot: int) -> list[Any]:
        """Forget ``slot`` as ``cleared`` does; its containers, for ``release_steps``."""
        s = self._slots.pop(slot, None)
        if s is None:
            return []
        # a PyLeafOrder's dict of leaves goes a part at a time, its SortedList at once; a native
        # LeafOrder at once too (one array of entries per ~256-512 leaves, no object per entry)
        return [s.prio, s] if isinstance(s, PyLeafOrder) else [s]

    # ---- ranking -------------------------------------------------------------------------
    def sorted_view(self, ctx: EvictionContext) -> LeafOrder | PyLeafOrder | None:
        """The slot's leaves as ``(priority, key, block)`` in order (iterated; a PyLeafOrder is
        also read as the SortedList it is), or None when this tracker has not seen every hook for
        the slot (the caller must then rank from the index)."""
        s = self._slots.get(ctx.slot)
        if s is None or len(s) != len(ctx.index.leaves(ctx.slot)):
            return None
        return s

    def priority_for(self, ctx: EvictionContext) -> Callable[[Block], Any]:
        index, slot, prio = ctx.index, ctx.slot, self.priority

        def priority(b: Block) -> Any:
            return prio(index, b, slot)

        return priority

    def view_steps(self, ctx: EvictionContext, step: int | None,
                   ) -> Generator[None, None, LeafOrder | PyLeafOrder | SortedRun | None]:
        """``sorted_view`` as a ranking in parts reads it: the live order at once (``step`` None),
        else a copy made ``COPY_FACTOR * step`` entries a part (``copy_steps``), which events
        between the ranking's parts cannot change under it."""
        order = self.sorted_view(ctx)
        if order is None or step is None:
            return order
        return (yield from copy_steps(order, step * COPY_FACTOR))

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return run_steps(self.rank_steps(ctx, count, pinned, None))

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   priority: Callable[[Block], Any] | None = None,
                   arrange: Callable[[Any], Iterator[tuple[Any, int, Block]]] = iter,
                   ) -> Generator[None, None, list[Block]]:
        """Take up to ``count`` blocks in parts (``merge_promoting_steps``) from the kept order,
        read through ``arrange`` (a policy's merge of its classes, its trimmed first, ...), or
        from the leaves scored by ``priority`` (default ``priority_for``) where it has no order."""
        if priority is None:
            priority = self.priority_for(ctx)
        order = yield from self.view_steps(ctx, step)
        if order is None:
            return (yield from rank_leaves_by_steps(ctx, count, pinned, priority, step))
        ranked = yield from merge_promoting_steps(ctx, guarded(ctx, arrange(order), step), count, pinned, priority,
                                                  merge_part(step))
        if step is not None:
            # the private copy is freed in parts: a native order's copy is a new tuple, float and
            # int per leaf, and 12,500 of them freed with the generator held the loop ~2 ms
            yield from release_steps([order], step)
        return ranked


_MISSING = object()


class LeafOrderPolicy(EvictionPolicyBase):
    """An eviction policy that is a fixed priority over leaves (LRU, LFU): the hooks keep a
    SortedLeaves current and ``rank`` reads it."""

    def __init__(self, params: object, rng: random.Random, priority: Priority, numeric: bool = False) -> None:
        super().__init__(params, rng)
        self._leaves = SortedLeaves(priority, numeric)

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return self._leaves.rank(ctx, count, pinned)

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        return self._leaves.rank_steps(ctx, count, pinned, step)

    def leaf_priority(self, ctx: EvictionContext) -> Callable[[Block], Any] | None:
        return self._leaves.priority_for(ctx) if self._leaves.sorted_view(ctx) is None else None

    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._leaves.stored(index, slot, blocks)

    def native_stored_hook(self, slot: int) -> tuple[LeafOrder, Priority] | None:
        """``(container, priority)`` whose ``container.stored(index, slot, blocks, priority)`` is
        exactly ``on_stored`` for ``slot`` (which reads no ``info`` nor ``now``), for a host
        storing many chains in one native call (``RadixIndex.store_events``); None when it is
        not one native call, or a subclass changed ``on_stored``."""
        if type(self).on_stored is not LeafOrderPolicy.on_stored:
            return None
        return self._leaves.native_stored(slot)

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._leaves.accessed(index, slot, blocks)

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        self.on_removed_many(index, slot, (block,))

    def on_removed_many(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        self._leaves.removed_many(index, slot, blocks)

    def on_cleared(self, slot: int) -> None:
        self._leaves.cleared(slot)

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        return release_steps(self._leaves.detach(slot), step)
