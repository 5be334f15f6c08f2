"""A bus snapshot keeps what each worker's view is missing: restored, a worker that had lost events
is still DEGRADED and flagged for its publisher's resync, not READY with a stale view."""

from __future__ import annotations

from kvrouterd.clock import ManualClock
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Cleared, EventBatch, Stored, WorkerState
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.snapshot import encode_snapshot, restore_snapshot

BS = 4


def router() -> Router:
    r = Router(RouterSettings(block_size=BS), ManualClock())
    for wid in ("lost", "fine"):
        r.add_worker(WorkerSpec(wid, f"{wid}:1", mode=CacheMode.EVENTS))
    return r


async def test_a_worker_degraded_for_lost_events_is_restored_degraded_and_flagged():
    source = router()
    source.apply(EventBatch("lost", 0, (Stored(tuple(range(BS)), (1,)),)))
    source.apply(EventBatch("lost", 4, (Stored(tuple(range(BS, 2 * BS)), (2,)),)))  # batches 1..3 lost
    source.apply(EventBatch("fine", 0, (Stored(tuple(range(BS)), (9,)),)))
    assert source.workers.get("lost").resync_needed

    restored = router()
    sequence, warmed = await restore_snapshot(restored, encode_snapshot(source, 17))
    assert sequence == 17 and warmed.blocks == 3
    lost, fine = restored.workers.get("lost"), restored.workers.get("fine")
    assert (lost.state, lost.state_reason, lost.resync_needed, lost.last_sequence) == (
        WorkerState.DEGRADED, "event gap", True, 4)
    assert (fine.state, fine.resync_needed, fine.last_sequence) == (WorkerState.READY, False, 0)
    restored.apply(EventBatch("lost", 5, (Cleared(),)))  # the publisher's resync, next on the stream
    assert lost.state is WorkerState.READY and not lost.resync_needed
