"""Per-group presence of engine blocks, for engines with hybrid KV-cache groups.

vLLM's hybrid allocator keeps one KV-cache group per attention kind (full attention,
sliding window, ...), and every group publishes ``BlockStored`` / ``BlockRemoved`` for the
same block hashes, tagged with ``group_idx`` (and, on newer versions, the group's
``kv_cache_spec_kind``). A sliding-window group drops blocks that fall out of its window
long before the full-attention group does; those removals must not take the block out of
the router's view while a group that can serve the prefix still holds it.

A block counts as cached while any *prefix-reusable* group holds it. Full attention (and
any group whose kind we are not told) is prefix-reusable; sliding-window, chunked-local
and state-space (mamba) groups keep only a suffix, so they cannot serve a prefix on their
own. When an engine reports no reusable group at all (a pure sliding-window model) every
group counts, so its cache stays visible.

Tracking starts only when a worker shows a second group: engines with one group (the
common case) pay nothing. Blocks stored before that are taken to be held by the first group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["NON_PREFIX_KINDS", "GroupPresence"]

#: ``kv_cache_spec_kind`` values whose groups keep only a suffix of the prompt
NON_PREFIX_KINDS = frozenset({"sliding_window", "chunked_local_attention", "local_attention", "mamba"})


class GroupPresence:
    """Engine hash -> bitmask of the groups holding it (one worker)."""

    __slots__ = ("_first", "_masks", "_non_reusable", "_seen")

    def __init__(self) -> None:
        self._first: int | None = None
        self._seen = 0
        self._non_reusable = 0
        self._masks: dict[int, int] = {}

    @property
    def tracking(self) -> bool:
        return self._seen & (self._seen - 1) != 0  # two or more groups seen

    def learn(self, group: int, kind: str | None) -> None:
        if self._first is None:
            self._first = group
        self._seen |= 1 << group
        if kind is not None:
            if kind.lower() in NON_PREFIX_KINDS:
                self._non_reusable |= 1 << group
            else:
                self._non_reusable &= ~(1 << group)

    def _reusable(self, mask: int) -> bool:
        reusable = self._seen & ~self._non_reusable
        return bool(mask & reusable) if reusable else bool(mask)

    def _mask(self, engine_hash: int, held_before: Callable[[int], bool]) -> int:
        mask = self._masks.get(engine_hash)
        if mask is None:  # stored before tracking began: by the first group, if at all
            return 1 << self._first if self._first is not None and held_before(engine_hash) else 0
        return mask

    def stored(self, group: int, engine_hashes: Sequence[int], held_before: Callable[[int], bool]) -> bool:
        """Record a store by ``group``; True if the router should index these blocks.
        ``held_before(hash)`` says whether the worker held the block before this store."""
        if not self.tracking:
            return self._reusable(1 << group)
        bit = 1 << group
        masks = self._masks
        for eh in engine_hashes:
            masks[eh] = self._mask(eh, held_before) | bit
        return self._reusable(bit)

    def removed(self, group: int | None, engine_hash: int, held_before: Callable[[int], bool]) -> bool:
        """Record a removal by ``group`` (None: every group); True if the router should drop
        the block because no prefix-reusable group holds it any longer."""
        if not self.tracking:
            return True
        mask = 0 if group is None else self._mask(engine_hash, held_before) & ~(1 << group)
        if mask:
            self._masks[engine_hash] = mask
        else:
            self._masks.pop(engine_hash, None)
        return not self._reusable(mask)

    def clear(self) -> None:
        self._masks.clear()
