"""The ``Router`` facade: the one object the daemon and the simulator build, composing the router's parts.

Each job lives in its own part, which owns its state: ``events`` applies engines' cache
events to the index, ``ledger`` keeps the in-flight load, ``membership`` the workers,
``slots`` empties retired index slots in steps, ``advice`` answers eviction hints and
exports or imports a worker's blocks, ``pools`` keeps model pools and LoRA adapter
residency, ``selector`` decides (``disagg`` the two hops of a prefill/decode pool), and ``policy_table`` holds the policy objects. They share one ``Shared`` (settings, clock, index, workers, policies,
counters) and call each other through the few references the facade hands them. Hosts see
only the facade, whose methods delegate, one call each.
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

from ..clock import Clock
from ..index.radix import RadixIndex
from ..index.workers import InFlight, Worker, WorkerRegistry, WorkerSpec
from ..policies.base import EvictionPolicy, RoutingContext, RoutingPolicy
from ..protocols import (
    BatchOutcome,
    CacheMode,
    Completion,
    Decision,
    Dispatch,
    EventBatch,
    EvictAdvice,
    EvictRequest,
    RouteRequest,
    WorkerRole,
)
from .access import RecentAccess
from .advice import Advisor
from .engine_hashes import EngineHashMaps
from .disagg import Disaggregation, cache_unknown
from .events import EventApplier
from .ledger import LoadLedger, PrefixHits, RouteResult
from .membership import Membership
from .policy_table import PolicyTable
from .pools import Pools
from .selector import Selector
from .settings import RouterSettings
from .shared import Shared, log
from .slots import RetiredSlots
from .speculative import SpeculativeBlocks

__all__ = ["Router"]


class Router:
    """The router core: synchronous, no I/O; see the package docstring."""

    def __init__(self, settings: RouterSettings, clock: Clock, rng: random.Random | None = None) -> None:
        settings.validate()
        rng = rng if rng is not None else random.Random(0)
        index = RadixIndex()
        workers = WorkerRegistry()
        self._policies = PolicyTable(settings, rng, workers)
        self._shared = shared = Shared(settings, clock, rng, index, workers, self._policies)
        # what the parts share and never replace, as attributes: a property's read is a Python
        # call (~600 instructions, callgrind), and the server reads these on every Route and
        # Complete (the index is replaced: a property, below)
        self.clock: Final[Clock] = clock
        self.rng: Final[random.Random] = rng
        self.block_size: Final[int] = shared.block_size
        self.workers: Final[WorkerRegistry] = workers
        self.counters: Final[dict[str, int]] = shared.counters
        self.settings: RouterSettings = settings  # and ``Shared.settings`` (``__setattr__``)
        recent = RecentAccess(settings.block_size)
        self._engine_hashes = EngineHashMaps()
        self._slots = RetiredSlots(shared)
        self._speculative = SpeculativeBlocks(shared)
        self._ledger = LoadLedger(shared, recent, self._speculative)
        self._events = EventApplier(shared, self._engine_hashes, self._slots, recent, self._speculative)
        self._pools = Pools(shared)
        self._membership = Membership(shared, self._events, self._ledger, self._engine_hashes, self._slots, self._pools)
        self._advice = Advisor(shared, self._engine_hashes, self._speculative)
        self._disagg = Disaggregation(shared, self._speculative)
        self._selector = Selector(shared, self._ledger, self._pools, self._disagg, self._speculative)

    # ---- what the parts share -----------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        # ``settings`` is a plain attribute, read on every Route and Complete without a
        # property's Python call (~600 instructions), and the parts read it from ``Shared``:
        # replacing it (``reload_routing``, a host adopting new limits) replaces both
        if name == "settings":
            self._shared.settings = value
        object.__setattr__(self, name, value)

    @property
    def index(self) -> RadixIndex:
        return self._shared.index

    @index.setter
    def index(self, index: RadixIndex) -> None:
        self._shared.index = index

    # ---- policies (``policy_table``) -------------------------------------------------
    @property
    def eviction(self) -> EvictionPolicy:
        """The configured eviction policy, whose hooks see every store, access and removal."""
        return self._policies.eviction

    @eviction.setter
    def eviction(self, policy: EvictionPolicy) -> None:
        self._policies.eviction = policy

    @property
    def default_routing(self) -> str:
        return self._policies.default_routing

    @property
    def routing_policies(self) -> Mapping[str, RoutingPolicy]:
        return self._policies.routing

    def routing_policy(self, name: str = "") -> RoutingPolicy:
        """The configured policy ``name`` (default if empty); registered-but-unconfigured
        policies are built with default parameters on first use."""
        return self._policies.routing_policy(name)

    def eviction_policy(self, name: str = "") -> EvictionPolicy:
        return self._policies.eviction_policy(name)

    def policy_counters(self) -> dict[str, dict[str, int]]:
        """policy name -> its rule counters (``RoutingPolicyBase.counters``), policies that keep any."""
        return self._policies.counters()

    def reload_routing(self, routing: Mapping[str, Any], extra_routing: Sequence[Mapping[str, Any]] = ()) -> list[str]:
        """Adopt new routing policy specs (``PolicyTable.reload``: only changed policies are
        rebuilt, all specs validated first); returns the names of those replaced or added."""
        changed = self._policies.reload(routing, extra_routing)
        self.settings = dataclasses.replace(self.settings, routing=routing, extra_routing=tuple(extra_routing))
        if changed:
            log.info("routing policies reloaded", extra={"policies": changed, "default": self.default_routing})
        return changed

    def tick(self) -> None:
        """Periodic work: time-driven policies (load decay, hotness windows), speculative blocks' expiry."""
        now = self.clock.now()
        self._speculative.expire(now)
        self._policies.tick(now)

    # ---- membership (``membership``, ``slots``) -------------------------------------------
    def add_worker(self, spec: WorkerSpec) -> Worker:
        """Register a worker, or update an existing one's description in place."""
        return self._membership.add_worker(spec)

    def check_worker_sizes(self, spec: WorkerSpec) -> None:
        """Client-chosen sizes within their limits (``Membership.check_worker_sizes``)."""
        self._membership.check_worker_sizes(spec)

    def remove_worker(self, worker_id: str) -> Worker:
        worker, blocks = self.detach_worker(worker_id)
        for _ in blocks:
            pass
        return worker

    def detach_worker(self, worker_id: str, step: int = 1 << 62) -> tuple[Worker, Iterator[int]]:
        """Remove a worker at once; returns it and the steps that drop its blocks
        (``Membership.detach_worker``)."""
        return self._membership.detach_worker(worker_id, step)

    def set_draining(self, worker_id: str, draining: bool) -> Worker:
        return self._membership.set_draining(worker_id, draining)

    def report_load(self, worker_id: str, queued: int, running: int, kv_utilization: float,
                    loaded_loras: Sequence[str] | None = None) -> None:
        """What an engine reports about itself; ``loaded_loras`` (None = not reported) replaces
        the adapters the router believes it has loaded (``Membership.report_load``)."""
        self._membership.report_load(worker_id, queued, running, kv_utilization, loaded_loras)

    def adopt_loras(self, worker_id: str, adapters: Sequence[str]) -> None:
        """Residency a peer or snapshot carries for ``worker_id`` (least recently used first),
        checked whole as ReportLoad's is, joins what this router knows as older (``Pools.adopt``)."""
        worker = self.workers.get(worker_id)
        names = self._pools.check_names(adapters, "loaded_loras", self._shared.settings.max_id_length)
        self._pools.adopt(worker, names)

    def note_admission_queue(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        """The host's admission queue for ``worker_id`` now holds ``requests`` waiting
        requests needing ``prefill_tokens`` there (``AdmissionQueues(on_change=...)``)."""
        self._membership.note_admission_queue(worker_id, requests, prefill_tokens)

    @property
    def indexed_blocks(self) -> int:
        """The index's blocks as routing sees them (``RetiredSlots.indexed_blocks``)."""
        return self._slots.indexed_blocks

    @property
    def draining(self) -> bool:
        """Some cleared worker's old slot still holds blocks or eviction state (``drain_step``)."""
        return self._slots.draining

    def drain_step(self) -> bool:
        """One step of the oldest pending drain; False once none is left."""
        return self._slots.drain_step()

    # ---- deciding (``selector``) ------------------------------------------------------
    def keys_for_tokens(self, tokens: bytes | Sequence[int], model: str = "", lora: str = "", salt: str = "") -> array:
        """Block keys of a prompt given as token ids (a sequence or little-endian uint32 bytes),
        as an ``array('Q')`` (see ``index.keys.chain_keys_array``)."""
        return self._selector.keys_for_tokens(tokens, model, lora, salt)

    def adapter_bases(self) -> Mapping[str, str]:
        """Adapter -> its base model, for keying requests that name an adapter in ``model``
        (``Pools.adapter_bases``; ``index.keys.key_namespace``). Read it on the loop and hand it
        to a hashing thread: it is never changed in place."""
        return self._pools.adapter_bases()

    def validate_request(self, req: RouteRequest) -> None:
        self._selector.validate_request(req)

    def decide(self, req: RouteRequest, explain: bool = True, *,
               validated: bool = False) -> tuple[Decision, RoutingContext, RoutingPolicy]:
        """Select a worker without committing anything (used by ``route`` and dry runs).

        ``explain=False`` lets policies skip listing every candidate (see RoutingContext.explain).
        Speculative blocks past their TTL leave the index first, so the match sees none.
        ``validated``: ``req`` passed this router's checks in a decision of this same step, and
        only its ``candidate_workers`` changed since, to workers the router named itself
        (deadline admission's reroute, ``admit_priced``), so they are not checked again.
        """
        now = self._shared.clock.now()
        self._speculative.expire(now)
        return self._selector.decide(req, now, explain, validated)

    def destinations(self, req: RouteRequest) -> tuple[list[Worker], str]:
        """``(workers, pool)`` a request without a prompt may go to: the eligible workers of its
        model's pool, the decode-capable ones of a P/D pool (``Selector.destinations``); raises
        ``UnknownModel`` for a model no worker serves, as ``route`` does."""
        return self._selector.destinations(req)

    def route(self, req: RouteRequest, explain: bool = True) -> RouteResult:
        """Decide, then commit: charge load, update the approximate cache model, notify."""
        decision, ctx, policy = self.decide(req, explain)
        return self.commit(decision, ctx, policy)

    @property
    def speculative(self) -> SpeculativeBlocks:
        """Routed prompts' blocks counted as cached before their engines store them: ``live``
        blocks now, ``outcomes`` of those that ended (``router.speculative``)."""
        return self._speculative

    # ---- the load ledger (``ledger``) -------------------------------------------------------
    @property
    def on_committed(self) -> Callable[[RouteResult], None] | None:
        """Replica sync: called with every local commit (None: this router is alone)."""
        return self._ledger.on_committed

    @on_committed.setter
    def on_committed(self, hook: Callable[[RouteResult], None] | None) -> None:
        self._ledger.on_committed = hook

    @property
    def on_completed(self) -> Callable[[Completion], None] | None:
        """Replica sync: called with every local completion (None: this router is alone)."""
        return self._ledger.on_completed

    @on_completed.setter
    def on_completed(self, hook: Callable[[Completion], None] | None) -> None:
        self._ledger.on_completed = hook

    @property
    def inflight_bytes(self) -> int:
        """What the routed, not completed requests cost (``ledger.request_bytes``)."""
        return self._ledger.inflight_bytes

    @property
    def waiting_bytes(self) -> int:
        """What requests waiting in an admission queue hold (``hold_waiting``)."""
        return self._ledger.waiting_bytes

    @property
    def decisions_by_policy(self) -> dict[str, int]:
        return self._ledger.decisions_by_policy

    @property
    def prefix_hits(self) -> dict[str, PrefixHits]:
        """policy -> achieved vs reachable prefix overlap of its decisions"""
        return self._ledger.prefix_hits

    def new_request_id(self) -> str:
        return self._ledger.new_request_id()

    def hold_waiting(self, req: RouteRequest) -> int:
        """Count ``req``, decided and about to wait in an admission queue, against
        ``max_inflight_bytes``; returns the bytes charged, for ``release_waiting``."""
        return self._ledger.hold_waiting(req)

    def release_waiting(self, held: int) -> None:
        """A waiting request left its queue (admitted, shed, cancelled): release its bytes."""
        self._ledger.release_waiting(held)

    def commit(self, decision: Decision, ctx: RoutingContext, policy: RoutingPolicy) -> RouteResult:
        """Commit a decision from ``decide`` made in this same step (nothing may change in between);
        the chosen worker now holds the request's adapter, if any (``Pools.note_loaded``)."""
        result = self._ledger.commit(decision, ctx, policy)
        if decision.prefill is not None:
            worker, hop_ctx = self._disagg.hop_context(decision, ctx)
            self._ledger.commit_prefill_hop(result, worker, hop_ctx, policy)
        self._ledger.announce(result)
        if decision.lora_placement:
            self._pools.note_loaded(result.worker, self._pools.wanted(ctx.request)[1])
        return result

    # ---- model pools (``pools``) -----------------------------------------------------------
    def pool_label(self, req: RouteRequest) -> str:
        """The pool ``req`` counts under in metrics (``Pools.pool_label``)."""
        return self._pools.pool_label(req)

    def complete(self, completion: Completion) -> InFlight:
        """Stop charging a routed request, tell its policy how it went (``LoadLedger.complete``)."""
        return self._ledger.complete(completion)

    def release_prefill(self, completion: Completion) -> InFlight | None:
        """A disaggregated request's prefill hop is done: release its prefill worker now
        (``LoadLedger.release_prefill``); None when no hop is charged."""
        return self._ledger.release_prefill(completion)

    def decode_workers_without_events(self) -> int:
        """Decode-role workers that are to publish KV events and never have: the P/D bypass
        check cannot see their caches (``router.disagg``)."""
        return sum(1 for w in self.workers if w.spec.role is WorkerRole.DECODE and cache_unknown(w))

    def complete_anywhere(self, completion: Completion, checked: bool = False) -> InFlight | None:
        """``complete`` for replicas sharing load (``LoadLedger.complete_anywhere``; ``checked``:
        ``completion`` passed ``bounds.check_completion`` where it was made)."""
        return self._ledger.complete_anywhere(completion, checked)

    def finish_plan(self) -> tuple[Any, ...] | None:
        """What a streamed Complete's native pass reads in place of ``complete_anywhere``
        (``LoadLedger.finish_plan``); None when that pass must not run."""
        return self._ledger.finish_plan()

    def request(self, request_id: str) -> RouteRequest | None:
        return self._ledger.request(request_id)

    def request_model(self, request_id: str) -> str | None:
        """The model of the request ``request_id`` while it is in flight (``LoadLedger.request_model``)."""
        return self._ledger.request_model(request_id)

    def expire_inflight(self) -> list[InFlight]:
        """Stop charging requests whose completion never came (caller crashed, lost Complete)."""
        return self._ledger.expire_inflight()

    def apply_dispatch(self, dispatch: Dispatch, *, own: bool = False) -> bool:
        """Another replica committed ``dispatch``: charge it here too (``LoadLedger.apply_dispatch``)."""
        return self._ledger.apply_dispatch(dispatch, own=own)

    def apply_completion(self, completion: Completion, *, own: bool = False) -> InFlight | None:
        """A Complete another replica received (``LoadLedger.apply_completion``)."""
        return self._ledger.apply_completion(completion, own=own)

    # ---- cache events (``events``) ------------------------------------------------------
    def apply(self, batch: EventBatch, *, per_event: bool = False) -> BatchOutcome:
        """Apply one batch of cache events for a worker, in publisher order
        (``EventApplier.apply`` states the sequence rules), then one step of a pending drain."""
        outcome = self._events.apply(batch, per_event=per_event)
        if outcome.applied:
            self._pools.note_events(batch)  # an adapter whose blocks the worker stores is loaded there
            worker = self.workers.find(batch.worker_id)
            if worker is not None and worker.mode is CacheMode.APPROXIMATE:  # its engine's Stored events
                self._ledger.fit_to_capacity(worker, self.clock.now())
        # a host that never drains (the simulator) still frees the old slots; a duplicate does not
        if outcome.applied and self._slots.pending:
            self.drain_step()
        return outcome

    def mark_resync_needed(self, worker_id: str, reason: str) -> None:
        """The worker's view is known to miss events: DEGRADED until its publisher resyncs it."""
        self._events.mark_resync_needed(worker_id, reason)

    def note_rejected_events(self, worker_id: str, rejected: Mapping[str, int], *, lost_removal: bool = False) -> None:
        """Count events an adapter could not even decode (``EventApplier.note_rejected_events``)."""
        self._events.note_rejected_events(worker_id, rejected, lost_removal=lost_removal)

    def reset_events(self, worker_id: str, *, lost: bool) -> Worker:
        """Forget a worker's cached blocks and event sequence (``EventApplier.reset_events``)."""
        return self._events.reset_events(worker_id, lost=lost)

    def engine_hash_steps(self, worker_id: str, step: int = 1 << 62) -> Iterator[None]:
        """Build the worker's key -> engine hash map in parts (``EngineHashMaps.steps``)."""
        return self._engine_hashes.steps(self.workers.get(worker_id), step)

    # ---- eviction advice and snapshots (``advice``) ---------------------------------------
    def export_blocks(self, worker_id: str) -> list[tuple[int, int | None, int]]:
        """``(key, parent key or None, engine hash or 0)`` of every block the worker holds,
        parents before children (a chain's top names a parent this worker does not hold)."""
        return self._advice.export_blocks(worker_id)

    def export_steps(
        self, worker_id: str, step: int = 1 << 62, unheld: list[tuple[int, int | None]] | None = None
    ) -> Iterator[list[tuple[int, int | None, int]]]:
        """``export_blocks`` in parts, each after visiting at most ``step`` blocks, with the
        blocks nobody holds that they hang under put in ``unheld`` (``Advisor.export_steps``)."""
        return self._advice.export_steps(worker_id, step, unheld)

    def import_blocks(
        self, worker_id: str, blocks: Iterable[tuple[int, int | None, int]], unheld: Mapping[int, int | None] | None = None
    ) -> list[tuple[int, int | None, int]]:
        """Store exported blocks (parents first), putting back the ``unheld`` blocks above them;
        returns those whose parent is not in yet (``Advisor.import_blocks``)."""
        return self._advice.import_blocks(worker_id, blocks, unheld)

    def evict_hint(self, req: EvictRequest, pinned_engine_hashes: Iterable[int] = ()) -> EvictAdvice:
        return self._advice.evict_hint(req, pinned_engine_hashes)

    def evict_hint_steps(
        self, req: EvictRequest, pinned_engine_hashes: Iterable[int] = (), step: int | None = None
    ) -> Generator[None, None, EvictAdvice]:
        """``evict_hint`` in parts of about ``step`` entries (``Advisor.evict_hint_steps``)."""
        return self._advice.evict_hint_steps(req, pinned_engine_hashes, step)

    def blocks_to_free(self, worker_id: str, tokens: int) -> int:
        """Blocks needed to free ``tokens`` tokens (rounded up)."""
        return self._advice.blocks_to_free(worker_id, tokens)
