"""Speculative blocks: a routed prompt's blocks assumed cached on its events-mode worker until the engine's Stored confirms them.

An events-mode worker's cache is known only from its engine's events, and an engine
publishes Stored when a prefill finishes: seconds after routing for a long prompt or a
queued one. A follow-up sharing the prefix that arrives meanwhile would find it nowhere and
scatter. So routing stores the prompt's blocks the worker does not hold yet into the index
at once, as approximate mode assumes them (``LoadLedger._assume_cached``: the same
``RadixIndex.store`` and eviction hooks), and keeps them here as *claims* until:

- the engine's Stored names them: *confirmed*, they stay in the index as any stored block;
- ``speculative_ttl_s`` passes first: *expired*, they leave the index (the engine was slower
  than that, or does not cache them: what the counts tell an operator);
- they leave the index by the worker's Removed or Cleared, its removal, the routed request
  failing (a Complete with ``success=false``), or a later claim displacing them past the
  bounds (``speculative_max_blocks_per_worker``, ``speculative_max_blocks``): *dropped*.

vllm-project/router calls this speculative indexing. A later request routed to the same
worker that covers a claimed block takes the claim over (its own prefill would store the
block too), so a chain of follow-ups keeps its shared prefix alive until one prefill lands.
Claims expire in creation order (the TTL is one number), which a replica's late Dispatch
(``claim`` with an earlier ``since``) bends by at most its delivery lag.

Pure bookkeeping beside the index; the ledger records claims, the event applier confirms
and drops them, the facade expires them before each decision.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from ..index.radix import Block
from ..index.workers import Worker
from ..policies.base import AccessInfo, drop_blocks
from ..protocols import CacheMode
from .shared import Shared

__all__ = ["OUTCOMES", "SpeculativeBlocks"]

#: how a claimed block's speculation ended (``kvrouter.speculative.blocks{outcome}``)
OUTCOMES = ("confirmed", "expired", "dropped")


class _Claim:
    """Blocks one routed request made speculative on one worker."""

    __slots__ = ("expires_at", "keys", "live", "request_id", "worker")

    def __init__(self, worker: Worker, request_id: str, expires_at: float) -> None:
        self.worker = worker
        self.request_id = request_id
        self.expires_at = expires_at
        #: every key this claim ever owned; those it still owns are in its worker's table
        self.keys: list[int] = []
        #: how many it still owns
        self.live = 0


class _OnWorker:
    """One worker's claimed blocks: key -> owning claim, and its claims oldest first."""

    __slots__ = ("claims", "table", "worker")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.table: dict[int, _Claim] = {}
        self.claims: deque[_Claim] = deque()


class SpeculativeBlocks:
    """Claimed blocks per worker, their expiry, and how each ended (module docstring)."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._workers: dict[str, _OnWorker] = {}
        #: every live-or-finished claim, oldest first: expiry and the global bound pop from here
        self._order: deque[_Claim] = deque()
        self._by_request: dict[str, _Claim] = {}
        #: blocks claimed now, over all workers
        self.live = 0
        #: outcome -> blocks (``OUTCOMES``)
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    @property
    def enabled(self) -> bool:
        return self._shared.settings.speculative_ttl_s > 0

    def live_on(self, worker_id: str) -> int:
        """Blocks claimed on ``worker_id`` now."""
        on = self._workers.get(worker_id)
        return len(on.table) if on is not None else 0

    def keys_on(self, worker_id: str) -> frozenset[int]:
        """The keys claimed on ``worker_id``: blocks its engine does not hold yet (an eviction
        hint must not name them, an index export must not hand them to a peer as held)."""
        on = self._workers.get(worker_id)
        return frozenset(on.table) if on is not None else frozenset()

    # ---- routing ---------------------------------------------------------------------
    def claimed(self, candidates: Iterable[Worker], keys: Sequence[int], overlaps: Mapping[int, int]) -> dict[int, int]:
        """slot -> how many blocks at the end of its matched prefix are only claimed, for the
        candidates that have some (``RoutingContext.claimed``). An engine admits a request
        against what it has computed, so one admitted while the claimed prefix is still being
        prefilled computes it again: policies price those blocks as uncached."""
        out: dict[int, int] = {}
        workers = self._workers
        for w in candidates:
            overlap = overlaps.get(w.slot, 0)
            on = workers.get(w.id) if overlap else None
            if on is None or not on.table:
                continue
            table, i = on.table, overlap - 1
            while i >= 0 and keys[i] in table:
                i -= 1
            if i < overlap - 1:
                out[w.slot] = overlap - 1 - i
        return out

    def claimed_in(self, worker: Worker, keys: Sequence[int], overlap: int) -> int:
        """How many of the first ``overlap`` of ``keys`` (a matched prefix) are only claimed on
        ``worker``: the end of the prefix, as ``_take_over`` walks it. An engine admits a
        request against what it has computed, so one that starts while the claimed prefix is
        still being prefilled computes it again: the ledger charges those blocks as load."""
        on = self._workers.get(worker.id)
        if on is None or not on.table:
            return 0
        table, i = on.table, overlap - 1
        while i >= 0 and keys[i] in table:
            i -= 1
        return overlap - 1 - i

    def claim(self, worker: Worker, request_id: str, keys: Sequence[int], overlap: int, info: AccessInfo,
              now: float, since: float | None = None) -> None:
        """``worker``, holding the first ``overlap`` of ``keys``, was sent the prompt at
        ``since`` (default ``now``): store the rest as claimed, within the bounds, and take
        over claims on the held ones it covers."""
        s = self._shared.settings
        if s.speculative_ttl_s <= 0 or worker.mode is not CacheMode.EVENTS:
            return
        born = now if since is None else since
        claim = _Claim(worker, request_id, born + s.speculative_ttl_s)
        if claim.expires_at <= now:
            return  # a Dispatch older than the TTL: its engine has stored or never will
        on = self._workers.get(worker.id)
        if on is not None and on.worker is not worker:
            self.forget_worker(on.worker)  # a worker registered again under the same id
            on = None
        if on is None:
            on = self._workers[worker.id] = _OnWorker(worker)
        if on.table:
            self._take_over(on, claim, keys, overlap)
        new = min(len(keys) - overlap, s.speculative_max_blocks_per_worker, s.speculative_max_blocks)
        if new > 0:
            self._make_room(on, new)
            # blocks just taken over count too: they may leave less room than asked for
            new = min(new, s.speculative_max_blocks_per_worker - len(on.table), s.speculative_max_blocks - self.live)
        if new > 0:
            fresh = keys[overlap:overlap + new]
            self._store(worker, keys, overlap, fresh, info, now)
            table = on.table
            for key in fresh:
                table[key] = claim
            claim.keys.extend(fresh)
            claim.live += new
            self.live += new
        if claim.live:
            on.claims.append(claim)
            self._order.append(claim)
            old = self._by_request.get(request_id)
            if old is not None and old.live:
                self._settle(old, "dropped")  # a reused request id: the older claim is moot
            self._by_request[request_id] = claim

    def _take_over(self, on: _OnWorker, claim: _Claim, keys: Sequence[int], overlap: int) -> None:
        """The claimed blocks at the end of the matched prefix become ``claim``'s: they sit at
        the bottom of chains, so walking up from ``overlap`` stops at the first confirmed one."""
        table = on.table
        i = overlap - 1
        while i >= 0 and (prev := table.get(keys[i])) is not None:
            table[keys[i]] = claim
            claim.keys.append(keys[i])
            prev.live -= 1
            claim.live += 1
            i -= 1

    def _make_room(self, on: _OnWorker, new: int) -> None:
        s = self._shared.settings
        claims = on.claims
        while claims and len(on.table) + new > s.speculative_max_blocks_per_worker:
            self._settle(claims.popleft(), "dropped")
        order = self._order
        while order and self.live + new > s.speculative_max_blocks:
            self._retire(order.popleft(), "dropped")

    def _store(self, worker: Worker, keys: Sequence[int], overlap: int, fresh: Sequence[int], info: AccessInfo,
               now: float) -> None:
        """``LoadLedger._assume_cached`` for the first ``len(fresh)`` unheld keys."""
        index, eviction = self._shared.index, self._shared.policies.eviction
        parent = keys[overlap - 1] if overlap else None
        stored = index.store(worker.slot, parent, fresh, now)
        eviction.on_stored(index, worker.slot, stored, replace(info, first_offset=overlap), now)

    # ---- ends ---------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Claims past their TTL leave the index."""
        order = self._order  # called before every decision: one look when nothing is due
        while order and order[0].expires_at <= now:
            self._retire(order.popleft(), "expired")

    def _retire(self, claim: _Claim, outcome: str) -> None:
        """``claim`` leaves the order (expired, or the oldest past the global bound): settle
        what it still owns, and trim its worker's finished claims off the front."""
        self._settle(claim, outcome)
        if self._by_request.get(claim.request_id) is claim:
            del self._by_request[claim.request_id]
        on = self._workers.get(claim.worker.id)
        if on is not None:
            claims = on.claims
            while claims and not claims[0].live:
                claims.popleft()

    def confirm(self, worker: Worker, keys: Iterable[int]) -> None:
        """The worker's engine stored ``keys``: those claimed are confirmed (the event's store
        has already touched them in the index)."""
        self._unclaim(worker, keys, "confirmed")

    def removed(self, worker: Worker, keys: Iterable[int]) -> None:
        """``keys`` left the worker's index by its engine's Removed: those claimed are dropped."""
        self._unclaim(worker, keys, "dropped")

    def _unclaim(self, worker: Worker, keys: Iterable[int], outcome: str) -> None:
        """The engine's own event now accounts for ``keys``: their claims end as ``outcome``."""
        on = self._workers.get(worker.id)
        if on is None or not on.table or on.worker is not worker:
            return
        table, ended = on.table, 0
        for key in keys:
            claim = table.pop(key, None)
            if claim is not None:
                claim.live -= 1
                ended += 1
        self.live -= ended
        self.outcomes[outcome] += ended

    def forget_worker(self, worker: Worker) -> None:
        """The worker's index slot was cleared or dropped (Cleared, restart, lost events,
        removal): its claims go with the blocks, with no index change of their own."""
        on = self._workers.get(worker.id)
        if on is None or on.worker is not worker:
            return
        del self._workers[worker.id]
        for claim in on.claims:
            claim.live = 0
        self.live -= len(on.table)
        self.outcomes["dropped"] += len(on.table)

    def ended(self, request_id: str, success: bool) -> None:
        """The routed request (or prefill hop) ended. Completed: its claims stay until
        confirmed or expired (its Stored events may still be on the bus), but need no lookup
        by request id any more. Failed: its engine will not store what it claimed."""
        claim = self._by_request.pop(request_id, None)
        if claim is not None and not success:
            self._settle(claim, "dropped")

    def _settle(self, claim: _Claim, outcome: str) -> None:
        """The blocks ``claim`` still owns leave the index, counted as ``outcome``."""
        if not claim.live:
            return
        worker = claim.worker
        on = self._workers.get(worker.id)
        if on is None or on.worker is not worker:
            claim.live = 0
            return
        table, index, slot = on.table, self._shared.index, worker.slot
        doomed: dict[int, Block] = {}
        for key in claim.keys:
            if table.get(key) is claim:
                del table[key]
                block = index.get(key)
                if block is not None and block.holders >> slot & 1:
                    doomed[key] = block
        self.live -= claim.live
        self.outcomes[outcome] += claim.live
        claim.live = 0
        if self._by_request.get(claim.request_id) is claim:
            del self._by_request[claim.request_id]
        if doomed:
            drop_blocks(self._shared.policies.eviction, index, slot, list(doomed.values()))
