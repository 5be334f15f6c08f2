"""Each worker's block key -> engine hash map that eviction hints answer in: built on its first hint, then kept current.

An engine names its blocks by its own hashes (vLLM's and SGLang's block hashes); the index
keys them by the router's chained keys, and ``Worker.engine_keys`` maps engine hash -> key as
events arrive. An eviction hint must answer in the engine's hashes, so a worker that asks for
one gets the reverse map, built once in parts (``steps``: in one go it held the loop ~185 ms
at 400k blocks, issue #16) and then kept current by the Stored and Removed handlers
(``events``); it moves with a cleared worker to its fresh slot and is released in steps with
a removed worker's blocks (``slots``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, MutableMapping
from typing import Any

from ..index.native import u64_map
from ..index.workers import Worker

__all__ = ["EngineHashMaps", "invert_steps"]


def invert_steps(mapping: Any, into: MutableMapping[int, int], step: int) -> Iterator[None]:
    """Add ``key -> engine hash`` to ``into`` for each pair of a worker's ``engine_keys``, at
    most ``step`` pairs per part. The pairs are read from one copy taken at the first part (a
    native map's in one C call that makes no int object); between parts the caller may change
    ``mapping`` and ``into``: a pair removed meanwhile is skipped, one ``into`` has meanwhile wins."""
    packed = getattr(mapping, "packed_items", None)
    pairs: Any = memoryview(packed()).cast("Q") if packed is not None else [x for kv in mapping.items() for x in kv]
    get = mapping.get
    for start in range(0, len(pairs), 2 * step):
        part = pairs[start : start + 2 * step]
        part = part.tolist() if isinstance(part, memoryview) else part
        for eh, key in zip(part[::2], part[1::2]):
            if key not in into and get(eh) == key:
                into[key] = eh
        yield


class EngineHashMaps:
    """The reverse maps by slot, and the steps still building some of them."""

    def __init__(self) -> None:
        #: slot -> our key -> engine hash, kept only for workers that asked for an eviction hint;
        #: the Stored / Removed handlers read and update it (complete or still being built)
        self.by_slot: dict[int, MutableMapping[int, int]] = {}
        #: slot -> the steps still building its map (``steps``)
        self._building: dict[int, Iterator[None]] = {}

    def built(self, slot: int) -> MutableMapping[int, int] | None:
        """The slot's map once it is complete; None while none is, or it is still being built."""
        return self.by_slot.get(slot) if slot not in self._building else None

    def steps(self, worker: Worker, step: int = 1 << 62) -> Iterator[None]:
        """Build the worker's key -> engine hash map that eviction hints answer with, reading at
        most ``step`` engine hashes per part; nothing once it is built. Built once per worker,
        then kept current by the Stored/Removed handlers, so later hints cost O(k); built in one
        go it held the loop ~185 ms at 400k blocks (issue #16), so a host runs the parts between
        turns of its loop (the map is in place from the first part: events applied between parts
        update it, and the parts add only pairs the worker still has)."""
        slot = worker.slot
        building = self._building.get(slot)
        if building is None:
            if slot in self.by_slot:
                return iter(())
            building = self._building[slot] = self._build(worker, step)
        return building

    def _build(self, worker: Worker, step: int) -> Iterator[None]:
        slot = worker.slot
        # a native map sized for what the worker holds: a dict (or a map left to grow) rehashed
        # everything it held inside one part, 10-23 ms at 350k entries (issue #16 item 1). Its
        # table (~12 MiB at 400k) is mapped in a part of its own, before the pairs are copied,
        # with room for an eighth more (blocks the worker stores while the parts run).
        reverse = u64_map(len(worker.engine_keys) * 9 // 8)
        self.by_slot[slot] = reverse
        for _ in itertools.chain((None,), invert_steps(worker.engine_keys, reverse, step)):
            yield
            if self.by_slot.get(slot) is not reverse:
                return  # the worker was cleared or removed meanwhile: nothing more to build
        if self._building.get(slot) is not None:
            del self._building[slot]

    def reset(self, slot: int) -> MutableMapping[int, int] | None:
        """The slot's worker was cleared: a worker that asked for eviction hints keeps an (empty,
        complete) map. Returns the map it had, for the caller to release, or None."""
        reverse = self.by_slot.get(slot)
        if reverse is not None:
            self.by_slot[slot] = u64_map()
            self._building.pop(slot, None)  # the map was cleared: an empty one is complete
        return reverse

    def move(self, old: int, new: int) -> None:
        """The worker on ``old`` moved to ``new`` (cleared in steps): its map goes with it."""
        self.by_slot[new] = self.by_slot.pop(old)

    def forget(self, slot: int) -> MutableMapping[int, int] | None:
        """The slot's worker was removed: drop its map (returned, for the caller to release)."""
        reverse = self.by_slot.pop(slot, None)
        self._building.pop(slot, None)
        return reverse
