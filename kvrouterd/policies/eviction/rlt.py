"""``rlt``: Randomized Leaf Token eviction (LBGR paper, section 4.1, Algorithm 1).

A marking algorithm (Fiat et al., 1991) on the radix tree, one block per "token":

- every block a request touches on a worker, in path order (its cached prefix, then the
  blocks it stores), is *marked* (lines 6-7);
- when B + 1 distinct blocks have been marked in the current phase, the marks are cleared
  except for the block just touched, which starts the next phase (lines 8-9);
- to evict, an *unmarked leaf* is chosen uniformly at random (lines 13-16); a parent whose
  last held child went becomes a leaf and may be chosen next;
- when no unmarked leaf is left, a new phase starts: marks are cleared except the most
  recently marked block. Only if that block is the one evictable leaf left is it taken too,
  so ``rank`` returns fewer blocks than asked only when nothing else is evictable.

B is the worker's cache capacity in blocks: the ``capacity_blocks`` parameter if set, else
the largest number of blocks the worker has been seen holding when asked to evict (its
capacity once full). Randomness comes from the seeded generator the registry passes in and
candidates are drawn in key order, so a seed fixes every choice.

Parameters (``RLTParams``):
    capacity_blocks = 0   B; 0 = learn it as described above

``rank`` leaves the index untouched; it may start a new phase (policy state only), as the
algorithm does when it runs out of unmarked leaves. The hooks keep the leaves in key order;
a draw is rejection sampling over them (O(log L)), falling back to listing the candidates
(O(L)) only when most leaves are marked. ``rank_steps`` (an ``EvictHint``) draws in parts,
the host serving its loop between them, each draw reading the leaves as they are then. An
instance that saw no hooks for the worker (one built for a hint, not the daemon's policy)
has no order and no marks, so lines 14-15 draw from all its leaves: it lists them in key
order (so a seed still fixes every draw) in parts too, O(L) per call; the daemon's own
``rlt`` never does.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Generator, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field

from ...index.native import u64_map
from ...index.radix import Block, RadixIndex
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from ._leaves import COPY_FACTOR, SortedLeaves, copy_steps, merge_part, run_steps, score_leaves_steps
from ._release import release_steps

__all__ = ["RLTEviction", "RLTParams"]


@dataclass(frozen=True)
class RLTParams:
    capacity_blocks: int = field(default=0, metadata={
        "help": "B, blocks per phase (the cache size); 0 = the most blocks the worker was seen holding"})

    def validate(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {self.capacity_blocks}")


class _Phase:
    __slots__ = ("capacity", "marked", "newest")

    def __init__(self) -> None:
        # a set of the keys, kept as a native uint64 table where the extension is built: a
        # phase marks up to B blocks, and a Python set of 400k int keys cost every full garbage
        # collection ~33 ms on the routing loop (the collector visits each int) and ~52 B a key
        self.marked: MutableMapping[int, int] = u64_map()
        self.newest: int | None = None
        self.capacity = 0


class RLTEviction(EvictionPolicyBase):
    params: RLTParams

    def __init__(self, params: RLTParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self._phases: dict[int, _Phase] = {}
        # the leaves in key order (a fixed order, so a seed fixes every draw)
        self._leaves = SortedLeaves(_no_priority)

    def _phase(self, slot: int) -> _Phase:
        p = self._phases.get(slot)
        if p is None:
            p = self._phases[slot] = _Phase()
        return p

    def _bound(self, phase: _Phase) -> int:
        return self.params.capacity_blocks or phase.capacity

    def marked(self, slot: int) -> frozenset[int]:
        """Keys marked in the current phase on ``slot``."""
        p = self._phases.get(slot)
        return frozenset(p.marked.keys()) if p is not None else frozenset()

    def _mark(self, slot: int, blocks: Sequence[Block]) -> None:
        p = self._phase(slot)
        bound = self._bound(p)
        marked = p.marked
        for b in blocks:
            marked[b.key] = 0
            if bound and len(marked) >= bound + 1:
                marked.clear()
                marked[b.key] = 0
            p.newest = b.key

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._mark(slot, blocks)

    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._mark(slot, blocks)
        self._leaves.stored(index, slot, blocks)

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        self.on_removed_many(index, slot, (block,))

    def on_removed_many(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        self._leaves.removed_many(index, slot, blocks)
        p = self._phases.get(slot)
        if p is not None:
            unmark = p.marked.pop
            for b in blocks:
                unmark(b.key, None)

    def on_cleared(self, slot: int) -> None:
        self._phases.pop(slot, None)
        self._leaves.cleared(slot)

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        phase = self._phases.pop(slot, None)
        return release_steps([*self._leaves.detach(slot), *([phase.marked] if phase is not None else [])], step)

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return run_steps(self.rank_steps(ctx, count, pinned, None))

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        """Algorithm 1, lines 13-16, ``count`` times; in parts of ``merge_part(step)`` draws when
        ``step`` is set, the host applying events between them. Each draw reads the leaves as
        they are then: the hooks' order is indexed afresh, and a candidate that stopped being an
        evictable leaf meanwhile is drawn again (at once no event comes between draws, so the
        same seed gives the same blocks either way)."""
        slot, bit = ctx.slot, 1 << ctx.slot
        p = self._phase(slot)
        p.capacity = max(p.capacity, ctx.index.count(slot))
        order = self._leaves.sorted_view(ctx)
        leaves: list[Block] = []
        if order is None and step is None:  # this instance missed hooks for the slot: list the leaves
            leaves = sorted(ctx.leaves(), key=_key)
        elif order is None:
            leaves = yield from _key_order_steps(ctx, step)
        part = merge_part(step)
        get = ctx.index.get

        def n_base() -> int:
            return len(leaves) if order is None else len(order)

        def candidate(i: int) -> Block:
            n = n_base()
            if i < n:
                return leaves[i] if order is None else order[i][2]
            return extra[i - n]

        def evictable(b: Block) -> bool:
            """Still a leaf of the slot once the blocks taken are gone (events between parts)."""
            return bool(b.holders & bit) and get(b.key) is b and not any(
                c.holders & bit and c.key not in taken for c in b.iter_children())

        extra: list[Block] = []  # parents that became leaves during this call
        chosen: list[Block] = []
        taken: set[int] = set()
        marked = p.marked
        rng = self.rng
        # Draw by rejection sampling (uniform over the acceptable candidates, no list built);
        # once a round of draws fails (most leaves marked), list the candidates for the rest
        # of the call, as Algorithm 1 reads.
        pool: list[Block] | None = None
        held_back: list[Block] = []
        work = 0
        while len(chosen) < count:
            if part is not None and work >= part:
                work = 0
                yield
            block = None
            if pool is None:
                total = n_base() + len(extra)
                for _ in range(_TRIES if total else 0):
                    work += 1
                    b = candidate(rng.randrange(total))
                    if b.key not in taken and b.key not in pinned and b.key not in marked:
                        if step is None or evictable(b):
                            block = b
                            break
                if block is None:
                    if order is None:
                        everything = leaves + extra
                    elif step is None:
                        everything = [e[2] for e in order] + extra
                    else:
                        everything = [e[2] for e in (yield from copy_steps(order, step * COPY_FACTOR))] + extra
                    pool, held_back = [], []
                    for start in range(0, len(everything), part or len(everything) or 1):
                        for b in everything[start : start + (part or len(everything))]:
                            if b.key not in taken and b.key not in pinned:
                                (held_back if b.key in marked else pool).append(b)
                        if part is not None:
                            yield
            if block is None:
                assert pool is not None
                while block is None:
                    if not pool:
                        if not held_back:
                            break
                        # no unmarked leaf left: a new phase unmarks all but the newest block,
                        # which is taken only when it is the last evictable leaf
                        self._new_phase(p)
                        pool = [b for b in held_back if b.key not in marked]
                        held_back = [b for b in held_back if b.key in marked]
                        if not pool:
                            pool, held_back = held_back, []
                    i = rng.randrange(len(pool))
                    b = pool[i]
                    pool[i] = pool[-1]
                    pool.pop()
                    work += 1
                    # between parts a parent promoted here may also have become a leaf by events
                    # and been listed: it is in the pool twice, and taken once
                    if b.key not in taken and (step is None or evictable(b)):
                        block = b
                if block is None:
                    break
            chosen.append(block)
            taken.add(block.key)
            parent = block.parent
            if parent is None or not parent.holders & bit or parent.key in pinned or parent.key in taken:
                continue
            if all(not (c.holders & bit) or c.key in taken for c in parent.iter_children()):
                if pool is None:
                    extra.append(parent)
                else:
                    (held_back if parent.key in marked else pool).append(parent)
        return chosen

    @staticmethod
    def _new_phase(p: _Phase) -> None:
        p.marked.clear()
        if p.newest is not None:
            p.marked[p.newest] = 0


_TRIES = 16


def _no_priority(index: RadixIndex, block: Block, slot: int) -> int:
    return 0


def _key(b: Block) -> int:
    return b.key


#: listing, sorting and merging a leaf for the key order costs ~0.5-1 us, under half of scoring
#: one with a policy's priority, so ``_key_order_steps`` takes this many times ``step`` a part
KEY_ORDER_FACTOR = 2


def _key_order_steps(ctx: EvictionContext, step: int) -> Generator[None, None, list[Block]]:
    """The slot's leaves in key order, sorted and merged ``KEY_ORDER_FACTOR * step`` at a time,
    yielding between parts: listing and sorting 25k leaves at once held the loop 13-46 ms (issue
    #16). Leaves that stop being leaves meanwhile are drawn and dropped (``rank_steps``); ones
    that appear meanwhile are not offered this time."""
    n = step * KEY_ORDER_FACTOR
    runs = []
    for run in score_leaves_steps(ctx, _no_score, frozenset(), n):
        runs.append(run)
        yield
    out: list[Block] = []
    merged = heapq.merge(*runs)
    while True:
        part = [e[2] for e in itertools.islice(merged, n)]
        out.extend(part)
        if len(part) < n:
            break
        yield
    yield from release_steps(runs, n)  # freeing 25k listed entries at once took ~3 ms
    return out


def _no_score(b: Block) -> int:
    return 0
