"""Applying engines' cache events to the index: Stored / Removed / Cleared batches, in sequence, per worker.

The engines' KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
SGLang's the same, converted by ``events/``) are the router's view of each worker's cache,
as in Dynamo's KV indexer and llm-d's kvevents: a stored chain is keyed by the router's own
chained block keys, with the engine's hashes mapped to them (``Worker.engine_keys``). It
follows the engines' publishing rules: per-worker sequence numbers (gaps, duplicates, engine
restarts), pages larger than the router's blocks (``index.pages``), hybrid KV-cache groups
(vLLM ``group_idx``, ``index.groups``), and a resync by ``Cleared`` plus the full state. A
worker whose view misses events, or whose stores keep being rejected, is DEGRADED until then.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from ..errors import InvalidRequest, RejectedEvent
from ..index import native
from ..index.groups import GroupPresence
from ..index.keys import ROOT_SEED, chain_keys_array, chain_keys_with_extras, namespace_seed, tokens_to_bytes
from ..index.native import u64_array
from ..index.pages import PageChains
from ..index.radix import Block
from ..index.workers import Worker
from ..policies.base import EvictionPolicyBase, drop_blocks
from ..protocols import BatchOutcome, Cleared, EventBatch, Removed, Stored, WorkerState
from .access import NO_ACCESS_INFO, RecentAccess
from .engine_hashes import EngineHashMaps
from .shared import Shared, log
from .slots import RetiredSlots
from .speculative import SpeculativeBlocks

__all__ = ["MAX_KV_GROUPS", "REJECTING_AFTER", "EventApplier"]

#: Engine batches in a row whose stored events were all rejected before the worker shows
#: DEGRADED: one odd event is noise, a stream of them means the router's view is starving.
REJECTING_AFTER = 3

#: hybrid KV-cache groups per worker the router tracks (vLLM ``group_idx``)
MAX_KV_GROUPS = 64

#: the native check of a whole batch (None: pure Python), which reads the core event classes
_events_plain = None if native.module is None else native.module.events_plain
if native.module is not None:
    native.module.set_event_types(Stored, Removed, Cleared)


class EventApplier:
    """Checks and applies event batches; owns nothing but what it is given (the index,
    the workers' event state, their engine-hash maps) and the rules that change them.

    Natively, a batch whose events all pass the checks as they are is checked in one call
    (``events_plain``), and its plain Stored events (pages of the router's blocks, no hybrid
    group, no extra keys) are applied in runs, one call each (``RadixIndex.store_events``:
    parent, hashing, store, engine-hash maps, lru's leaf hook), where the worker's maps are
    native, no speculative blocks are live and the eviction policy's stored hook is one native
    call. Everything else goes one event at a time, the reference those runs are held to
    (``batched = False``; ``tests/unit/test_ingest_batched.py``)."""

    def __init__(self, shared: Shared, hashes: EngineHashMaps, slots: RetiredSlots, recent: RecentAccess,
                 speculative: SpeculativeBlocks) -> None:
        self._shared = shared
        self._hashes = hashes
        self._slots = slots
        self._recent = recent
        self._speculative = speculative
        self._block_size = shared.block_size
        #: plain Stored events in runs, one native call each (``RadixIndex.store_events``) where
        #: the index, the worker and the eviction policy allow it; False: one at a time, the
        #: reference the native runs are tested against
        self.batched = True

    def _page_size(self, worker: Worker, ev: Stored) -> int:
        return ev.block_size or worker.spec.block_size or self._block_size

    def _prepare_stored(self, worker: Worker, ev: Stored) -> tuple[bytes, array | None]:
        """Check a Stored event before anything changes: ``(token bytes, engine hashes as an
        array('Q') or None)``. Raises ``RejectedEvent`` (an ``InvalidRequest``) naming why it
        cannot be applied."""
        block_size = self._block_size
        page = ev.block_size or worker.spec.block_size or block_size  # _page_size, once per stored event
        data = ev.token_ids if isinstance(ev.token_ids, bytes) else tokens_to_bytes(ev.token_ids)
        step = page * 4
        if not data or len(data) % step:
            raise RejectedEvent(
                "token_count",
                f"worker {worker.id!r}: stored token_ids hold {len(data) // 4} tokens, not a positive multiple of "
                f"the page size {page}",
            )
        npages = len(data) // step
        hashes = ev.engine_hashes
        packed = None
        if hashes is None:
            if page != block_size:
                raise RejectedEvent(
                    "no_engine_hashes",
                    f"worker {worker.id!r}: pages of {page} tokens need engine hashes (the router's blocks hold "
                    f"{block_size})",
                )
        else:
            if len(hashes) != npages:
                raise RejectedEvent("hash_count", f"worker {worker.id!r}: {len(hashes)} engine hashes for {npages} pages of tokens")
            # the engine-hash maps hold uint64s (wire and ZMQ decoding guarantee it; in-process
            # callers are checked here, before anything changes). Packing them checks the range
            # in C, and the native engine-hash map then reads them without an int per hash.
            try:
                packed = u64_array(hashes)
            except OverflowError:
                raise RejectedEvent("hash_range", f"worker {worker.id!r}: engine hashes must be between 0 and 2**64 - 1") from None
        if ev.group is not None and not 0 <= ev.group < MAX_KV_GROUPS:
            raise RejectedEvent("group", f"worker {worker.id!r}: group_idx must be in [0, {MAX_KV_GROUPS}), got {ev.group}")
        return data, packed

    def apply(self, batch: EventBatch, *, per_event: bool = False) -> BatchOutcome:
        """Apply one batch of cache events for a worker, in publisher order.

        Sequence rules (per worker): ``last+1`` is in order; a repeat of an applied number is
        a duplicate and ignored; ``0`` after a higher number is an engine restart (its cache is
        empty: state is cleared first, and a worker DEGRADED for lost events is READY again); a
        jump forward is a gap: the lost batches are counted and the worker is marked DEGRADED
        until a ``Cleared`` resyncs it. A first batch numbered past 0 (the router has no number
        for the worker: it restarted, was warmed from a peer, or the worker was registered
        again) is a gap of unknown history ("sequence unknown"), unless it starts with
        ``Cleared``: a resync needs no history, so it is in order. ``Worker.resync_needed``
        tells publishers that only a ``Cleared`` plus their full state mends the view.

        A batch is checked whole before it changes anything, and by default one event that
        cannot be applied rejects the batch (the gRPC contract: a rejected call changes
        nothing). Engine batches (``per_event=True``: vLLM / SGLang publish one batch per
        scheduler step, mixing removals with stores) apply every valid event instead; the
        others are counted by reason in the outcome and on the worker, so a rejected store
        never costs the removals beside it. A worker whose stores keep being rejected is
        DEGRADED (``REJECTING_AFTER`` batches in a row) until a batch stores cleanly.
        """
        shared = self._shared
        counters = shared.counters
        worker = shared.workers.get(batch.worker_id)
        if batch.sequence < 0:
            raise InvalidRequest("sequence must be >= 0")
        prepared: list[tuple[bytes, array | None] | None] | None = []
        rejected: dict[str, int] = {}
        stores_rejected = 0
        events = batch.events
        if _events_plain is not None and _events_plain(
                events, worker.spec.block_size or self._block_size, self._block_size, MAX_KV_GROUPS):
            # every event passes the checks below as it is: each Stored event is prepared when
            # the per-event path applies it (the native runs read the events themselves)
            prepared, events = None, ()
        for ev in events:
            if isinstance(ev, Stored):
                try:
                    prepared.append(self._prepare_stored(worker, ev))
                except RejectedEvent as exc:
                    if not per_event:
                        raise
                    rejected[exc.reason] = rejected.get(exc.reason, 0) + 1
                    stores_rejected += 1
                    prepared.append(None)
                    log.warning("stored event rejected: %s", exc, extra={"worker_id": worker.id, "reason": exc.reason})
            elif isinstance(ev, Removed):
                if ev.group is not None and not 0 <= ev.group < MAX_KV_GROUPS:
                    if not per_event:
                        raise InvalidRequest(f"worker {worker.id!r}: group_idx must be in [0, {MAX_KV_GROUPS})")
                    # the removal still applies, to every group: better a missed hit than a stale block
                    rejected["group"] = rejected.get("group", 0) + 1
                prepared.append(None)
            elif isinstance(ev, Cleared):
                prepared.append(None)
            else:
                raise InvalidRequest(f"unknown event type {type(ev).__name__}")
        last, seq = worker.last_sequence, batch.sequence
        outcome = BatchOutcome(applied=True, rejected=rejected)
        if last >= 0 and seq <= last and not (seq == 0 and last > 0):
            counters["batches_duplicate"] += 1
            return BatchOutcome(applied=False, duplicate=True)
        if last >= 0 and seq == 0:
            outcome.restarted = True
            counters["restarts"] += 1
            stale = worker.resync_needed
            self.clear_worker(worker)
            if stale and worker.state is WorkerState.DEGRADED:
                worker.state, worker.state_reason = WorkerState.READY, ""  # an empty cache, now mirrored
            log.warning("engine restart detected: worker state cleared", extra={"worker_id": worker.id})
        elif last < 0 and seq > 0:
            if not (batch.events and type(batch.events[0]) is Cleared):
                self._gap(worker, outcome, seq, "sequence unknown")
                log.warning(
                    "first batch of a worker is number %d: this router never saw its earlier batches (it restarted, "
                    "was warmed from a peer, or the worker was registered again); worker degraded until its "
                    "publisher resyncs (Cleared + full state, which EventPublisher sends when told)",
                    seq, extra={"worker_id": worker.id, "sequence": seq},
                )
        elif seq != last + 1:
            self._gap(worker, outcome, seq - last - 1, "event gap")
            log.warning(
                "event gap: %d batch(es) lost; worker degraded until resync",
                outcome.gap, extra={"worker_id": worker.id, "last_sequence": last, "sequence": seq},
            )
        worker.last_sequence = seq
        now = shared.clock.now()
        stores_applied = 0
        events = batch.events
        # runs of plain Stored events natively; a rejected event is the per-event path's to skip
        runs = self.batched and not rejected and type(events) is tuple and shared.index.stores_events
        i, n = 0, len(events)
        while i < n:
            ev = events[i]
            if runs and type(ev) is Stored:
                hook = self._run_hook(worker)
                if hook is not False:
                    done = self._apply_stored_run(worker, events, i, hook, outcome, now)
                    stores_applied += done - i
                    if done > i:
                        i = done
                        continue
            if isinstance(ev, Stored):
                prep = prepared[i] if prepared is not None else self._prepare_stored(worker, ev)
                if prep is not None:
                    self._apply_stored(worker, ev, prep[0], prep[1], outcome, now)
                    stores_applied += 1
            elif isinstance(ev, Removed):
                self._apply_removed(worker, ev, outcome)
            else:
                self.clear_worker(worker)
                if worker.state is WorkerState.DEGRADED:
                    worker.state = WorkerState.READY
                    worker.state_reason = ""
                    log.info("worker resynced by Cleared", extra={"worker_id": worker.id})
            i += 1
        self._note_rejections(worker, rejected, stores_applied, stores_rejected)
        counters["batches_applied"] += 1
        worker.batches_applied += 1
        worker.last_event_at = now
        counters["blocks_stored"] += outcome.blocks_stored
        counters["blocks_removed"] += outcome.blocks_removed
        counters["orphan_blocks"] += outcome.orphan_blocks
        counters["unknown_removals"] += outcome.unknown_removals
        return outcome

    def _gap(self, worker: Worker, outcome: BatchOutcome, lost: int, reason: str) -> None:
        outcome.gap = lost
        worker.gaps += 1
        self._shared.counters["gaps"] += 1
        self._degrade(worker, reason)

    def _degrade(self, worker: Worker, reason: str, *, resync: bool = True) -> None:
        """``resync``: events were lost, so only the publisher's Cleared + full state mends the
        view (a draining worker is flagged too: it serves again once drained back)."""
        if resync:
            worker.resync_needed = True
        if worker.state is not WorkerState.DRAINING:
            worker.state = WorkerState.DEGRADED
            worker.state_reason = reason

    def mark_resync_needed(self, worker_id: str, reason: str) -> None:
        """The worker's view is known to miss events (restored from a snapshot taken while it was
        DEGRADED for ``reason``): DEGRADED until its publisher resyncs it."""
        self._degrade(self._shared.workers.get(worker_id), reason)

    def note_rejected_events(self, worker_id: str, rejected: Mapping[str, int], *, lost_removal: bool = False) -> None:
        """Count events an adapter could not even decode (``events/``), by reason. A lost
        removal means the worker's view may hold blocks the engine evicted: DEGRADED until
        the adapter resyncs it."""
        worker = self._shared.workers.get(worker_id)
        self._note_rejections(worker, rejected, 0, sum(rejected.values()) if not lost_removal else 0)
        if lost_removal:
            self._degrade(worker, "removal lost")

    def _note_rejections(self, worker: Worker, rejected: Mapping[str, int], stores_applied: int, stores_rejected: int) -> None:
        counts = worker.events_rejected
        for reason, n in rejected.items():
            counts[reason] = counts.get(reason, 0) + n
            self._shared.counters["events_rejected"] += n
        if stores_rejected and not stores_applied:
            worker.rejecting_streak += 1
            if worker.rejecting_streak >= REJECTING_AFTER and worker.state is WorkerState.READY:
                self._degrade(worker, "stored events rejected", resync=False)
                log.warning("every recent stored event was rejected; worker degraded",
                            extra={"worker_id": worker.id, "reasons": dict(counts)})
        elif stores_applied and not stores_rejected:
            worker.rejecting_streak = 0
            if worker.state is WorkerState.DEGRADED and worker.state_reason == "stored events rejected":
                worker.state = WorkerState.READY
                worker.state_reason = ""

    def _apply_stored(self, worker: Worker, ev: Stored, data: bytes, hashes: array | None, outcome: BatchOutcome,
                      now: float) -> None:
        if ev.group is not None:
            groups = worker.groups
            if groups is None:
                groups = worker.groups = GroupPresence()
            groups.learn(ev.group, ev.group_kind)
            assert ev.engine_hashes is not None or not groups.tracking
            if not groups.stored(ev.group, ev.engine_hashes or (), self._engine_hash_held(worker)):
                return  # a suffix-only group (sliding window): it cannot serve a prefix by itself
        index, block_size = self._shared.index, self._block_size
        page = ev.block_size or worker.spec.block_size or block_size  # _page_size, once per stored event
        if page != block_size:
            self._apply_stored_pages(worker, ev, data, page, outcome, now)
            return
        if ev.parent_engine_hash is None:
            model, lora, salt = ev.model, ev.lora, ev.salt
            parent_key, seed = None, namespace_seed(model, lora, salt) if model or lora or salt else ROOT_SEED
        else:
            parent_key = worker.engine_keys.get(ev.parent_engine_hash)
            if parent_key is None and index.holds(worker.slot, ev.parent_engine_hash):
                parent_key = ev.parent_engine_hash  # publisher uses our keys as its hashes
            elif parent_key is not None and index.get(parent_key) is None:
                # the map still names a block the router dropped itself: an approximate-mode
                # worker's modelled eviction (capacity) leaves the engine's hashes mapped
                parent_key = None
            if parent_key is None:
                outcome.orphan_blocks += len(data) // (block_size * 4)
                log.debug("stored blocks with an unknown parent skipped", extra={"worker_id": worker.id})
                return
            seed = parent_key
        reverse = self._hashes.by_slot.get(worker.slot) if hashes is not None else None
        if ev.extra_hashes is None and reverse is None:
            # hashing, storing and the engine-hash map in one native call (RadixIndex.store_hashed)
            keys: Sequence[int]
            keys, blocks = index.store_hashed(worker.slot, parent_key, data, block_size, seed, now,
                                              None if hashes is None else worker.engine_keys, hashes)
            hashes = None  # mapped
        else:
            # keys as an array('Q'): the native index and engine-hash map read it in place, with no
            # int object made per block (the pure-Python path reads it as a sequence of ints)
            if ev.extra_hashes is None:
                keys = chain_keys_array(data, block_size, seed)
            else:
                keys = chain_keys_with_extras(data, block_size, seed, ev.extra_hashes)
            blocks = index.store(worker.slot, parent_key, keys, now)
        if hashes is not None:
            self._map_engine_hashes(worker, hashes, keys, reverse)
        # _stored_hooks written out: once per stored event
        recent = self._recent
        info = recent.stored_info(parent_key, keys) if recent.entries else NO_ACCESS_INFO
        self._shared.policies.eviction.on_stored(index, worker.slot, blocks, info, now)
        outcome.blocks_stored += len(keys)
        if self._speculative.live:
            self._speculative.confirm(worker, keys)

    @staticmethod
    def _map_engine_hashes(worker: Worker, hashes: Sequence[int], keys: Sequence[int],
                           reverse: MutableMapping[int, int] | None) -> None:
        """Each engine hash of a stored chain -> our key of its block in ``worker``'s map (and
        the key -> the hash in ``reverse``, kept for eviction hints); a hash equal to our key
        needs no entry."""
        mapping = worker.engine_keys
        map_pairs = getattr(mapping, "map_pairs", None)  # the loop below, in C (a native U64Map)
        if map_pairs is not None and reverse is None:
            map_pairs(hashes, keys)
            return
        for eh, key in zip(hashes, keys):
            if eh != key:
                mapping[eh] = key
                if reverse is not None:
                    reverse[key] = eh

    def _run_hook(self, worker: Worker) -> tuple[Any, Any] | None | bool:
        """The eviction hook a native run of the worker's Stored events makes itself
        (``RadixIndex.store_events``' ``hook``), None for a policy whose ``on_stored`` does
        nothing; False when the events must go one at a time: an engine-hash map (or a reverse
        one, kept for eviction hints) that is not the native one, speculative blocks to confirm,
        or a policy whose stored hook is Python (a class attribute is looked up, so a wrapper
        forwarding attributes to a policy does not pass for it)."""
        u64map = native.module.U64Map  # type: ignore[union-attr]
        reverse = self._hashes.by_slot.get(worker.slot)
        if (type(worker.engine_keys) is not u64map or (reverse is not None and type(reverse) is not u64map)
                or self._speculative.live):
            return False
        eviction = self._shared.policies.eviction
        if type(eviction).on_stored is EvictionPolicyBase.on_stored:
            return None
        if getattr(type(eviction), "native_stored_hook", None) is None:
            return False
        hook = eviction.native_stored_hook(worker.slot)
        return False if hook is None else hook

    def _apply_stored_run(self, worker: Worker, events: tuple[Any, ...], start: int, hook: tuple[Any, Any] | None,
                          outcome: BatchOutcome, now: float) -> int:
        """``_apply_stored`` for the plain Stored events from ``events[start]`` on, in one native
        call (``RadixIndex.store_events``); returns the index of the first event it left to the
        per-event path. An event whose store ended in ``RadixIndex.store``'s Python loop is
        finished here as ``_apply_stored`` finishes it."""
        recent = self._recent
        trace: list[tuple[int | None, array]] | None = [] if recent.entries else None
        reverse = self._hashes.by_slot.get(worker.slot)
        nxt, stored, orphans, partial = self._shared.index.store_events(
            worker.slot, events, start, self._block_size, worker.spec.block_size or self._block_size, now,
            worker.engine_keys, reverse, hook, trace)
        outcome.blocks_stored += stored
        if orphans:
            outcome.orphan_blocks += orphans
            log.debug("stored blocks with an unknown parent skipped", extra={"worker_id": worker.id})
        if trace:
            # the access info of each chain, in order: lru's hook does not read it, but the
            # recent accesses learn a routed prompt's generated blocks from it
            for parent_key, keys in trace:
                recent.stored_info(parent_key, keys)
        if partial is not None:
            parent_key, keys, blocks = partial
            hashes = events[nxt - 1].engine_hashes
            if hashes is not None:
                self._map_engine_hashes(worker, hashes, keys, reverse)
            self._stored_hooks(worker, parent_key, keys, blocks, outcome, now)
        return nxt

    def _stored_hooks(self, worker: Worker, parent_key: int | None, keys: Sequence[int], blocks: list[Any],
                      outcome: BatchOutcome, now: float) -> None:
        recent = self._recent
        info = recent.stored_info(parent_key, keys) if recent.entries else NO_ACCESS_INFO
        self._shared.policies.eviction.on_stored(self._shared.index, worker.slot, blocks, info, now)
        outcome.blocks_stored += len(keys)
        if self._speculative.live:
            self._speculative.confirm(worker, keys)

    def _apply_stored_pages(self, worker: Worker, ev: Stored, data: bytes, page: int, outcome: BatchOutcome,
                            now: float) -> None:
        """An engine whose pages are not the router's blocks (``index.pages``)."""
        assert ev.engine_hashes is not None  # _prepare_stored checked it
        chains = worker.pages
        if chains is None:
            chains = worker.pages = PageChains(self._block_size)
        slot, index = worker.slot, self._shared.index
        chunk = chains.store(ev.engine_hashes, ev.parent_engine_hash, data, page,
                             namespace_seed(ev.model, ev.lora, ev.salt), lambda key: index.holds(slot, key),
                             ev.extra_hashes)
        if chunk is None:
            outcome.orphan_blocks += len(data) // (self._block_size * 4)
            log.debug("stored pages with an unknown parent skipped", extra={"worker_id": worker.id})
            return
        if chunk.keys:
            blocks = index.store(slot, chunk.parent_key, chunk.keys, now)
            self._stored_hooks(worker, chunk.parent_key, chunk.keys, blocks, outcome, now)

    def _engine_hash_held(self, worker: Worker) -> Any:
        engine_keys, pages = worker.engine_keys, worker.pages
        return lambda eh: eh in engine_keys or (pages is not None and eh in pages)

    def _apply_removed(self, worker: Worker, ev: Removed, outcome: BatchOutcome) -> None:
        mapping = worker.engine_keys
        slot = worker.slot
        index = self._shared.index
        reverse = self._hashes.by_slot.get(slot)
        groups, pages = worker.groups, worker.pages
        group = ev.group if ev.group is None or 0 <= ev.group < MAX_KV_GROUPS else None
        held = self._engine_hash_held(worker) if groups is not None else None
        # the event's blocks, distinct and in order, dropped together: one eviction hook call
        # for the event (EvictionPolicy.on_removed_many). A block named twice is removed once;
        # the second mention finds it gone, as when blocks were dropped one by one.
        doomed: dict[int, Block] = {}
        for eh in ev.engine_hashes:
            if groups is not None and not groups.removed(group, eh, held):
                continue  # another prefix-reusable group still holds the block
            if pages is not None:
                keys = pages.remove(eh)
                if keys is not None:
                    for key in keys:
                        block = index.get(key)
                        if block is not None and block.holders >> slot & 1 and key not in doomed:
                            doomed[key] = block
                    continue
            key = mapping.pop(eh, eh)
            if reverse is not None and reverse.get(key) == eh:
                del reverse[key]
            block = index.get(key)
            if block is not None and block.holders >> slot & 1 and key not in doomed:
                doomed[key] = block
            else:
                outcome.unknown_removals += 1
        if doomed:
            drop_blocks(self._shared.policies.eviction, index, slot, list(doomed.values()))
            outcome.blocks_removed += len(doomed)
            if self._speculative.live:
                self._speculative.removed(worker, doomed)

    def clear_worker(self, worker: Worker) -> None:
        """The worker holds nothing now. A large one moves to a fresh slot at once and its old
        slot is emptied in steps (``slots.CLEAR_IN_PLACE_BLOCKS``): no routing mask includes the
        old slot, so the old blocks only count towards ``len(index)`` meanwhile."""
        worker.engine_keys.clear()
        self._speculative.forget_worker(worker)
        if worker.pages is not None:
            worker.pages.clear()
        if worker.groups is not None:
            worker.groups.clear()
        worker.resync_needed = False
        old = worker.slot
        # a worker that asked for eviction hints keeps its (now empty) engine-hash map current
        reverse = self._hashes.reset(old)
        new = self._slots.clear(worker, reverse)
        if new is not None and reverse is not None:
            self._hashes.move(old, new)

    def reset_events(self, worker_id: str, *, lost: bool) -> Worker:
        """Forget a worker's cached blocks and event sequence, for sources that sequence themselves.

        The ZMQ adapters (``events/``) detect gaps and replay on their own, then hand batches
        numbered from 0 after this call, so ``apply`` never flags their gaps twice. ``lost``
        means events were lost beyond recovery (replay unavailable or too old): the gap is
        counted and the worker is DEGRADED until a ``Cleared`` (or engine restart) resyncs it.
        """
        worker = self._shared.workers.get(worker_id)
        self.clear_worker(worker)
        worker.last_sequence = -1
        if lost:
            worker.gaps += 1
            self._shared.counters["gaps"] += 1
            self._degrade(worker, "events lost beyond replay")
            log.warning("events lost beyond replay: worker state cleared and degraded", extra={"worker_id": worker_id})
        return worker
