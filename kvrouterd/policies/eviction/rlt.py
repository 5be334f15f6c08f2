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
algorithm does when it runs out of unmarked leaves. Cost per call: O(L log L) for L leaves.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...index.radix import Block
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from ..registry import register

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
        self.marked: set[int] = set()
        self.newest: int | None = None
        self.capacity = 0


@register("eviction", "rlt", RLTParams)
class RLTEviction(EvictionPolicyBase):
    params: RLTParams

    def __init__(self, params: RLTParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self._phases: dict[int, _Phase] = {}

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
        return frozenset(p.marked) if p is not None else frozenset()

    def _mark(self, slot: int, blocks: Sequence[Block]) -> None:
        p = self._phase(slot)
        bound = self._bound(p)
        marked = p.marked
        for b in blocks:
            marked.add(b.key)
            if bound and len(marked) >= bound + 1:
                marked.clear()
                marked.add(b.key)
            p.newest = b.key

    def on_accessed(self, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._mark(slot, blocks)

    def on_stored(self, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._mark(slot, blocks)

    def on_removed(self, slot: int, block: Block) -> None:
        p = self._phases.get(slot)
        if p is not None:
            p.marked.discard(block.key)

    def on_cleared(self, slot: int) -> None:
        self._phases.pop(slot, None)

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        slot, bit = ctx.slot, 1 << ctx.slot
        p = self._phase(slot)
        p.capacity = max(p.capacity, ctx.index.count(slot))
        leaves = sorted((b for b in ctx.leaves() if b.key not in pinned), key=_key)
        unmarked = [b for b in leaves if b.key not in p.marked]
        chosen: list[Block] = []
        taken: set[int] = set()
        held_back: list[Block] = [b for b in leaves if b.key in p.marked]
        while len(chosen) < count:
            if not unmarked:
                if not held_back:
                    break
                # Only marked leaves remain (the newest block, or this call's promotions of
                # marked parents): a new phase unmarks all but the newest; take the newest last.
                self._new_phase(p)
                unmarked = [b for b in held_back if b.key not in p.marked]
                held_back = [b for b in held_back if b.key in p.marked]
                if not unmarked:
                    unmarked, held_back = held_back, []
            i = self.rng.randrange(len(unmarked))
            block = unmarked[i]
            unmarked[i] = unmarked[-1]
            unmarked.pop()
            chosen.append(block)
            taken.add(block.key)
            parent = block.parent
            if parent is None or not parent.holders & bit or parent.key in pinned:
                continue
            if all(not (c.holders & bit) or c.key in taken for c in parent.iter_children()):
                (held_back if parent.key in p.marked else unmarked).append(parent)
        return chosen

    @staticmethod
    def _new_phase(p: _Phase) -> None:
        p.marked.clear()
        if p.newest is not None:
            p.marked.add(p.newest)


def _key(b: Block) -> int:
    return b.key
