"""Workers and the load the router has committed to them.

A worker may declare the models it serves (its model pool), the LoRA adapters it can load,
how many it holds loaded at once and its prefill/decode role; ``Worker.loras`` is which
adapters the router believes are loaded there (``router.pools`` keeps it).

Load has two sources: what the router itself dispatched (in-flight requests and their
uncached prefill tokens, committed on Route and released on Complete or after a timeout)
and what the engine last reported (queue, running requests, KV utilisation). Policies read
both; only the host mutates them.

Where the extension is built, the dispatched load lives in the registry's ``SlotLoads``, one
int64 array per kind indexed by slot, and ``Worker.inflight_requests`` and
``pending_prefill_tokens`` read and write it there (``_native.c``: SlotLoad): it is their only
copy, and the candidate scan of every Route (``policies._scan``) reads it by slot instead of
visiting each of 1,024 Worker objects. In pure Python they are plain members.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from ..bounds import MAX_CAPACITY_BLOCKS
from ..decimals import parse_decimal
from ..errors import Conflict, InvalidRequest, NotFound, quote
from ..protocols import CacheMode, WorkerRole, WorkerState
from .groups import GroupPresence
from . import native
from .native import u64_map
from .pages import PageChains

__all__ = ["MAX_LORAS", "MAX_POOL_NAMES", "MAX_WORKERS", "Entry", "InFlight", "Worker", "WorkerRegistry", "WorkerSpec",
           "is_host_port", "named_among", "named_among_py", "new_inflight", "routing_mask"]

#: Upper bound on simultaneously registered workers; slots index a bitmask, so this is a
#: sanity limit rather than a data-structure one.
MAX_WORKERS = 4096

#: Largest engine page (``block_size``) a worker may declare; engines use 1 to 256 tokens.
#: Pages need not match the router's blocks: ``index.pages`` re-chunks them.
MAX_PAGE_SIZE = 65536

#: Most models, and most adapters, one worker may declare (each list separately).
MAX_POOL_NAMES = 256

#: Largest ``max_loras`` a worker may declare (vLLM's default is 1; fleets run 4 to 64).
MAX_LORAS = 1024


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """How a worker is described in config and RegisterWorker."""

    id: str
    address: str
    capacity_blocks: int = 0
    block_size: int = 0  # the engine's page size in tokens; 0 = the router's block size
    labels: Mapping[str, str] = field(default_factory=dict)
    mode: CacheMode = CacheMode.APPROXIMATE
    kv_events_endpoint: str = ""
    #: base models the worker serves (its model pool); () = any model, as before pools existed
    models: tuple[str, ...] = ()
    #: LoRA adapters it can load; () = any adapter of a model it serves (run-time loading)
    loras: tuple[str, ...] = ()
    #: most adapters the engine holds loaded at once (vLLM ``--max-loras``); 0 = unknown
    max_loras: int = 0
    role: WorkerRole = WorkerRole.BOTH

    def validate(self, router_block_size: int) -> None:
        if not self.id:
            raise InvalidRequest("worker.id must not be empty")
        if len(self.id) > 253:
            raise InvalidRequest("worker.id must be at most 253 characters")
        if not self.address:
            raise InvalidRequest(f"worker {self.id!r}: address must not be empty")
        if not 0 <= self.block_size <= MAX_PAGE_SIZE:
            raise InvalidRequest(f"worker {self.id!r}: block_size must be in [0, {MAX_PAGE_SIZE}], got {self.block_size}")
        if not 0 <= self.capacity_blocks <= MAX_CAPACITY_BLOCKS:
            raise InvalidRequest(f"worker {self.id!r}: capacity_blocks must be in [0, {MAX_CAPACITY_BLOCKS}] "
                                 f"(0 = unknown), got {self.capacity_blocks}")
        for name, names in (("models", self.models), ("loras", self.loras)):
            if len(names) > MAX_POOL_NAMES:
                raise InvalidRequest(f"worker {self.id!r}: {len(names)} {name}, at most {MAX_POOL_NAMES}")
            if "" in names:
                raise InvalidRequest(f"worker {self.id!r}: {name} must not contain an empty name")
        if not 0 <= self.max_loras <= MAX_LORAS:
            raise InvalidRequest(f"worker {self.id!r}: max_loras must be in [0, {MAX_LORAS}] (0 = unknown), "
                                 f"got {self.max_loras}")


def is_host_port(address: str) -> bool:
    """``host:port`` or ``[v6]:port`` with a port in 1-65535."""
    host, colon, digits = address.rpartition(":")
    port = parse_decimal(digits)
    if not colon or not host or port is None or not 1 <= port <= 65535:
        return False
    if host.startswith("["):
        return host.endswith("]") and len(host) > 2
    return ":" not in host and "/" not in host and not any(c.isspace() for c in host)


#: where a worker's dispatched load is kept (module docstring): its registry's SlotLoads, or
#: its own members
_LOAD_MEMBERS = ("slot_loads",) if native.module is not None else ("inflight_requests", "pending_prefill_tokens")


class Worker:
    """A registered worker: its spec, its index slot, state and load."""

    __slots__ = (
        "batches_applied",
        "engine_keys",
        "events_rejected",
        "gaps",
        "groups",
        "id",
        "kv_utilization",
        "last_event_at",
        "last_sequence",
        "loras",
        "pages",
        "queued_prefill_tokens",
        "queued_requests",
        "registered_at",
        "reported_at",
        "reported_queue",
        "rejecting_streak",
        "reported_running",
        "resync_needed",
        "slot",
        "spec",
        "state",
        "state_reason",
        *_LOAD_MEMBERS,
    )

    #: requests dispatched here and not completed, and the prompt tokens they still prefill here
    inflight_requests: int
    pending_prefill_tokens: int
    if native.module is not None:
        inflight_requests = native.module.SlotLoad(0)
        pending_prefill_tokens = native.module.SlotLoad(1)

    def __init__(self, spec: WorkerSpec, slot: int, now: float, loads: Any = None) -> None:
        """``loads``: the registry's SlotLoads where the extension is built (None: a store of
        the worker's own)."""
        self.spec = spec
        #: ``spec.id``, read on every decision (a property read was a Python call): a worker
        #: re-registered in place gets a new spec under the same id (``router.membership``)
        self.id = spec.id
        self.slot = slot
        if native.module is not None:
            self.slot_loads = loads if loads is not None else native.module.SlotLoads()
        self.state = WorkerState.READY
        #: why the worker is DEGRADED ("event gap", "removal lost", ...); "" otherwise
        self.state_reason = ""
        self.inflight_requests = 0  # a reused slot's previous worker took its loads along (``remove``)
        self.pending_prefill_tokens = 0
        self.reported_queue = 0
        self.reported_running = 0
        #: clock time of the engine's last ReportLoad (0 = never reported)
        self.reported_at = 0.0
        self.kv_utilization = 0.0
        #: requests waiting for this worker in the router's admission queue, and the prefill
        #: tokens they need here (kept by the host: ``Router.note_admission_queue``)
        self.queued_requests = 0
        self.queued_prefill_tokens = 0
        #: engine hash -> our key, for engines whose hashes are not our keys (one entry per
        #: cached block for vLLM/SGLang, so a compact uint64 map where the extension is built)
        self.engine_keys: MutableMapping[int, int] = u64_map()
        #: last applied event-batch sequence number (-1 = none yet)
        self.last_sequence = -1
        #: events were lost and only the publisher can mend the view (Cleared + its full state,
        #: or an engine restart); publishers read it in PublishEventsResponse.workers
        self.resync_needed = False
        self.gaps = 0
        #: event batches applied (duplicates excluded), and when the last one was (0.0 = never):
        #: a decode worker that never publishes has no cache the P/D bypass check can read
        self.batches_applied = 0
        self.last_event_at = 0.0
        #: cache events that could not be applied, by reason (``errors.RejectedEvent.reason``)
        self.events_rejected: dict[str, int] = {}
        #: engine batches in a row whose stored events were all rejected
        self.rejecting_streak = 0
        #: engine pages that are not the router's blocks, and hybrid KV-group presence;
        #: created on first use (``index.pages``, ``index.groups``)
        self.pages: PageChains | None = None
        self.groups: GroupPresence | None = None
        #: LoRA adapters believed loaded, least recently used first (``router.pools`` keeps it)
        self.loras: dict[str, None] = {}
        self.registered_at = now

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def mode(self) -> CacheMode:
        return self.spec.mode

    @property
    def bit(self) -> int:
        return 1 << self.slot

    @property
    def eligible(self) -> bool:
        """May receive new requests (degraded workers still serve; their cache view is stale)."""
        return self.state is not WorkerState.DRAINING

    def __repr__(self) -> str:
        return f"Worker({self.id!r}, slot={self.slot}, {self.state.name})"


def routing_mask(workers: Iterable[Worker]) -> int:
    """The routing mask of ``workers``: their ``bit``s or-ed, each read from its slot (the
    property's call per worker was most of the pass over a 1,024-worker list)."""
    mask = 0
    for w in workers:
        mask |= 1 << w.slot
    return mask


def named_among_py(candidates: Sequence[Worker], wanted: AbstractSet[str]) -> tuple[list[Worker], int]:
    """The candidates whose id is in ``wanted``, in order, and their routing mask: the reference
    of the native ``named_among`` (``_native.c``)."""
    named = [w for w in candidates if w.id in wanted]
    return named, routing_mask(named)


def named_among(candidates: Sequence[Worker], wanted: AbstractSet[str]) -> tuple[list[Worker], int]:
    """``named_among_py``, natively where the extension is built: a Route naming many of a big
    fleet's workers (a gateway's endpoint subset, deadline admission's reroute among those that
    meet the SLO) is narrowed to them in one pass, not a comprehension and an or of wide ints."""
    if native.module is not None:
        found = native.module.named_among(candidates, wanted)
        if found is not NotImplemented:
            return found  # type: ignore[no-any-return]
    return named_among_py(candidates, wanted)


#: most worker lists whose masks and native slots ``ListScans`` keeps per membership: the
#: lists that come back on every Route are few, one narrowed for one request only passes through
MAX_CACHED_LISTS = 64


class ListScans:
    """The routing mask and native ``CandidateSlots`` (None in pure Python) of worker lists that
    come back Route after Route: a model's pool, an adapter's residency tiers, a P/D pool's hops,
    each a list the router keeps per membership. Given its slots, the candidate scan and the
    least-loaded tie-break read every load from one array instead of each Worker (over 1,024
    idle workers, a pool's Route took ~90 us against ~51 for the same fleet unpooled). Kept by list
    identity (the entry holds the list, so its id is not reused while kept), dropped when the
    membership generation changes and past ``MAX_CACHED_LISTS`` lists."""

    __slots__ = ("_generation", "_kept")

    def __init__(self) -> None:
        self._generation = -1
        self._kept: dict[int, tuple[list[Worker], int, object]] = {}

    def of(self, workers: list[Worker], generation: int) -> tuple[int, object]:
        """``(mask, slots)`` of ``workers``, a list of the registry at ``generation``."""
        if generation != self._generation:
            self._kept.clear()
            self._generation = generation
        hit = self._kept.get(id(workers))
        if hit is None or hit[0] is not workers:
            if len(self._kept) >= MAX_CACHED_LISTS:
                self._kept.clear()
            slots = native.module.CandidateSlots(workers) if native.module is not None else None
            hit = self._kept[id(workers)] = (workers, routing_mask(workers), slots)
        return hit[1], hit[2]


@dataclass(slots=True)
class InFlight:
    """A routed request charged to its worker until it completes or expires. The registry keeps
    it as an ``Entry`` and hands out this view of it."""

    request_id: str
    worker_id: str
    prefill_tokens: int
    prompt_tokens: int
    overlap_blocks: int
    started_at: float
    policy: str


#: an ``InFlight`` as the registry keeps it: its fields in order in a plain tuple of strs, ints
#: and a float, which the garbage collector stops tracking at its first pass over it. Tens of
#: thousands of requests are in flight at once (a client that never completes keeps each for
#: ``inflight_timeout_s``), and as tracked objects every full collection walked them all: 45-93
#: ms at 60k, against 0.7 ms with none (issue #28 item 6).
Entry = tuple[str, str, int, int, int, float, str]

#: an InFlight from its Entry without the dataclass ``__init__`` (seven stores, on every Complete);
#: the ledger's native ``ledger_finish`` releases through ``registry_release`` with it too
new_inflight = native.positional_constructor(InFlight)

#: ``WorkerRegistry.charge`` and ``.release`` in one native call each (None: no extension)
_registry_charge = native.module.registry_charge if native.module is not None else None
_registry_release = native.module.registry_release if native.module is not None else None


class WorkerRegistry:
    """Workers by id, their slots, and the requests routed to them and not yet completed."""

    # members, not a dict: the native passes (index/_native.c, attr_get) read and write them
    # in place, where the generic lookup was ~190 instructions each
    __slots__ = ("_free_slots", "_inflight", "_inflight_order", "_next_slot", "_workers", "generation", "loads")

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        #: request id -> its entry, and the entries oldest first (``expire``); see ``Entry``
        self._inflight: dict[str, Entry] = {}
        self._inflight_order: deque[Entry] = deque()
        #: the workers' dispatched load by slot, where the extension is built (module docstring)
        self.loads = native.module.SlotLoads() if native.module is not None else None
        #: bumps on every membership change so policies can cache per-membership state
        self.generation = 0

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._workers.values())

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise NotFound(f"unknown worker {quote(worker_id)}") from None

    def find(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def next_slot(self) -> int:
        """The slot the next new worker will get (does not reserve it)."""
        return min(self._free_slots) if self._free_slots else self._next_slot

    def add(self, spec: WorkerSpec, now: float) -> Worker:
        if spec.id in self._workers:
            raise Conflict(f"worker {spec.id!r} is already registered")
        if len(self._workers) >= MAX_WORKERS:
            raise Conflict(f"at most {MAX_WORKERS} workers may be registered")
        if self._free_slots:
            self._free_slots.sort()
            slot = self._free_slots.pop(0)
        else:
            slot = self._next_slot
            self._next_slot += 1
        worker = Worker(spec, slot, now, self.loads)
        self._workers[spec.id] = worker
        self.generation += 1
        return worker

    def remove(self, worker_id: str, free_slot: bool = True) -> Worker:
        """Forget a worker. With ``free_slot=False`` its slot stays taken until
        ``free_slot(slot)``: the host is still dropping the slot's blocks from the index."""
        worker = self.get(worker_id)
        del self._workers[worker_id]
        if self.loads is not None:
            # it keeps the load it had, in a store of its own; its slot's next worker starts at 0
            worker.slot_loads = self.loads.detach(worker.slot)
        if free_slot:
            self._free_slots.append(worker.slot)
        for rid in [e[0] for e in self._inflight.values() if e[1] == worker_id]:
            del self._inflight[rid]
        self.generation += 1
        return worker

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def move(self, worker: Worker, slot: int) -> None:
        """Give ``worker`` the free slot ``slot`` (``next_slot()``); its old slot stays taken
        until ``free_slot``: the host is still dropping the old slot's blocks."""
        if slot in self._free_slots:
            self._free_slots.remove(slot)
        elif slot == self._next_slot:
            self._next_slot += 1
        else:
            raise ValueError(f"slot {slot} is not free")
        if self.loads is not None:
            self.loads.move(worker.slot, slot)  # its load is kept by slot: it moves along
        worker.slot = slot
        self.generation += 1

    # ---- load ----------------------------------------------------------------------
    def inflight(self, request_id: str) -> InFlight | None:
        entry = self._inflight.get(request_id)
        return None if entry is None else new_inflight(*entry)

    def inflight_worker(self, request_id: str) -> str | None:
        """The worker a request in flight was routed to (None: not in flight)."""
        entry = self._inflight.get(request_id)
        return None if entry is None else entry[1]

    @property
    def inflight_count(self) -> int:
        return len(self._inflight)

    def commit(self, entry: InFlight) -> None:
        """Charge a routed request to its worker until ``release``."""
        self.charge(self._workers[entry.worker_id], entry.request_id, entry.prefill_tokens, entry.prompt_tokens,
                    entry.overlap_blocks, entry.started_at, entry.policy)

    def charge(self, worker: Worker, request_id: str, prefill_tokens: int, prompt_tokens: int, overlap_blocks: int,
               started_at: float, policy: str) -> None:
        """``commit`` of an ``InFlight`` with these fields, routed to ``worker`` (registered
        here): the ledger's every Route, without building the InFlight to take it apart."""
        if _registry_charge is None or _registry_charge(self, worker, request_id, prefill_tokens, prompt_tokens,
                                                        overlap_blocks, started_at, policy) is NotImplemented:
            self._charge_py(worker, request_id, prefill_tokens, prompt_tokens, overlap_blocks, started_at, policy)

    def _charge_py(self, worker: Worker, request_id: str, prefill_tokens: int, prompt_tokens: int,
                   overlap_blocks: int, started_at: float, policy: str) -> None:
        """``charge``'s reference, of the native ``registry_charge`` (``_native.c``), which
        handles arguments of their exact types."""
        if request_id in self._inflight:
            raise Conflict(f"request {request_id!r} is already in flight")
        kept: Entry = (str(request_id), str(worker.id), int(prefill_tokens), int(prompt_tokens), int(overlap_blocks),
                       float(started_at), str(policy))
        worker.inflight_requests += 1
        worker.pending_prefill_tokens += kept[2]
        self._inflight[request_id] = kept
        self._inflight_order.append(kept)

    def release(self, request_id: str) -> InFlight:
        """Stop charging ``request_id`` to its worker; raises NotFound for one not in flight."""
        if _registry_release is not None:
            released = _registry_release(self, request_id, new_inflight)
            if released is not NotImplemented:
                return released  # type: ignore[no-any-return]
        return self._release_py(request_id)

    def _release_py(self, request_id: str) -> InFlight:
        """``release``'s reference, of the native ``registry_release`` (``_native.c``)."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            raise NotFound(f"request {quote(request_id)} is not in flight (unknown, completed or expired)")
        worker = self._workers.get(entry[1])
        if worker is not None:
            worker.inflight_requests -= 1
            worker.pending_prefill_tokens -= entry[2]
        return new_inflight(*entry)

    def expire(self, older_than: float) -> list[InFlight]:
        """Release requests started before ``older_than`` that never completed."""
        expired: list[InFlight] = []
        order = self._inflight_order
        inflight = self._inflight
        while order and order[0][5] < older_than:
            entry = order.popleft()
            if inflight.get(entry[0]) is entry:
                expired.append(self.release(entry[0]))
        # completed entries linger in the deque until they reach its head; keep it bounded
        if len(order) > 4 * len(inflight) + 1024:
            self._inflight_order = deque(e for e in order if inflight.get(e[0]) is e)
        return expired
