"""Membership: which workers the router routes to, and what they report about themselves.

Registering a worker gives it an index slot and shows it to every routing policy
(``on_worker_added``); client-chosen sizes are checked first so ListWorkers and GetStats
always fit one message. Removing one takes it out of routing, the policies and the load
ledger at once and returns the steps that drop its blocks (``slots``), so a worker of a
million blocks never stalls routing. Draining (no new requests), the load engines report
(queued and running requests, KV utilization, loaded LoRA adapters) and the host's admission
queues are kept on the ``Worker`` for the policies to read. A worker's declared models and
adapters, its role and its address are part of its description: changing them bumps the
registry's generation, so the model pools (``pools``) are rebuilt, and so is what ext_proc
read of a gateway's subset hint (endpoints by address).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..bounds import MAX_REPORTED_REQUESTS, check_range
from ..errors import InvalidRequest, Overloaded, quote
from ..index.workers import Worker, WorkerSpec
from ..protocols import CacheMode, WorkerState
from .engine_hashes import EngineHashMaps
from .events import EventApplier
from .ledger import LoadLedger
from .pools import Pools
from .shared import Shared, log
from .slots import RetiredSlots

__all__ = ["Membership"]


def _described_length(spec: WorkerSpec) -> int:
    return (len(spec.id) + len(spec.address) + len(spec.kv_events_endpoint)
            + sum(len(k) + len(v) for k, v in spec.labels.items())
            + sum(map(len, spec.models)) + sum(map(len, spec.loras)))


class Membership:
    """Adds, updates and removes workers; their draining flag and reported load."""

    def __init__(self, shared: Shared, events: EventApplier, ledger: LoadLedger, hashes: EngineHashMaps,
                 slots: RetiredSlots, pools: Pools) -> None:
        self._shared = shared
        self._pools = pools
        self._events = events
        self._ledger = ledger
        self._hashes = hashes
        self._slots = slots
        #: ``_described_length`` summed over the registered workers' specs, kept as they come,
        #: change and go: summed afresh on every registration, a fleet of 1,024 took 431 ms to
        #: register (0.8 ms a worker at the end, on the event loop)
        self._described = 0

    def add_worker(self, spec: WorkerSpec) -> Worker:
        """Register a worker, or update an existing one's description in place."""
        shared = self._shared
        self.check_worker_sizes(spec)
        spec.validate(shared.block_size)
        existing = shared.workers.find(spec.id)
        if existing is not None:
            if existing.spec.mode != spec.mode:
                # the cache view was built under the other mode; start it afresh
                self._events.clear_worker(existing)
            old = existing.spec
            if ((old.models, old.loras, old.max_loras, old.role, old.address, old.mode)
                    != (spec.models, spec.loras, spec.max_loras, spec.role, spec.address, spec.mode)):
                # its model pools, LoRA tiers, its hop, where it is or how its cache is known
                # (cache_aware's match rule, worked out per membership) change
                shared.workers.generation += 1
            self._described += _described_length(spec) - _described_length(old)
            existing.spec = spec
            if spec.mode is CacheMode.APPROXIMATE:  # its capacity may have shrunk below what it holds
                self._ledger.fit_to_capacity(existing, shared.clock.now())
            return existing
        slot = shared.workers.next_slot()
        shared.index.add_slot(slot)
        worker = shared.workers.add(spec, shared.clock.now())
        self._described += _described_length(spec)
        assert worker.slot == slot
        for policy in shared.policies.routing.values():
            policy.on_worker_added(worker)
        log.info("worker added", extra={"worker_id": spec.id, "slot": slot, "mode": spec.mode.name})
        return worker

    def check_worker_sizes(self, spec: WorkerSpec) -> None:
        """Client-chosen sizes: each field within its limit (INVALID_ARGUMENT), and all workers'
        descriptions together small enough for ListWorkers to answer (RESOURCE_EXHAUSTED).
        ``add_worker`` checks them first; hosts call this before checks that quote the spec."""
        s = self._shared.settings
        workers = self._shared.workers
        replacing = workers.find(spec.id)
        if len(spec.id) > s.max_id_length:
            raise InvalidRequest(f"worker.id {quote(spec.id)} is longer than limits.max_id_length={s.max_id_length}")
        for name, value in (("address", spec.address), ("kv_events_endpoint", spec.kv_events_endpoint)):
            if len(value) > s.max_address_length:
                raise InvalidRequest(f"worker {spec.id!r}: {name} {quote(value)} is longer than "
                                     f"limits.max_address_length={s.max_address_length}")
        for what, names in (("models", spec.models), ("loras", spec.loras)):
            for name in names:
                if len(name) > s.max_id_length:
                    raise InvalidRequest(f"worker {spec.id!r}: {what} entry {quote(name)} is longer than "
                                         f"limits.max_id_length={s.max_id_length}")
        labels = sum(len(k) + len(v) for k, v in spec.labels.items())
        if labels > s.max_labels_length:
            raise InvalidRequest(f"worker {spec.id!r}: labels of {labels} characters exceed "
                                 f"limits.max_labels_length={s.max_labels_length}")
        if s.max_workers_description_length:
            total = self._described + _described_length(spec) - (_described_length(replacing.spec) if replacing else 0)
            if total > s.max_workers_description_length:
                raise Overloaded(
                    f"worker {spec.id!r}: the workers' ids, addresses, endpoints and labels would total {total} "
                    f"characters, over {s.max_workers_description_length} (half of limits.max_message_bytes): "
                    "ListWorkers and GetStats could no longer answer"
                )

    def detach_worker(self, worker_id: str, step: int = 1 << 62) -> tuple[Worker, Iterator[int]]:
        """Remove a worker at once from routing, membership and the policies, and return
        with it the steps that drop its blocks from the index, at most ``step`` blocks each.

        Until the steps are exhausted the worker's slot stays reserved (a new worker cannot
        inherit its blocks) and its blocks only count towards ``len(index)``: no routing mask
        includes the slot. A host yields to its loop between steps so a worker of a million
        blocks never stalls routing (``Router.remove_worker`` runs them all at once).
        """
        shared = self._shared
        worker = shared.workers.get(worker_id)
        self._ledger.forget_worker(worker_id)
        shared.workers.remove(worker_id, free_slot=False)
        self._described -= _described_length(worker.spec)
        reverse = self._hashes.forget(worker.slot)
        for policy in shared.policies.routing.values():
            policy.on_worker_removed(worker)
        log.info("worker removed", extra={"worker_id": worker_id})
        return worker, self._slots.drop_steps(worker.slot, step, reverse)

    def set_draining(self, worker_id: str, draining: bool) -> Worker:
        workers = self._shared.workers
        worker = workers.get(worker_id)
        if draining:
            worker.state = WorkerState.DRAINING
        elif worker.state is WorkerState.DRAINING:
            worker.state = WorkerState.READY
        workers.generation += 1
        return worker

    def report_load(self, worker_id: str, queued: int, running: int, kv_utilization: float,
                    loaded_loras: Sequence[str] | None = None) -> None:
        """An engine's own load; ``loaded_loras`` (None = not reported) replaces the adapters the
        router believes it has loaded (``Pools.report``). Checked whole before anything changes."""
        check_range("queued_requests", queued, 0, MAX_REPORTED_REQUESTS)
        check_range("running_requests", running, 0, MAX_REPORTED_REQUESTS)
        if not 0.0 <= kv_utilization <= 1.0:
            raise InvalidRequest(f"kv_utilization must be in [0, 1], got {kv_utilization}")
        if loaded_loras is not None:
            loaded_loras = self._pools.check_names(loaded_loras, "loaded_loras", self._shared.settings.max_id_length)
        worker = self._shared.workers.get(worker_id)
        worker.reported_queue, worker.reported_running, worker.kv_utilization = queued, running, kv_utilization
        worker.reported_at = self._shared.clock.now()
        if loaded_loras is not None:
            self._pools.report(worker, loaded_loras)

    def note_admission_queue(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        """The host's admission queue for ``worker_id`` now holds ``requests`` waiting
        requests needing ``prefill_tokens`` there (``AdmissionQueues(on_change=...)``)."""
        worker = self._shared.workers.find(worker_id)
        if worker is not None:
            worker.queued_requests, worker.queued_prefill_tokens = requests, prefill_tokens
