"""The match walk: per-slot longest cached prefix of a request, in one pass over its keys.

This is on every Route's path (about a third of a decision at 250 blocks), so it lives on
its own where the native fast path (``_native``, built from ``_native.c`` when a compiler is
available) can replace it; both implementations are held to the same results by tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import native

__all__ = ["match_walk", "match_walk_py"]


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


def _match_walk_native(blocks: Mapping[int, Any], keys: Sequence[int], slots_mask: int) -> tuple[dict[int, int], list[Any]]:
    result = _native_walk(blocks, keys, slots_mask)
    if result is NotImplemented:  # more than 64 worker slots: Python's ints have no width limit
        return match_walk_py(blocks, keys, slots_mask)
    return result  # type: ignore[no-any-return]


if native.module is not None:
    _native_walk = native.module.match_walk
    match_walk = _match_walk_native
else:
    match_walk = match_walk_py
