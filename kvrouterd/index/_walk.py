"""The match walk: per-slot longest cached prefix of a request, in one pass over its keys.

This is on every Route's path (about a third of a decision at 250 blocks), so it lives on
its own where the native fast path (``_native``, built from ``_native.c`` when a compiler is
available) can replace it, for any number of worker slots; both implementations are held to the
same results by tests. The native one answers with an ``Overlaps`` mapping instead of a dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import native

if TYPE_CHECKING:
    from .block import Block

__all__ = ["MatchResult", "match_walk", "match_walk_py"]


def match_walk_py(blocks: Mapping[int, Any], keys: Sequence[int], slots_mask: int) -> tuple[dict[int, int], list[Any]]:
    """``(overlaps, path)``: slot -> leading blocks of ``keys`` it holds (slots in ``slots_mask``
    holding at least one), and the request's blocks present in the index up to the deepest match.
    ``blocks`` maps key -> Block (anything with an int ``holders`` bitmask over slots)."""
    get = blocks.get
    overlaps: dict[int, int] = {}
    path: list[Any] = []
    active = slots_mask
    depth = 0
    for key in keys:
        node = get(key)
        if node is None:
            break
        still = active & node.holders
        if still != active:
            dropped = active ^ still
            if depth:
                while dropped:
                    low = dropped & -dropped
                    overlaps[low.bit_length() - 1] = depth
                    dropped ^= low
            active = still
            if not active:
                break
        path.append(node)
        depth += 1
    if depth:
        while active:
            low = active & -active
            overlaps[low.bit_length() - 1] = depth
            active ^= low
    return overlaps, path


if native.module is not None:
    # the native walk returns its overlaps as an ``Overlaps``: a read-only mapping over an array
    # indexed by slot, equal to (and iterating like) the dict above, for masks of any width
    Mapping.register(native.module.Overlaps)
    match_walk = native.module.match_walk
else:
    match_walk = match_walk_py


@dataclass(slots=True, eq=False)
class MatchResult:
    """Longest cached prefix per worker slot, found in one walk."""

    #: slot -> number of leading request blocks that slot holds (only slots > 0): a dict, or
    #: the native walk's read-only ``Overlaps`` mapping equal to it (``index._walk``)
    overlaps: Mapping[int, int]
    #: the request's blocks present in the index, up to the deepest match
    path: list[Block]

    def overlap(self, slot: int) -> int:
        return self.overlaps.get(slot, 0)
