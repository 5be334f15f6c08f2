"""Emptying the index slots no worker routes to any more, in steps: a cleared worker's old slot, a removed worker's.

A worker holding more than ``CLEAR_IN_PLACE_BLOCKS`` blocks is cleared (an engine's Cleared,
a restart, lost events) by moving it to a fresh, empty slot at once and dropping the old
slot's blocks, eviction state and engine-hash map in parts of ``DRAIN_STEP_BLOCKS``; fewer
are dropped in place. A 400k-block worker took 2.3 s to clear in place, all of it on the
routing loop (issue #16 item 1). No routing mask includes a slot being emptied, so its
blocks only count towards ``len(index)`` meanwhile (``indexed_blocks`` leaves them out).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, MutableMapping

from ..index.workers import Worker
from ..policies.eviction._release import release_steps
from .shared import Shared, log

__all__ = ["CLEAR_IN_PLACE_BLOCKS", "DRAIN_STEP_BLOCKS", "RetiredSlots"]

#: a worker holding more blocks than this is cleared (an engine's Cleared, a restart, lost
#: events) by moving it to a fresh, empty slot at once and dropping the old slot's blocks and
#: eviction state in steps (``drain_step``); fewer are dropped in place. A 400k-block worker
#: took 2.3 s to clear in place, all of it on the routing loop (issue #16 item 1).
CLEAR_IN_PLACE_BLOCKS = 4096
#: blocks (or eviction-state entries) one step of a drain drops: ~1.5 ms idle, 3-5 times that
#: on a loaded 2-core machine
DRAIN_STEP_BLOCKS = 512


class RetiredSlots:
    """The drains pending for cleared workers' old slots, oldest first."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        #: the steps that empty slots no worker routes to any more (cleared workers' old slots);
        #: the host runs them between calls (``drain_step``), ``Router.apply`` runs one too (it
        #: tests this per batch: an attribute, cheaper than ``draining`` on Python 3.11)
        self.pending: deque[Iterator[int]] = deque()

    def clear(self, worker: Worker, reverse: MutableMapping[int, int] | None) -> int | None:
        """Empty the worker's slot: in place if it is small, otherwise move the worker to a
        fresh slot at once and queue the old one's drain (with ``reverse``, the engine-hash
        map it had). Returns the new slot, or None if the slot was cleared in place."""
        shared = self._shared
        old = worker.slot
        if shared.index.count(old) <= CLEAR_IN_PLACE_BLOCKS:
            shared.index.clear(old)
            for ev in shared.policies.eviction_by_name.values():
                ev.on_cleared(old)
            return None
        new = shared.workers.next_slot()
        shared.index.add_slot(new)
        shared.workers.move(worker, new)  # the old slot stays taken until drained
        self.pending.append(self.drop_steps(old, DRAIN_STEP_BLOCKS, reverse))
        log.info("worker cleared: its blocks are dropped from the index in steps", extra={
            "worker_id": worker.id, "slot": new, "old_slot": old, "blocks": shared.index.count(old)})
        return new

    def drop_steps(self, slot: int, step: int, reverse: MutableMapping[int, int] | None = None) -> Iterator[int]:
        """Empty a slot no worker routes to: its blocks, then every eviction policy's state for
        it and its engine-hash map ``reverse``, at most ``step`` of each at a time; then free it.
        Yields the blocks each part dropped (0 for the parts that release state)."""
        shared = self._shared
        yield from shared.index.clear_steps(slot, step)
        for ev in list(shared.policies.eviction_by_name.values()):
            for _ in ev.clear_steps(slot, step):
                yield 0
        if reverse:
            for _ in release_steps([reverse], step):
                yield 0
        shared.index.drop_slot(slot)
        shared.workers.free_slot(slot)

    @property
    def indexed_blocks(self) -> int:
        """The index's blocks as routing sees them, what operators read (GetStats, the gauge):
        all but those only retired slots hold, which leave the count at once though they are
        dropped in steps (a removed worker's slot, ``Membership.detach_worker``; a cleared
        worker's old one, ``drain_step``). Blocks that several retired slots share and no worker
        holds still count until one of those drains gets to them. Blocks no slot holds (the tree
        keeps one while held blocks hang under it: an engine evicted a chain's first blocks and
        kept the rest) are never a hit, so they do not count either (issue #28 item 13)."""
        index = self._shared.index
        live = {w.slot for w in self._shared.workers}
        return len(index) - index.unheld - sum(index.count_alone(s) for s in index.slots() if s not in live)

    @property
    def draining(self) -> bool:
        """Some cleared worker's old slot still holds blocks or eviction state (``drain_step``)."""
        return bool(self.pending)

    def drain_step(self) -> bool:
        """One step of the oldest pending drain; False once none is left."""
        while self.pending:
            try:
                next(self.pending[0])
                return True
            except StopIteration:
                self.pending.popleft()
        return False
