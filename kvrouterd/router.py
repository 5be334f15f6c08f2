"""The router: one brain shared by the daemon (``server/``) and the simulator (``sim/``).

It owns the global index, the worker registry and the policy objects, and turns the core
vocabulary (``protocols``) into state changes and decisions. It is synchronous and does no
I/O; hosts call it from one thread (the daemon's event loop, the simulator's loop) and supply
the clock and the random generator.

Every public method validates its input completely before it changes anything, so a call
that raises ``errors.KVRouterError`` leaves the router exactly as it was.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import random
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .bounds import MAX_OUTPUT_TOKENS, MAX_REPORTED_REQUESTS, check_completion, check_range
from .clock import Clock
from .errors import ConfigError, InvalidRequest, NoEligibleWorker, NotFound, Overloaded, RejectedEvent, UnknownPolicy, quote
from .index.groups import GroupPresence
from .index.keys import ROOT_SEED, chain_keys_array, chain_keys_with_extras, namespace_seed, tokens_to_bytes
from .index.native import u64_array, u64_map
from .index.pages import PageChains
from .index.radix import Block, RadixIndex
from .index.workers import MAX_WORKERS, InFlight, Worker, WorkerRegistry, WorkerSpec
from .policies import registry
from .policies.base import AccessInfo, EvictionContext, EvictionPolicy, RoutingContext, RoutingPolicy, drop_blocks
from .policies.eviction._leaves import score_leaves_steps, still_evictable
from .policies.eviction._release import release_steps
from .protocols import (
    BatchOutcome,
    CacheMode,
    Cleared,
    Completion,
    Decision,
    Dispatch,
    EventBatch,
    EvictAdvice,
    EvictRequest,
    Removed,
    RouteRequest,
    Stored,
    WorkerState,
)

__all__ = ["RouteResult", "Router", "RouterSettings"]


log = logging.getLogger("kvrouterd.router")

#: How many recently routed prompt blocks remember their request's AccessInfo, so that an
#: engine's later Stored event for them reaches metadata-aware eviction policies (~150 B each).
RECENT_ACCESS_KEYS = 1 << 17

#: Engine batches in a row whose stored events were all rejected before the worker shows
#: DEGRADED: one odd event is noise, a stream of them means the router's view is starving.
REJECTING_AFTER = 3

#: the AccessInfo of blocks no routed request explains; frozen, so one instance serves every event
#: (building one per stored event cost 8,700 instructions by callgrind, ~270 a block of a 32-block event)
_NO_ACCESS_INFO = AccessInfo()

#: hybrid KV-cache groups per worker the router tracks (vLLM ``group_idx``)
MAX_KV_GROUPS = 64

#: a worker holding more blocks than this is cleared (an engine's Cleared, a restart, lost
#: events) by moving it to a fresh, empty slot at once and dropping the old slot's blocks and
#: eviction state in steps (``drain_step``); fewer are dropped in place. A 400k-block worker
#: took 2.3 s to clear in place, all of it on the routing loop (issue #16 item 1).
CLEAR_IN_PLACE_BLOCKS = 4096
#: blocks (or eviction-state entries) one step of a drain drops: ~1.5 ms idle, 3-5 times that
#: on a loaded 2-core machine
DRAIN_STEP_BLOCKS = 512


#: Completed request ids remembered while replicas share load (each ~100 B): a Dispatch that
#: arrives after its request's completion (a Complete sent to another replica overtook it) is
#: then not charged. Entries also go after ``inflight_timeout_s``.
MAX_COMPLETED_IDS = 1 << 18

#: bytes an in-flight request costs besides its block keys and ids (RouteRequest, InFlight,
#: dict and deque entries); an estimate, so ``limits.max_inflight_bytes`` bounds real memory
INFLIGHT_ENTRY_BYTES = 512


def request_bytes(req: RouteRequest) -> int:
    """What ``req`` costs in the in-flight table: keys as stored (8 bytes in an ``array('Q')``,
    ~40 as Python ints in a list), its strings, the entry overhead."""
    keys = req.keys
    per_key = 8 if isinstance(keys, array) else 40
    size = (INFLIGHT_ENTRY_BYTES + per_key * len(keys) + len(req.request_id) + len(req.session_id)
            + len(req.model) + len(req.policy))
    if req.candidate_workers:  # rare; twice per Route otherwise, so no empty generator
        size += sum(len(c) + 56 for c in req.candidate_workers)
    return size


def _described_length(spec: WorkerSpec) -> int:
    return (len(spec.id) + len(spec.address) + len(spec.kv_events_endpoint)
            + sum(len(k) + len(v) for k, v in spec.labels.items()))


#: largest TTFT objective a request may set, ms (a day; inf, NaN and 1e308 overflowed policies' maths)
MAX_TTFT_SLO_MS = 86_400_000.0


@dataclass(frozen=True)
class RouterSettings:
    """What the router core needs from the configuration."""

    block_size: int = 16
    routing: Mapping[str, Any] = field(default_factory=lambda: {"name": "cache_aware"})
    #: extra routing policies requests may name, besides the default one
    extra_routing: Sequence[Mapping[str, Any]] = ()
    eviction: Mapping[str, Any] = field(default_factory=lambda: {"name": "lru"})
    #: a request not completed within this many seconds stops counting as load
    inflight_timeout_s: float = 300.0
    max_prompt_tokens: int = 1 << 20
    #: default TTFT objective for policies that use one, ms
    default_ttft_slo_ms: float = 5000.0
    #: most blocks one EvictHint ranks: ranking costs grow with the answer, and the call runs
    #: on the routing loop (an engine wanting more asks again after evicting these)
    max_evict_blocks: int = 1024
    #: most pinned keys and engine hashes one eviction hint may list together
    max_evict_pinned: int = 65536
    #: client-chosen sizes (config ``limits.*``): ids, worker addresses and labels, characters
    max_id_length: int = 256
    max_address_length: int = 1024
    max_labels_length: int = 16384
    #: most bytes the in-flight table may hold (``Router.inflight_bytes``); 0 = no limit (the
    #: simulator), the daemon's config always sets one
    max_inflight_bytes: int = 0
    #: modelled cache size of an approximate-mode worker without ``capacity_blocks``; 0 = such a
    #: worker's model is unbounded (the simulator's "infinite cache"), the daemon always sets one
    approximate_capacity_blocks: int = 0
    #: most characters all workers' descriptions (ids, addresses, endpoints, labels) may total,
    #: so ListWorkers and GetStats still fit in one message; 0 = no limit
    max_workers_description_length: int = 0

    def validate(self) -> None:
        if not 1 <= self.block_size <= 4096:
            raise ConfigError(f"block_size must be in [1, 4096], got {self.block_size}")
        if self.inflight_timeout_s <= 0:
            raise ConfigError(f"inflight_timeout_s must be > 0, got {self.inflight_timeout_s}")
        if self.max_prompt_tokens <= 0:
            raise ConfigError(f"max_prompt_tokens must be > 0, got {self.max_prompt_tokens}")
        if self.max_evict_blocks <= 0:
            raise ConfigError(f"max_evict_blocks must be > 0, got {self.max_evict_blocks}")
        if self.max_evict_pinned <= 0:
            raise ConfigError(f"max_evict_pinned must be > 0, got {self.max_evict_pinned}")
        for name in ("max_id_length", "max_address_length", "max_labels_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_inflight_bytes", "approximate_capacity_blocks", "max_workers_description_length"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")


@dataclass(slots=True)
class RouteResult:
    """A committed decision and the worker it names."""

    decision: Decision
    worker: Worker
    request: RouteRequest
    alternative: Worker | None
    #: approximate mode: keys the eviction dropped from the worker's cache model to make room
    evicted: Sequence[int] = ()


@dataclass(slots=True)
class PrefixHits:
    """How close one policy's decisions came to the best cached prefix among their candidates.

    ``best``: the chosen worker held the longest cached prefix any candidate held;
    ``worse``: another candidate held a longer one; ``no_prefix``: no candidate held any.
    ``achieved_blocks / reachable_blocks`` is the block-weighted share.
    """

    best: int = 0
    worse: int = 0
    no_prefix: int = 0
    achieved_blocks: int = 0
    reachable_blocks: int = 0


def _invert_steps(mapping: Any, into: MutableMapping[int, int], step: int) -> Iterator[None]:
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


def _spec_name(spec: Mapping[str, Any] | str) -> str:
    return spec if isinstance(spec, str) else str(spec.get("name", ""))


class Router:
    def __init__(self, settings: RouterSettings, clock: Clock, rng: random.Random | None = None) -> None:
        settings.validate()
        self.settings = settings
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)
        self.block_size = settings.block_size
        self.index = RadixIndex()
        self.workers = WorkerRegistry()
        self._routing: dict[str, RoutingPolicy] = {}
        self.default_routing = _spec_name(settings.routing)
        for spec in (settings.routing, *settings.extra_routing):
            policy = registry.build("routing", spec, random.Random(self.rng.getrandbits(64)))
            self._routing[policy.name] = policy
        self.eviction: EvictionPolicy = registry.build("eviction", settings.eviction, random.Random(self.rng.getrandbits(64)))
        self._eviction_by_name: dict[str, EvictionPolicy] = {self.eviction.name: self.eviction}
        self._requests: dict[str, RouteRequest] = {}
        #: what the requests in ``_requests`` cost (``request_bytes``), against max_inflight_bytes
        self.inflight_bytes = 0
        #: what requests waiting in an admission queue hold (``hold_waiting``): their keys and
        #: ids are as much memory as an in-flight request's, so they count against the same budget
        self.waiting_bytes = 0
        #: block key -> (AccessInfo of the request that routed it, block offset); insertion-ordered,
        #: oldest dropped first. Filled only for event-mode workers whose policy reads metadata.
        self._recent_access: dict[int, tuple[AccessInfo, int]] = {}
        #: slot -> our key -> engine hash, kept only for workers that asked for an eviction hint
        self._engine_hash_of: dict[int, MutableMapping[int, int]] = {}
        #: slot -> the steps still building its ``_engine_hash_of`` map (``engine_hash_steps``)
        self._engine_hash_building: dict[int, Iterator[None]] = {}
        #: the steps that empty slots no worker routes to any more (cleared workers' old slots);
        #: the host runs them between calls (``drain_step``), ``apply`` runs one too
        self._drains: deque[Iterator[int]] = deque()
        self._candidates_gen = -1
        self._candidates: list[Worker] = []
        self._candidates_mask = 0
        self._request_counter = 0
        #: replica sync (``events.replica_sync``): the host publishes every local commit and
        #: completion through these and applies the other replicas' with ``apply_dispatch`` /
        #: ``apply_completion``. None (the default): this router is alone.
        self.on_committed: Callable[[RouteResult], None] | None = None
        self.on_completed: Callable[[Completion], None] | None = None
        #: request id -> when it completed (kept only while ``on_completed`` is set)
        self._completed: dict[str, float] = {}
        self.decisions_by_policy: dict[str, int] = {}
        #: policy -> achieved vs reachable prefix overlap of its decisions
        self.prefix_hits: dict[str, PrefixHits] = {}
        self.counters: dict[str, int] = {
            "decisions": 0, "batches_applied": 0, "batches_duplicate": 0, "gaps": 0,
            "restarts": 0, "blocks_stored": 0, "blocks_removed": 0, "orphan_blocks": 0,
            "unknown_removals": 0, "inflight_expired": 0, "approx_evicted": 0, "events_rejected": 0,
            "remote_dispatches": 0, "remote_completions": 0, "remote_late_dispatches": 0,
            "remote_unknown_workers": 0,
        }

    # ---- policies -------------------------------------------------------------------
    def routing_policy(self, name: str = "") -> RoutingPolicy:
        """The configured policy ``name`` (default if empty); registered-but-unconfigured
        policies are built with default parameters on first use."""
        name = name or self.default_routing
        policy = self._routing.get(name)
        if policy is None:
            if name not in registry.names("routing"):
                raise UnknownPolicy(f"unknown routing policy {quote(name)}; known: {', '.join(registry.names('routing'))}")
            policy = registry.build("routing", name, random.Random(self.rng.getrandbits(64)))
            for w in self.workers:
                policy.on_worker_added(w)
            self._routing[name] = policy
        return policy

    def eviction_policy(self, name: str = "") -> EvictionPolicy:
        if not name:
            return self.eviction
        policy = self._eviction_by_name.get(name)
        if policy is None:
            if name not in registry.names("eviction"):
                raise UnknownPolicy(f"unknown eviction policy {quote(name)}; known: {', '.join(registry.names('eviction'))}")
            policy = registry.build("eviction", name, random.Random(self.rng.getrandbits(64)))
            self._eviction_by_name[name] = policy
        return policy

    @property
    def routing_policies(self) -> Mapping[str, RoutingPolicy]:
        return self._routing

    def policy_counters(self) -> dict[str, dict[str, int]]:
        """policy name -> its rule counters (``RoutingPolicyBase.counters``), policies that keep any."""
        out = {}
        for name, policy in self._routing.items():
            counts = getattr(policy, "counters", None)
            found = counts() if callable(counts) else {}
            if found:
                out[name] = found
        return out

    def reload_routing(self, routing: Mapping[str, Any], extra_routing: Sequence[Mapping[str, Any]] = ()) -> list[str]:
        """Adopt new routing policy specs; rebuild only the policies whose parameters changed.

        All specs are validated before anything changes. A rebuilt policy starts with fresh
        learned state (latency models, decayed load) and sees every current worker through
        ``on_worker_added``; load the router commits per request is kept. Completions of
        requests the old object dispatched reach the new one, which ignores unknown ids.
        Returns the names of the policies replaced or added.
        """
        parsed = []
        for spec in (routing, *extra_routing):
            values = {"name": spec} if isinstance(spec, str) else dict(spec)
            name = values.pop("name", None)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"routing policy spec needs a 'name', got {spec!r}")
            parsed.append((name, spec, registry.build_params("routing", name, values)))
        changed = []
        for name, spec, params in parsed:
            current = self._routing.get(name)
            if current is not None and getattr(current, "params", None) == params:
                continue
            policy = registry.build("routing", spec, random.Random(self.rng.getrandbits(64)))
            for w in self.workers:
                policy.on_worker_added(w)
            self._routing[name] = policy
            changed.append(name)
        self.default_routing = parsed[0][0]
        self.settings = dataclasses.replace(self.settings, routing=routing, extra_routing=tuple(extra_routing))
        if changed:
            log.info("routing policies reloaded", extra={"policies": changed, "default": self.default_routing})
        return changed

    # ---- membership -----------------------------------------------------------------
    def add_worker(self, spec: WorkerSpec) -> Worker:
        """Register a worker, or update an existing one's description in place."""
        self.check_worker_sizes(spec)
        spec.validate(self.block_size)
        existing = self.workers.find(spec.id)
        if existing is not None:
            if existing.spec.mode != spec.mode:
                # the cache view was built under the other mode; start it afresh
                self._clear_worker(existing)
            existing.spec = spec
            return existing
        slot = self.workers.next_slot()
        self.index.add_slot(slot)
        worker = self.workers.add(spec, self.clock.now())
        assert worker.slot == slot
        for policy in self._routing.values():
            policy.on_worker_added(worker)
        log.info("worker added", extra={"worker_id": spec.id, "slot": slot, "mode": spec.mode.name})
        return worker

    def check_worker_sizes(self, spec: WorkerSpec) -> None:
        """Client-chosen sizes: each field within its limit (INVALID_ARGUMENT), and all workers'
        descriptions together small enough for ListWorkers to answer (RESOURCE_EXHAUSTED).
        ``add_worker`` checks them first; hosts call this before checks that quote the spec."""
        s = self.settings
        replacing = self.workers.find(spec.id)
        if len(spec.id) > s.max_id_length:
            raise InvalidRequest(f"worker.id {quote(spec.id)} is longer than limits.max_id_length={s.max_id_length}")
        for name, value in (("address", spec.address), ("kv_events_endpoint", spec.kv_events_endpoint)):
            if len(value) > s.max_address_length:
                raise InvalidRequest(f"worker {spec.id!r}: {name} {quote(value)} is longer than "
                                     f"limits.max_address_length={s.max_address_length}")
        labels = sum(len(k) + len(v) for k, v in spec.labels.items())
        if labels > s.max_labels_length:
            raise InvalidRequest(f"worker {spec.id!r}: labels of {labels} characters exceed "
                                 f"limits.max_labels_length={s.max_labels_length}")
        if s.max_workers_description_length:
            total = _described_length(spec) + sum(_described_length(w.spec) for w in self.workers if w is not replacing)
            if total > s.max_workers_description_length:
                raise Overloaded(
                    f"worker {spec.id!r}: the workers' ids, addresses, endpoints and labels would total {total} "
                    f"characters, over {s.max_workers_description_length} (half of limits.max_message_bytes): "
                    "ListWorkers and GetStats could no longer answer"
                )

    def remove_worker(self, worker_id: str) -> Worker:
        worker, blocks = self.detach_worker(worker_id)
        for _ in blocks:
            pass
        return worker

    def detach_worker(self, worker_id: str, step: int = 1 << 62) -> tuple[Worker, Iterator[int]]:
        """Remove a worker at once from routing, membership and the policies, and return
        with it the steps that drop its blocks from the index, at most ``step`` blocks each.

        Until the steps are exhausted the worker's slot stays reserved (a new worker cannot
        inherit its blocks) and its blocks only count towards ``len(index)``: no routing mask
        includes the slot. A host yields to its loop between steps so a worker of a million
        blocks never stalls routing (``remove_worker`` runs them all at once).
        """
        worker = self.workers.get(worker_id)
        for rid in [rid for rid, r in self._requests.items() if (f := self.workers.inflight(rid)) and f.worker_id == worker_id]:
            self._forget_request(rid)
        self.workers.remove(worker_id, free_slot=False)
        reverse = self._engine_hash_of.pop(worker.slot, None)
        self._engine_hash_building.pop(worker.slot, None)
        for policy in self._routing.values():
            policy.on_worker_removed(worker)
        log.info("worker removed", extra={"worker_id": worker_id})
        return worker, self._drop_slot_steps(worker.slot, step, reverse)

    def _drop_slot_steps(self, slot: int, step: int, reverse: MutableMapping[int, int] | None = None) -> Iterator[int]:
        """Empty a slot no worker routes to: its blocks, then every eviction policy's state for
        it and its engine-hash map ``reverse``, at most ``step`` of each at a time; then free it.
        Yields the blocks each part dropped (0 for the parts that release state)."""
        yield from self.index.clear_steps(slot, step)
        for ev in list(self._eviction_by_name.values()):
            for _ in ev.clear_steps(slot, step):
                yield 0
        if reverse:
            for _ in release_steps([reverse], step):
                yield 0
        self.index.drop_slot(slot)
        self.workers.free_slot(slot)

    # ---- draining slots ---------------------------------------------------------------
    @property
    def indexed_blocks(self) -> int:
        """The index's blocks as routing sees them, what operators read (GetStats, the gauge):
        all but those only retired slots hold, which leave the count at once though they are
        dropped in steps (a removed worker's slot, ``detach_worker``; a cleared worker's old
        one, ``drain_step``). Blocks that several retired slots share and no worker holds still
        count until one of those drains gets to them."""
        index = self.index
        live = {w.slot for w in self.workers}
        return len(index) - sum(index.count_alone(s) for s in index.slots() if s not in live)

    @property
    def draining(self) -> bool:
        """Some cleared worker's old slot still holds blocks or eviction state (``drain_step``)."""
        return bool(self._drains)

    def drain_step(self) -> bool:
        """One step of the oldest pending drain; False once none is left."""
        while self._drains:
            try:
                next(self._drains[0])
                return True
            except StopIteration:
                self._drains.popleft()
        return False

    def set_draining(self, worker_id: str, draining: bool) -> Worker:
        worker = self.workers.get(worker_id)
        if draining:
            worker.state = WorkerState.DRAINING
        elif worker.state is WorkerState.DRAINING:
            worker.state = WorkerState.READY
        self.workers.generation += 1
        return worker

    def report_load(self, worker_id: str, queued: int, running: int, kv_utilization: float) -> None:
        check_range("queued_requests", queued, 0, MAX_REPORTED_REQUESTS)
        check_range("running_requests", running, 0, MAX_REPORTED_REQUESTS)
        if not 0.0 <= kv_utilization <= 1.0:
            raise InvalidRequest(f"kv_utilization must be in [0, 1], got {kv_utilization}")
        worker = self.workers.get(worker_id)
        worker.reported_queue, worker.reported_running, worker.kv_utilization = queued, running, kv_utilization

    def note_admission_queue(self, worker_id: str, requests: int, prefill_tokens: int) -> None:
        """The host's admission queue for ``worker_id`` now holds ``requests`` waiting
        requests needing ``prefill_tokens`` there (``AdmissionQueues(on_change=...)``)."""
        worker = self.workers.find(worker_id)
        if worker is not None:
            worker.queued_requests, worker.queued_prefill_tokens = requests, prefill_tokens

    # ---- routing --------------------------------------------------------------------
    def keys_for_tokens(self, tokens: bytes | Sequence[int], model: str = "", lora: str = "", salt: str = "") -> array:
        """Block keys of a prompt given as token ids (a sequence or little-endian uint32 bytes),
        as an ``array('Q')`` (see ``index.keys.chain_keys_array``)."""
        data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
        return chain_keys_array(data, self.block_size, namespace_seed(model, lora, salt))

    def new_request_id(self) -> str:
        self._request_counter += 1
        return f"kvr-{self._request_counter:x}-{self.rng.getrandbits(32):08x}"

    def _eligible(self) -> tuple[list[Worker], int]:
        if self._candidates_gen != self.workers.generation:
            self._candidates = sorted((w for w in self.workers if w.eligible), key=lambda w: w.slot)
            mask = 0
            for w in self._candidates:
                mask |= w.bit
            self._candidates_mask = mask
            self._candidates_gen = self.workers.generation
        return self._candidates, self._candidates_mask

    def validate_request(self, req: RouteRequest) -> None:
        if req.prompt_tokens <= 0:
            raise InvalidRequest("the prompt is empty: send token_ids or block_keys")
        if req.prompt_tokens > self.settings.max_prompt_tokens:
            raise Overloaded(
                f"prompt of {req.prompt_tokens} tokens exceeds max_prompt_tokens={self.settings.max_prompt_tokens}"
            )
        if len(req.keys) > req.prompt_tokens // self.block_size:
            raise InvalidRequest(
                f"{len(req.keys)} block keys but prompt_tokens={req.prompt_tokens} holds at most "
                f"{req.prompt_tokens // self.block_size} blocks of {self.block_size}"
            )
        if not 0 <= req.ttft_slo_ms <= MAX_TTFT_SLO_MS:  # also NaN: every policy sees a sane number
            raise InvalidRequest(f"ttft_slo_ms must be in [0, {MAX_TTFT_SLO_MS:.0f}] (0 = default), got {req.ttft_slo_ms}")
        check_range("expected_output_tokens", req.expected_output_tokens, 0, MAX_OUTPUT_TOKENS)
        s = self.settings
        limit = s.max_id_length
        if (len(req.request_id) > limit or len(req.session_id) > limit or len(req.model) > limit
                or len(req.policy) > limit):
            for name in ("request_id", "session_id", "model", "policy"):
                value = getattr(req, name)
                if len(value) > limit:
                    raise InvalidRequest(f"{name} {quote(value)} is longer than limits.max_id_length={limit}")
        if req.candidate_workers:
            if len(req.candidate_workers) > MAX_WORKERS:
                raise InvalidRequest(f"{len(req.candidate_workers)} candidate_workers; at most {MAX_WORKERS} workers exist")
            for c in req.candidate_workers:
                if len(c) > limit:
                    raise InvalidRequest(f"candidate worker {quote(c)} is longer than limits.max_id_length={limit}")
        if req.request_id and req.request_id in self._requests:
            raise InvalidRequest(f"request_id {req.request_id!r} is already in flight")
        if s.max_inflight_bytes and self.inflight_bytes + self.waiting_bytes + request_bytes(req) > s.max_inflight_bytes:
            waiting = f" and {self.waiting_bytes} bytes of requests waiting for admission" if self.waiting_bytes else ""
            raise Overloaded(
                f"the in-flight table holds {self.inflight_bytes} bytes of routed, not completed requests{waiting}; "
                f"this one ({request_bytes(req)} bytes) would exceed limits.max_inflight_bytes={s.max_inflight_bytes}: "
                "complete requests (or let them expire) first"
            )

    def decide(self, req: RouteRequest, explain: bool = True) -> tuple[Decision, RoutingContext, RoutingPolicy]:
        """Select a worker without committing anything (used by ``route`` and dry runs).

        ``explain=False`` lets policies skip listing every candidate (see RoutingContext.explain).
        """
        self.validate_request(req)
        policy = self.routing_policy(req.policy)
        candidates, mask = self._eligible()
        if req.candidate_workers:
            wanted = set(req.candidate_workers)
            candidates = [w for w in candidates if w.id in wanted]
            mask = 0
            for w in candidates:
                mask |= w.bit
        if not candidates:
            if req.candidate_workers:
                shown = ", ".join(map(repr, req.candidate_workers[:8])) + (", ..." if len(req.candidate_workers) > 8 else "")
                raise NoEligibleWorker(f"none of the requested workers ({shown}) is registered and eligible")
            raise NoEligibleWorker("no eligible worker is registered")
        now = self.clock.now()
        match = self.index.match(req.keys, mask)
        ctx = RoutingContext(req, candidates, match, self.block_size, now, self.index, explain)
        decision = policy.select(ctx)
        return decision, ctx, policy

    def hold_waiting(self, req: RouteRequest) -> int:
        """Count ``req``, decided and about to wait in an admission queue, against
        ``max_inflight_bytes``; returns the bytes charged, for ``release_waiting``."""
        held = request_bytes(req)
        self.waiting_bytes += held
        return held

    def release_waiting(self, held: int) -> None:
        """A waiting request left its queue (admitted, shed, cancelled): release its bytes."""
        self.waiting_bytes -= held

    def route(self, req: RouteRequest, explain: bool = True) -> RouteResult:
        """Decide, then commit: charge load, update the approximate cache model, notify."""
        decision, ctx, policy = self.decide(req, explain)
        return self.commit(decision, ctx, policy)

    def commit(self, decision: Decision, ctx: RoutingContext, policy: RoutingPolicy) -> RouteResult:
        """Commit a decision from ``decide`` made in this same step (nothing may change in between)."""
        req = ctx.request
        if not req.request_id:
            req.request_id = self.new_request_id()
        worker = self.workers.get(decision.worker_id)
        overlap = ctx.overlap(worker)
        decision.overlap_blocks = overlap
        self._count_prefix_hit(decision.policy, overlap, len(ctx.match.path))
        self.workers.commit(
            InFlight(
                request_id=req.request_id,
                worker_id=worker.id,
                prefill_tokens=ctx.uncached_tokens(worker),
                prompt_tokens=req.prompt_tokens,
                overlap_blocks=overlap,
                started_at=ctx.now,
                policy=decision.policy,
            )
        )
        self._requests[req.request_id] = req
        self.inflight_bytes += request_bytes(req)
        evicted = self._record_access(worker, req, ctx, overlap)
        policy.on_dispatch(decision, ctx)
        self.counters["decisions"] += 1
        self.decisions_by_policy[decision.policy] = self.decisions_by_policy.get(decision.policy, 0) + 1
        alternative = self.workers.find(decision.alternative_worker_id) if decision.alternative_worker_id else None
        result = RouteResult(decision, worker, req, alternative, evicted)
        if self.on_committed is not None:
            self._completed.pop(req.request_id, None)  # a reused id is in flight again
            self.on_committed(result)
        return result

    def _count_prefix_hit(self, policy: str, overlap: int, reachable: int) -> None:
        """``reachable``: the match path's length, i.e. the longest prefix any candidate holds."""
        hits = self.prefix_hits.get(policy)
        if hits is None:
            hits = self.prefix_hits[policy] = PrefixHits()
        if not reachable:
            hits.no_prefix += 1
            return
        if overlap >= reachable:
            hits.best += 1
        else:
            hits.worse += 1
        hits.achieved_blocks += overlap
        hits.reachable_blocks += reachable

    def _record_access(self, worker: Worker, req: RouteRequest, ctx: RoutingContext, overlap: int) -> list[int]:
        """The chosen worker reuses its matched prefix; in approximate mode it also caches the
        rest. Returns the keys evicted from an approximate worker's model to make room."""
        now = ctx.now
        slot = worker.slot
        approximate = worker.mode is CacheMode.APPROXIMATE and overlap < len(req.keys)
        info = None
        if overlap or approximate:  # a frozen dataclass costs a few us: only when a hook gets it
            info = AccessInfo(session_id=req.session_id, task=int(req.task), prompt_tokens=req.prompt_tokens)
        if overlap:
            matched = ctx.match.path[:overlap]
            self.index.touch_path(slot, matched, now)
            self.eviction.on_accessed(self.index, slot, matched, info, now)
        if worker.mode is CacheMode.EVENTS and getattr(self.eviction, "wants_request_info", False):
            self._remember_access(req)
        if not approximate:
            return []
        assert info is not None
        self._assume_cached(worker, req.keys, overlap, info, now)
        capacity = worker.spec.capacity_blocks or self.settings.approximate_capacity_blocks
        excess = self.index.count(slot) - capacity if capacity else 0
        if excess <= 0:
            return []
        ctx_e = EvictionContext(self.index, slot, now, worker.id)
        victims = self.eviction.rank(ctx_e, excess, frozenset(req.keys))
        drop_blocks(self.eviction, self.index, slot, victims)
        self.counters["approx_evicted"] += len(victims)
        return [block.key for block in victims]

    def _assume_cached(self, worker: Worker, keys: Sequence[int], overlap: int, info: AccessInfo, now: float) -> None:
        """An approximate-mode worker now caches ``keys`` (it held the first ``overlap``)."""
        parent = keys[overlap - 1] if overlap else None
        stored = self.index.store(worker.slot, parent, keys[overlap:], now)
        self.eviction.on_stored(self.index, worker.slot, stored, replace(info, first_offset=overlap), now)

    def _forget_assumed(self, worker: Worker, keys: Iterable[int]) -> None:
        """Another replica's eviction dropped ``keys`` from its model of an approximate worker."""
        index, slot = self.index, worker.slot
        doomed: dict[int, Block] = {}  # distinct held blocks, in order
        for key in keys:
            block = index.get(key)
            if block is not None and block.holders >> slot & 1:
                doomed[key] = block
        drop_blocks(self.eviction, index, slot, list(doomed.values()))

    def _remember_access(self, req: RouteRequest) -> None:
        """Remember who routed these blocks until the engine reports storing them."""
        info = AccessInfo(session_id=req.session_id, task=int(req.task), prompt_tokens=req.prompt_tokens,
                          decode_from_block=req.prompt_tokens // self.block_size)
        recent = self._recent_access
        for offset, key in enumerate(req.keys):
            recent.pop(key, None)  # re-insert: the newest request owns a shared prefix
            recent[key] = (info, offset)
        self._trim_recent()

    def _trim_recent(self) -> None:
        recent = self._recent_access
        if len(recent) > RECENT_ACCESS_KEYS:
            for key in list(itertools.islice(recent, len(recent) - RECENT_ACCESS_KEYS)):
                del recent[key]

    def _stored_info(self, parent_key: int | None, keys: Sequence[int]) -> AccessInfo:
        """The AccessInfo for an engine's Stored chain: that of the routed request whose prompt
        it starts in, or continues (generated blocks). Blocks no routed request explains are
        unlabelled: ``AccessInfo()``, which policies resolve with ``TaskCategory.resolve``
        (no session: TEMPLATED)."""
        recent = self._recent_access
        found = recent.get(keys[0]) if keys else None
        if found is not None:
            info, first = found
        elif parent_key is not None and (found := recent.get(parent_key)) is not None:
            info, first = found[0], found[1] + 1
        else:
            return _NO_ACCESS_INFO
        for offset, key in enumerate(keys, first):
            if key not in recent:  # generated blocks: later chains hang under them
                recent[key] = (info, offset)
        self._trim_recent()
        return replace(info, first_offset=first)

    def complete(self, completion: Completion) -> InFlight:
        """Stop charging a routed request, tell its policy how it went. Raises NotFound for a
        request not in flight here (see ``complete_anywhere`` when replicas share load)."""
        check_completion(completion)  # before anything changes: a fit reads its numbers
        entry = self._finish(completion)
        if self.on_completed is not None:
            self._note_completed(completion.request_id)
            self.on_completed(completion)
        return entry

    def complete_anywhere(self, completion: Completion) -> InFlight | None:
        """``complete`` for replicas sharing load, where a Complete may reach this replica
        before the Dispatch of the replica that routed it (the gateway is faster than the
        bus). An id not in flight here is remembered, so its Dispatch charges nothing when it
        comes, and published like any completion (None is returned); an id that already
        completed raises NotFound, as a second Complete does on one replica."""
        rid = completion.request_id
        check_completion(completion)
        if self.on_completed is None or self.workers.inflight(rid) is not None:
            return self.complete(completion)
        if rid in self._completed:
            raise NotFound(f"request {rid!r} already completed")
        self._note_completed(rid)
        self.on_completed(completion)
        return None

    def _note_completed(self, request_id: str) -> None:
        completed = self._completed
        completed.pop(request_id, None)  # re-inserted at the end: the dict stays in time order
        completed[request_id] = self.clock.now()
        if len(completed) > MAX_COMPLETED_IDS:
            del completed[next(iter(completed))]

    def _finish(self, completion: Completion) -> InFlight:
        entry = self.workers.release(completion.request_id)
        req = self._forget_request(completion.request_id)
        worker = self.workers.find(entry.worker_id)
        now = self.clock.now()
        policy = self._routing.get(entry.policy)
        if policy is not None:
            policy.on_complete(worker, req, completion, now)
        if completion.session_ended and req is not None and req.session_id:
            # end-aware eviction (T-LRU section 4): a finished conversation's tail goes first
            for eviction in self._eviction_by_name.values():
                end_session = getattr(eviction, "end_session", None)
                if end_session is not None:
                    end_session(req.session_id)
        return entry

    def _forget_request(self, request_id: str) -> RouteRequest | None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.inflight_bytes -= request_bytes(req)
        return req

    def request(self, request_id: str) -> RouteRequest | None:
        return self._requests.get(request_id)

    def expire_inflight(self) -> list[InFlight]:
        """Stop charging requests whose completion never came (caller crashed, lost Complete)."""
        cutoff = self.clock.now() - self.settings.inflight_timeout_s
        expired = self.workers.expire(cutoff)
        for entry in expired:
            self._forget_request(entry.request_id)
        self.counters["inflight_expired"] += len(expired)
        completed = self._completed
        while completed:
            rid = next(iter(completed))
            if completed[rid] >= cutoff:
                break
            del completed[rid]
        return expired

    # ---- replica sync -----------------------------------------------------------------
    def apply_dispatch(self, dispatch: Dispatch, *, own: bool = False) -> bool:
        """Another replica committed ``dispatch``: charge its load here too, and for an
        approximate-mode worker assume the routed prefix cached (and the blocks that replica
        evicted gone), as it did. Returns whether load was charged.

        A Dispatch whose request already completed (its Complete reached some replica first)
        charges nothing. ``own``: this replica published it (read back in stream order): the
        load is already charged, but the approximate prefix is re-applied, so that every
        replica ends on the stream's order of stores and evictions, whatever order each saw
        them in locally. Dispatches name workers by id; one this replica does not know is
        counted and ignored (Dynamo's router replica sync works the same way, by request id).
        """
        worker = self.workers.find(dispatch.worker_id)
        if worker is None:
            self.counters["remote_unknown_workers"] += 1
            return False
        now = self.clock.now()
        charged = False
        rid = dispatch.request_id
        if not own:
            if rid in self._completed:
                self.counters["remote_late_dispatches"] += 1
            elif self.workers.inflight(rid) is None:
                self.workers.commit(InFlight(
                    request_id=rid, worker_id=worker.id, prefill_tokens=dispatch.prefill_tokens,
                    prompt_tokens=dispatch.prompt_tokens, overlap_blocks=dispatch.overlap_blocks,
                    # expiry order follows arrival (InFlight entries are queued as committed): an
                    # old Dispatch expires at most its delivery lag late
                    started_at=now - max(0.0, dispatch.age_s), policy=dispatch.policy,
                ))
                remote = RouteRequest(rid, (), dispatch.prompt_tokens, session_id=dispatch.session_id, task=dispatch.task)
                self._requests[rid] = remote
                self.inflight_bytes += request_bytes(remote)  # counted, never refused: routed elsewhere
                self.counters["remote_dispatches"] += 1
                charged = True
        if dispatch.keys and worker.mode is CacheMode.APPROXIMATE:
            self._apply_assumed(worker, dispatch, own, now)
        return charged

    def _apply_assumed(self, worker: Worker, dispatch: Dispatch, own: bool, now: float) -> None:
        keys, slot, index = dispatch.keys, worker.slot, self.index
        if own:
            # already applied when routed: restore only what another replica's eviction took
            # meanwhile (no touch: the access was counted once)
            held = 0
            while held < len(keys) and index.holds(slot, keys[held]):
                held += 1
            if held < len(keys):
                self._assume_cached(worker, keys, held, AccessInfo(prompt_tokens=dispatch.prompt_tokens), now)
        else:
            match = index.match(keys, worker.bit)
            overlap = match.overlap(slot)
            info = AccessInfo(session_id=dispatch.session_id, task=int(dispatch.task), prompt_tokens=dispatch.prompt_tokens)
            if overlap:
                matched = match.path[:overlap]
                index.touch_path(slot, matched, now)
                self.eviction.on_accessed(index, slot, matched, info, now)
            if overlap < len(keys):
                self._assume_cached(worker, keys, overlap, info, now)
        self._forget_assumed(worker, dispatch.evicted)

    def apply_completion(self, completion: Completion, *, own: bool = False) -> InFlight | None:
        """A Complete another replica received: release the load here and tell the policy, as
        ``complete`` does, without publishing it again. An unknown id is remembered (its
        Dispatch may still be on the way). Returns the released entry, if any."""
        if own:
            return None
        rid = completion.request_id
        if self.workers.inflight(rid) is None:
            self._note_completed(rid)
            return None
        entry = self._finish(completion)
        self._note_completed(rid)
        self.counters["remote_completions"] += 1
        return entry

    def tick(self) -> None:
        """Periodic work for time-driven policies (load decay, hotness windows)."""
        now = self.clock.now()
        for policy in self._routing.values():
            policy.tick(now)

    # ---- cache events ---------------------------------------------------------------
    def _page_size(self, worker: Worker, ev: Stored) -> int:
        return ev.block_size or worker.spec.block_size or self.block_size

    def _prepare_stored(self, worker: Worker, ev: Stored) -> tuple[bytes, array | None]:
        """Check a Stored event before anything changes: ``(token bytes, engine hashes as an
        array('Q') or None)``. Raises ``RejectedEvent`` (an ``InvalidRequest``) naming why it
        cannot be applied."""
        page = ev.block_size or worker.spec.block_size or self.block_size  # _page_size, once per stored event
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
            if page != self.block_size:
                raise RejectedEvent(
                    "no_engine_hashes",
                    f"worker {worker.id!r}: pages of {page} tokens need engine hashes (the router's blocks hold "
                    f"{self.block_size})",
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
        worker = self.workers.get(batch.worker_id)
        if batch.sequence < 0:
            raise InvalidRequest("sequence must be >= 0")
        prepared: list[tuple[bytes, array | None] | None] = []
        rejected: dict[str, int] = {}
        stores_rejected = 0
        for ev in batch.events:
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
            self.counters["batches_duplicate"] += 1
            return BatchOutcome(applied=False, duplicate=True)
        if last >= 0 and seq == 0:
            outcome.restarted = True
            self.counters["restarts"] += 1
            stale = worker.resync_needed
            self._clear_worker(worker)
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
        now = self.clock.now()
        stores_applied = 0
        for ev, prep in zip(batch.events, prepared):
            if isinstance(ev, Stored):
                if prep is not None:
                    self._apply_stored(worker, ev, prep[0], prep[1], outcome, now)
                    stores_applied += 1
            elif isinstance(ev, Removed):
                self._apply_removed(worker, ev, outcome)
            else:
                self._clear_worker(worker)
                if worker.state is WorkerState.DEGRADED:
                    worker.state = WorkerState.READY
                    worker.state_reason = ""
                    log.info("worker resynced by Cleared", extra={"worker_id": worker.id})
        self._note_rejections(worker, rejected, stores_applied, stores_rejected)
        self.counters["batches_applied"] += 1
        worker.batches_applied += 1
        self.counters["blocks_stored"] += outcome.blocks_stored
        self.counters["blocks_removed"] += outcome.blocks_removed
        self.counters["orphan_blocks"] += outcome.orphan_blocks
        self.counters["unknown_removals"] += outcome.unknown_removals
        if self._drains:  # a host that never drains (the simulator) still frees the old slots
            self.drain_step()
        return outcome

    def _gap(self, worker: Worker, outcome: BatchOutcome, lost: int, reason: str) -> None:
        outcome.gap = lost
        worker.gaps += 1
        self.counters["gaps"] += 1
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
        self._degrade(self.workers.get(worker_id), reason)

    def note_rejected_events(self, worker_id: str, rejected: Mapping[str, int], *, lost_removal: bool = False) -> None:
        """Count events an adapter could not even decode (``events/``), by reason. A lost
        removal means the worker's view may hold blocks the engine evicted: DEGRADED until
        the adapter resyncs it."""
        worker = self.workers.get(worker_id)
        self._note_rejections(worker, rejected, 0, sum(rejected.values()) if not lost_removal else 0)
        if lost_removal:
            self._degrade(worker, "removal lost")

    def _note_rejections(self, worker: Worker, rejected: Mapping[str, int], stores_applied: int, stores_rejected: int) -> None:
        counts = worker.events_rejected
        for reason, n in rejected.items():
            counts[reason] = counts.get(reason, 0) + n
            self.counters["events_rejected"] += n
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
        page = ev.block_size or worker.spec.block_size or self.block_size  # _page_size, once per stored event
        if page != self.block_size:
            self._apply_stored_pages(worker, ev, data, page, outcome, now)
            return
        if ev.parent_engine_hash is None:
            model, lora, salt = ev.model, ev.lora, ev.salt
            parent_key, seed = None, namespace_seed(model, lora, salt) if model or lora or salt else ROOT_SEED
        else:
            parent_key = worker.engine_keys.get(ev.parent_engine_hash)
            if parent_key is None and self.index.holds(worker.slot, ev.parent_engine_hash):
                parent_key = ev.parent_engine_hash  # publisher uses our keys as its hashes
            if parent_key is None:
                outcome.orphan_blocks += len(data) // (self.block_size * 4)
                log.debug("stored blocks with an unknown parent skipped", extra={"worker_id": worker.id})
                return
            seed = parent_key
        reverse = self._engine_hash_of.get(worker.slot) if hashes is not None else None
        if ev.extra_hashes is None and reverse is None:
            # hashing, storing and the engine-hash map in one native call (RadixIndex.store_hashed)
            keys: Sequence[int]
            keys, blocks = self.index.store_hashed(worker.slot, parent_key, data, self.block_size, seed, now,
                                                   None if hashes is None else worker.engine_keys, hashes)
            hashes = None  # mapped
        else:
            # keys as an array('Q'): the native index and engine-hash map read it in place, with no
            # int object made per block (the pure-Python path reads it as a sequence of ints)
            if ev.extra_hashes is None:
                keys = chain_keys_array(data, self.block_size, seed)
            else:
                keys = chain_keys_with_extras(data, self.block_size, seed, ev.extra_hashes)
            blocks = self.index.store(worker.slot, parent_key, keys, now)
        if hashes is not None:
            mapping = worker.engine_keys
            map_pairs = getattr(mapping, "map_pairs", None)  # the loop below, in C (a native U64Map)
            if map_pairs is not None and reverse is None:
                map_pairs(hashes, keys)
            else:
                for eh, key in zip(hashes, keys):
                    if eh != key:
                        mapping[eh] = key
                        if reverse is not None:
                            reverse[key] = eh
        # _stored_hooks written out: once per stored event
        info = self._stored_info(parent_key, keys) if self._recent_access else _NO_ACCESS_INFO
        self.eviction.on_stored(self.index, worker.slot, blocks, info, now)
        outcome.blocks_stored += len(keys)

    def _stored_hooks(self, worker: Worker, parent_key: int | None, keys: Sequence[int], blocks: list[Any],
                      outcome: BatchOutcome, now: float) -> None:
        info = self._stored_info(parent_key, keys) if self._recent_access else _NO_ACCESS_INFO
        self.eviction.on_stored(self.index, worker.slot, blocks, info, now)
        outcome.blocks_stored += len(keys)

    def _apply_stored_pages(self, worker: Worker, ev: Stored, data: bytes, page: int, outcome: BatchOutcome,
                            now: float) -> None:
        """An engine whose pages are not the router's blocks (``index.pages``)."""
        assert ev.engine_hashes is not None  # _prepare_stored checked it
        chains = worker.pages
        if chains is None:
            chains = worker.pages = PageChains(self.block_size)
        slot, index = worker.slot, self.index
        chunk = chains.store(ev.engine_hashes, ev.parent_engine_hash, data, page,
                             namespace_seed(ev.model, ev.lora, ev.salt), lambda key: index.holds(slot, key),
                             ev.extra_hashes)
        if chunk is None:
            outcome.orphan_blocks += len(data) // (self.block_size * 4)
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
        index = self.index
        reverse = self._engine_hash_of.get(slot)
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
            drop_blocks(self.eviction, index, slot, list(doomed.values()))
            outcome.blocks_removed += len(doomed)

    def _clear_worker(self, worker: Worker) -> None:
        """The worker holds nothing now. A large one moves to a fresh slot at once and its old
        slot is emptied in steps (``CLEAR_IN_PLACE_BLOCKS``): no routing mask includes the old
        slot, so the old blocks only count towards ``len(index)`` meanwhile."""
        worker.engine_keys.clear()
        if worker.pages is not None:
            worker.pages.clear()
        if worker.groups is not None:
            worker.groups.clear()
        worker.resync_needed = False
        old = worker.slot
        # a worker that asked for eviction hints keeps its (now empty) engine-hash map current
        reverse = self._engine_hash_of.get(old)
        if reverse is not None:
            self._engine_hash_of[old] = u64_map()
            self._engine_hash_building.pop(old, None)  # the map was cleared: an empty one is complete
        if self.index.count(old) <= CLEAR_IN_PLACE_BLOCKS:
            self.index.clear(old)
            for ev in self._eviction_by_name.values():
                ev.on_cleared(old)
            return
        new = self.workers.next_slot()
        self.index.add_slot(new)
        self.workers.move(worker, new)  # the old slot stays taken until drained
        if reverse is not None:
            self._engine_hash_of[new] = self._engine_hash_of.pop(old)
        self._drains.append(self._drop_slot_steps(old, DRAIN_STEP_BLOCKS, reverse))
        log.info("worker cleared: its blocks are dropped from the index in steps", extra={
            "worker_id": worker.id, "slot": new, "old_slot": old, "blocks": self.index.count(old)})

    def reset_events(self, worker_id: str, *, lost: bool) -> Worker:
        """Forget a worker's cached blocks and event sequence, for sources that sequence themselves.

        The ZMQ adapters (``events/``) detect gaps and replay on their own, then hand batches
        numbered from 0 after this call, so ``apply`` never flags their gaps twice. ``lost``
        means events were lost beyond recovery (replay unavailable or too old): the gap is
        counted and the worker is DEGRADED until a ``Cleared`` (or engine restart) resyncs it.
        """
        worker = self.workers.get(worker_id)
        self._clear_worker(worker)
        worker.last_sequence = -1
        if lost:
            worker.gaps += 1
            self.counters["gaps"] += 1
            self._degrade(worker, "events lost beyond replay")
            log.warning("events lost beyond replay: worker state cleared and degraded", extra={"worker_id": worker_id})
        return worker

    # ---- snapshots (warming a replica from a peer) -----------------------------------
    def export_blocks(self, worker_id: str) -> list[tuple[int, int | None, int]]:
        """``(key, parent key or None, engine hash or 0)`` of every block the worker holds,
        parents before children (a chain's top names a parent this worker does not hold)."""
        return [block for part in self.export_steps(worker_id) for block in part]

    def export_steps(self, worker_id: str, step: int = 1 << 62) -> Iterator[list[tuple[int, int | None, int]]]:
        """``export_blocks`` in parts, each after visiting at most ``step`` blocks.

        The host may apply events between parts (ExportIndex yields to the loop so a large
        worker never stalls routing): blocks removed meanwhile are skipped, blocks stored
        under already visited ones are missed, and a removed worker ends the export. Every
        block is still listed once, after its parent (or naming a parent it never held).
        """
        worker = self.workers.get(worker_id)
        bit, slot, index = worker.bit, worker.slot, self.index
        reverse = self._engine_hash_of.get(slot) if slot not in self._engine_hash_building else None
        if reverse is None:  # this worker never asked for a hint: its engine hashes, in parts too
            reverse = u64_map(len(worker.engine_keys))  # sized ahead: see _build_engine_hashes
            for _ in _invert_steps(worker.engine_keys, reverse, step):
                yield []
                if self.workers.find(worker_id) is not worker or worker.slot != slot:
                    return
        tops: list[Block] = []
        climbed: set[int] = set()

        def climb(node: Block | None) -> int:
            """Walk up from a leaf to the top of its chain; returns the blocks visited."""
            visited = 0
            while node is not None and node.holders & bit and node.key not in climbed:
                climbed.add(node.key)
                visited += 1
                if node.parent is None or not node.parent.holders & bit:
                    tops.append(node)
                node = node.parent
            return visited

        visited = 0
        for leaf in list(index.leaves(slot)):
            visited += climb(leaf)
            if visited >= step:
                visited = 0
                yield []
                if self.workers.find(worker_id) is not worker or worker.slot != slot:
                    return  # removed, or cleared (moved off the slot being walked)
        # leaves that appeared meanwhile (a removal exposes its parent): climbing them stops
        # at the first block already seen, so this costs what changed, plus a look at each leaf
        # (in steps too: 25k leaves against a set of 400k keys held the loop ~25 ms)
        late = list(index.leaves(slot))
        for start in range(0, len(late), step):
            for leaf in late[start : start + step]:
                if leaf.key not in climbed:
                    climb(leaf)
            if len(late) > step:
                yield []
                if self.workers.find(worker_id) is not worker or worker.slot != slot:
                    return
        stack, listed = tops, set()
        out: list[tuple[int, int | None, int]] = []
        while stack:
            node = stack.pop()
            if node.key in listed or not node.holders & bit or index.get(node.key) is not node:
                continue  # removed (or listed through a parent stored meanwhile)
            listed.add(node.key)
            out.append((node.key, node.parent.key if node.parent is not None else None, reverse.get(node.key, 0)))
            stack.extend(c for c in node.iter_children() if c.holders & bit)
            if len(out) == step:
                yield out
                out = []
                if self.workers.find(worker_id) is not worker or worker.slot != slot:
                    return
        yield out

    def import_blocks(self, worker_id: str, blocks: Iterable[tuple[int, int | None, int]]) -> list[tuple[int, int | None, int]]:
        """Store exported blocks (parents first) for a registered worker, as a peer held them.

        Returns the blocks whose parent is not in the index yet (held by a worker imported
        later): import them again once the others are in. The worker's event sequence is left
        alone, so its own publishers continue as usual.
        """
        worker = self.workers.get(worker_id)
        index, slot, now = self.index, worker.slot, self.clock.now()
        deferred: list[tuple[int, int | None, int]] = []
        for key, parent, engine_hash in blocks:
            if parent is not None and parent not in index:
                deferred.append((key, parent, engine_hash))
                continue
            stored = index.store(slot, parent, (key,), now)
            self.eviction.on_stored(index, slot, stored, _NO_ACCESS_INFO, now)
            if engine_hash and engine_hash != key:
                worker.engine_keys[engine_hash] = key
        return deferred

    # ---- eviction hints -------------------------------------------------------------
    def evict_hint(self, req: EvictRequest, pinned_engine_hashes: Iterable[int] = ()) -> EvictAdvice:
        steps = self.evict_hint_steps(req, pinned_engine_hashes)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def evict_hint_steps(
        self, req: EvictRequest, pinned_engine_hashes: Iterable[int] = (), step: int | None = None
    ) -> Generator[None, None, EvictAdvice]:
        """``evict_hint`` with its work done in parts of about ``step`` entries, yielding between
        them (None: at once): the worker's first hint builds its engine-hash map
        (``engine_hash_steps``); a policy with no order of its own for the worker (one named by
        a hint, not configured, sees no hooks) scores every leaf (``leaf_priority``); then the
        policy takes the blocks (``rank_steps``), up to ``limits.max_evict_blocks`` of them,
        which at 1,024 blocks held the loop 4-58 ms in one part (issue #16 item 1).

        The answer is advice about the worker as it was while it was ranked: events the host
        applies between parts may leave out blocks that became leaves meanwhile, but it never
        names a key the worker no longer holds when the answer is made, never a key twice, never
        a pinned key, and never a block before a held child of it (``still_evictable``).
        ``exhausted`` says the ranking ran out of evictable blocks (what events then took from
        the answer does not count). Raises NotFound if the worker goes away meanwhile; a worker
        cleared meanwhile (moved to another slot) is ranked again there."""
        worker = self.workers.get(req.worker_id)
        if req.blocks <= 0:
            raise InvalidRequest("blocks to free must be > 0")
        policy = self.eviction_policy(req.policy)
        pinned = set(req.pinned_keys)
        for eh in pinned_engine_hashes:
            pinned.add(worker.engine_keys.get(eh, eh))
        frozen = frozenset(pinned)
        # never rank more than the worker holds or the configured cap (blocks=2**32-1 would
        # otherwise rank a whole worker on the loop); exhausted still means "nothing more to give"
        wanted = min(req.blocks, self.settings.max_evict_blocks)
        if step is None:
            ctx = EvictionContext(self.index, worker.slot, self.clock.now(), worker.id)
            blocks = policy.rank(ctx, min(wanted, self.index.count(worker.slot)), frozen)
            ranked = len(blocks)
        else:
            while True:
                yield from self.engine_hash_steps(worker.id, step)
                worker = self.workers.get(req.worker_id)  # NotFound if it went away meanwhile
                ctx = EvictionContext(self.index, worker.slot, self.clock.now(), worker.id)
                leaf_priority = getattr(policy, "leaf_priority", None)
                priority = leaf_priority(ctx) if leaf_priority is not None else None
                runs: list[list[Any]] = []
                if priority is not None:
                    if not (yield from self._on_slot(_collect(score_leaves_steps(ctx, priority, frozen, step), runs),
                                                     req.worker_id, ctx.slot)):
                        continue  # cleared meanwhile (moved to another slot): rank it again there
                    ctx.scored = heapq.merge(*runs)
                count = min(wanted, self.index.count(worker.slot))
                rank_steps = getattr(policy, "rank_steps", None)
                if rank_steps is None:
                    blocks = policy.rank(ctx, count, frozen)
                else:
                    ranking: list[list[Block]] = []
                    if not (yield from self._on_slot(_returned(rank_steps(ctx, count, frozen, step), ranking),
                                                     req.worker_id, ctx.slot)):
                        continue
                    blocks = ranking[0]
                ctx.scored = None
                yield from release_steps(runs, step)  # freeing 25k scored leaves at once took ~5 ms
                worker = self.workers.get(req.worker_id)
                if worker.slot == ctx.slot:
                    break
            ranked = len(blocks)
            blocks = still_evictable(ctx, blocks)
        keys = [b.key for b in blocks]
        for _ in self.engine_hash_steps(worker.id):  # what the host did not build in steps
            pass
        reverse = self._engine_hash_of[worker.slot]
        return EvictAdvice(
            keys=keys,
            engine_hashes=[reverse.get(k, k) for k in keys],
            exhausted=ranked < wanted,
            policy=policy.name,
        )

    def _on_slot(self, steps: Iterator[None], worker_id: str, slot: int) -> Generator[None, None, bool]:
        """Run ``steps``, yielding after each part; False as soon as the worker is on another
        slot (cleared meanwhile), NotFound if it is gone: the rest would read a slot being emptied."""
        for _ in steps:
            yield
            if self.workers.get(worker_id).slot != slot:
                return False
        return True

    def engine_hash_steps(self, worker_id: str, step: int = 1 << 62) -> Iterator[None]:
        """Build the worker's key -> engine hash map that eviction hints answer with, reading at
        most ``step`` engine hashes per part; nothing once it is built. Built once per worker,
        then kept current by the Stored/Removed handlers, so later hints cost O(k); built in one
        go it held the loop ~185 ms at 400k blocks (issue #16), so a host runs the parts between
        turns of its loop (the map is in place from the first part: events applied between parts
        update it, and the parts add only pairs the worker still has)."""
        worker = self.workers.get(worker_id)
        slot = worker.slot
        building = self._engine_hash_building.get(slot)
        if building is None:
            if slot in self._engine_hash_of:
                return iter(())
            building = self._engine_hash_building[slot] = self._build_engine_hashes(worker, step)
        return building

    def _build_engine_hashes(self, worker: Worker, step: int) -> Iterator[None]:
        slot = worker.slot
        # a native map sized for what the worker holds: a dict (or a map left to grow) rehashed
        # everything it held inside one part, 10-23 ms at 350k entries (issue #16 item 1). Its
        # table (~12 MiB at 400k) is mapped in a part of its own, before the pairs are copied,
        # with room for an eighth more (blocks the worker stores while the parts run).
        reverse = u64_map(len(worker.engine_keys) * 9 // 8)
        self._engine_hash_of[slot] = reverse
        for _ in itertools.chain((None,), _invert_steps(worker.engine_keys, reverse, step)):
            yield
            if self._engine_hash_of.get(slot) is not reverse:
                return  # the worker was cleared or removed meanwhile: nothing more to build
        if self._engine_hash_building.get(slot) is not None:
            del self._engine_hash_building[slot]

    def blocks_to_free(self, worker_id: str, tokens: int) -> int:
        """Blocks needed to free ``tokens`` tokens (rounded up)."""
        self.workers.get(worker_id)
        return -(-tokens // self.block_size)


def _collect(parts: Iterator[list[Any]], into: list[list[Any]]) -> Iterator[None]:
    """``parts`` as bare steps, each part kept in ``into``."""
    for part in parts:
        into.append(part)
        yield


def _returned(steps: Generator[None, None, Any], into: list[Any]) -> Iterator[None]:
    """``steps`` as bare steps; what it returns is put in ``into``."""
    into.append((yield from steps))
