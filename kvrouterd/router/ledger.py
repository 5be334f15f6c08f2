"""The load ledger: which requests are in flight where, what they cost, and what routing them leaves in the cache model.

A committed decision charges its worker (``WorkerRegistry.commit``: the prefill tokens still
to compute, the request itself) until its Complete, or until ``inflight_timeout_s`` if none
comes; the ledger keeps each in-flight request, packed where the garbage collector does not
walk it (``pack_request``), and bounds their bytes (``limits.max_inflight_bytes``) and how
many one client holds (``limits.max_inflight_per_client``). Routing touches the chosen
worker's matched prefix for the eviction policy and, for an approximate-mode worker (no KV
events), assumes the rest of the prompt cached, evicting to its modelled capacity (a hard
bound after every decision), as SGLang's approximate cache-aware router does. Replicas
sharing load (``events.replica_sync``) apply each other's Dispatch and Complete messages
here, matched by request id as Dynamo's router replica sync does.

A disaggregated request (``router.disagg``) charges two workers: its decode worker under its
own id (no prefill tokens: its KV arrives by transfer) and its prefill worker under
``prefill_hop_id(id)`` with the tokens to prefill. A Complete with ``prefill_done`` releases
the prefill hop alone (the gateway saw the prefill answer, or the first token); the request's
Complete releases whatever is still charged. Replicas share both hops: the prefill hop goes out
as a Dispatch of its own, under the hop's id, and a ``prefill_done`` as a completion that
releases the hop alone; either may arrive before the other, or twice, and charges at most once.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..bounds import check_completion
from ..errors import InvalidRequest, NotFound, Overloaded
from ..index import native
from ..index.radix import Block
from ..index.workers import InFlight, Worker, new_inflight
from ..policies.base import (
    NONE_CLAIMED,
    AccessInfo,
    EvictionContext,
    RoutingContext,
    RoutingPolicy,
    RoutingPolicyBase,
    drop_blocks,
)
from ..protocols import CacheMode, Completion, Decision, Dispatch, RouteRequest, TaskCategory
from .access import RecentAccess
from .disagg import PREFILL_HOP_PREFIX, prefill_hop_id
from .shared import Shared
from .speculative import SpeculativeBlocks

__all__ = [
    "INFLIGHT_ENTRY_BYTES", "MAX_COMPLETED_IDS", "LoadLedger", "PackedRequest", "PrefixHits", "RouteResult",
    "pack_request", "request_bytes", "unpack_request",
]

#: Completed request ids remembered while replicas share load (each ~100 B): a Dispatch that
#: arrives after its request's completion (a Complete sent to another replica overtook it) is
#: then not charged. Entries also go after ``inflight_timeout_s``.
MAX_COMPLETED_IDS = 1 << 18

#: bytes an in-flight request costs besides its block keys and ids (RouteRequest, InFlight,
#: dict and deque entries); an estimate, so ``limits.max_inflight_bytes`` bounds real memory
INFLIGHT_ENTRY_BYTES = 512


#: what a block key costs kept as a Python int in a list (in an ``array('Q')``: 8 bytes)
_LIST_KEY_BYTES = 40

#: what a candidate worker's name costs beside its characters (its str and tuple slot)
_CANDIDATE_BYTES = 56


def request_bytes(req: RouteRequest) -> int:
    """What ``req`` costs in the in-flight table: keys as stored (8 bytes in an ``array('Q')``,
    ~40 as Python ints in a list), its strings, the entry overhead. ``LoadLedger.check_admissible``
    bounds it from above without the count: what this adds, that bound must cover."""
    keys = req.keys
    per_key = 8 if isinstance(keys, array) else _LIST_KEY_BYTES
    size = (INFLIGHT_ENTRY_BYTES + per_key * len(keys) + len(req.request_id) + len(req.session_id)
            + len(req.model) + len(req.lora) + len(req.policy) + len(req.client))
    candidates = req.candidate_workers
    if candidates:  # each name and its tuple slot; summed in C (a deadline reroute names ~every worker)
        size += sum(map(len, candidates)) + _CANDIDATE_BYTES * len(candidates)
    return size


#: a routed request as the ledger keeps it while in flight (``pack_request``): one flat tuple of
#: strs, ints, a float and bytes, which the garbage collector stops tracking at its first pass
#: over it (a tuple inside it would keep it tracked until a later pass). As RouteRequests and
#: their keys' arrays, 60k requests in flight made every full collection take 45-93 ms (issue
#: #28 item 6). Its fields: the request's, with what it costs (``request_bytes``) at ``_SIZE``
#: and its candidate workers last, from ``_CANDIDATES`` on.
PackedRequest = tuple[Any, ...]
_MODEL = 8
_CLIENT = 10
_SIZE = 11
_CANDIDATES = 13


def pack_request(req: RouteRequest, size: int) -> PackedRequest:
    """``req`` as the ledger keeps it; ``unpack_request`` gives an equal RouteRequest back."""
    keys = req.keys
    # the keys' uint64s as bytes (an array is tracked by the collector, a tuple of ints nested in
    # the entry would keep it tracked a pass longer); a list's are read back as a list
    listed = type(keys) is not array or keys.typecode != "Q"
    kept: bytes | tuple[int, ...]
    try:
        kept = (array("Q", keys) if listed else keys).tobytes()
    except (OverflowError, TypeError):  # not uint64s (an in-process caller's): kept as they are
        kept = tuple(keys)
    return (str(req.request_id), kept, int(req.prompt_tokens), str(req.session_id), int(req.task),
            float(req.ttft_slo_ms), int(req.expected_output_tokens), str(req.policy), str(req.model),
            str(req.lora), str(req.client), size, listed, *map(str, req.candidate_workers))


def hears_completions(policy: RoutingPolicy) -> bool:
    """Whether ``policy`` keeps anything per request (an ``on_complete`` of its own; the base
    class's does nothing), so a completion must reach it (``LoadLedger._finish``)."""
    return type(policy).on_complete is not RoutingPolicyBase.on_complete


def unpack_request(packed: PackedRequest) -> RouteRequest:
    rid, keys, prompt, session, task, slo, output, policy, model, lora, client, _, listed = packed[:_CANDIDATES]
    if type(keys) is bytes:
        keys = array("Q", keys)
        if listed:
            keys = keys.tolist()
    else:
        keys = list(keys)
    return RouteRequest(rid, keys, prompt, session, _TASKS.get(task, task), slo, output, policy, packed[_CANDIDATES:],
                        model=model, lora=lora, client=client)


#: a task category by number (kept as an int: an enum member is an object the collector tracks)
_TASKS: dict[int, TaskCategory] = {int(t): t for t in TaskCategory}

if native.module is not None:  # what the native in-flight table (ledger_keep) charges a request
    native.module.ledger_constants(INFLIGHT_ENTRY_BYTES, _CANDIDATE_BYTES, _LIST_KEY_BYTES)

#: ``LoadLedger.check_admissible`` for a request admitted without counting its bytes (None: no extension)
_ledger_admissible = native.module.ledger_admissible if native.module is not None else None
#: ``LoadLedger._commit_py`` in one native call (None: no extension)
_ledger_commit = native.module.ledger_commit if native.module is not None else None
#: ``LoadLedger._finish_py`` in one native call (None: no extension)
_ledger_finish = native.module.ledger_finish if native.module is not None else None
#: ``LoadLedger._new_request_id_py`` in one native call (None: no extension)
_ledger_request_id = native.module.ledger_request_id if native.module is not None else None

#: AccessInfo built without its frozen ``__init__`` (~0.8 us of ``object.__setattr__`` on every
#: Route that matched), every field given in declaration order; the last one's default is this
_new_access_info = native.positional_constructor(AccessInfo)
_DECODE_FROM_NONE = AccessInfo().decode_from_block


@dataclass(slots=True)
class RouteResult:
    """A committed decision and the worker it names."""

    decision: Decision
    worker: Worker
    request: RouteRequest
    alternative: Worker | None
    #: approximate mode: keys the eviction dropped from the worker's cache model to make room
    evicted: Sequence[int] = ()
    #: the prefill hop's worker of a disaggregated decision (``decision.prefill``), else None
    prefill_worker: Worker | None = None
    #: approximate mode: keys the eviction dropped from the prefill worker's cache model
    prefill_evicted: Sequence[int] = ()


#: RouteResult built without the dataclass ``__init__`` (seven stores, on every Route), every
#: field given in declaration order
_new_route_result = native.positional_constructor(RouteResult)


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


class LoadLedger:
    """In-flight requests and their bytes, completions, and what routing commits."""

    # members, not a dict: the native passes (index/_native.c, attr_get) read and write them
    # in place, where the generic lookup was ~190 instructions each
    __slots__ = (
        "_completed", "_hops_charged", "_recent", "_request_counter", "_shared", "_speculative", "by_client",
        "decisions_by_policy", "inflight_bytes", "on_committed", "on_completed", "prefix_hits", "requests",
        "waiting_bytes",
    )

    def __init__(self, shared: Shared, recent: RecentAccess, speculative: SpeculativeBlocks) -> None:
        self._shared = shared
        self._recent = recent
        self._speculative = speculative
        #: request id -> the routed request, packed (``pack_request``), while in flight: read it
        #: through ``request``, never change it, outside
        self.requests: dict[str, PackedRequest] = {}
        #: client -> its requests in flight (only clients with some; ``RouteRequest.client``)
        self.by_client: dict[str, int] = {}
        #: what the requests in ``requests`` cost (``request_bytes``), against max_inflight_bytes
        self.inflight_bytes = 0
        #: what requests waiting in an admission queue hold (``hold_waiting``): their keys and
        #: ids are as much memory as an in-flight request's, so they count against the same budget
        self.waiting_bytes = 0
        self._request_counter = 0
        #: a prefill hop was charged here once (``commit_prefill_hop``, ``apply_dispatch``): until
        #: then no Complete has a hop to release, and ``_finish`` does not look one up (~2k
        #: instructions a Complete, in fleets that never disaggregate)
        self._hops_charged = False
        #: replica sync (``events.replica_sync``): the host publishes every local commit and
        #: completion through these and applies the other replicas' with ``apply_dispatch`` /
        #: ``apply_completion``. None (the default): this router is alone.
        self.on_committed: Callable[[RouteResult], None] | None = None
        self.on_completed: Callable[[Completion], None] | None = None
        #: request id -> when it completed (kept only while ``on_completed`` is set), oldest
        #: first. An OrderedDict: it is trimmed from the front, and a dict finds its first key
        #: by stepping over every slot deleted before it. At 1,000 completions/s and the default
        #: 300 s window the once-a-second trim held the event loop a median 90 ms (up to 322)
        #: where this takes 0.4
        self._completed: OrderedDict[str, float] = OrderedDict()
        self.decisions_by_policy: dict[str, int] = {}
        #: policy -> achieved vs reachable prefix overlap of its decisions
        self.prefix_hits: dict[str, PrefixHits] = {}

    def new_request_id(self) -> str:
        """An id for a Route that came without one: this ledger's count in hex and 32 random
        bits, so ids stay unguessable across clients (natively ``ledger_request_id``)."""
        if _ledger_request_id is not None:
            made = _ledger_request_id(self, self._shared.rng)
            if made is not NotImplemented:
                return made  # type: ignore[no-any-return]
        return self._new_request_id_py()

    def _new_request_id_py(self) -> str:
        """``new_request_id``'s reference, of the native ``ledger_request_id``."""
        self._request_counter += 1
        return f"kvr-{self._request_counter:x}-{self._shared.rng.getrandbits(32):08x}"

    def check_admissible(self, req: RouteRequest) -> None:
        """The ledger's part of validating a request: its id is not in flight, and its bytes
        fit ``limits.max_inflight_bytes`` beside those in flight and waiting (natively
        ``ledger_admissible`` admits most requests; ``_check_admissible_py``, its reference)."""
        s = self._shared.settings
        if _ledger_admissible is None or not _ledger_admissible(self, req, s.max_inflight_per_client,
                                                                s.max_inflight_bytes, s.max_id_length):
            self._check_admissible_py(req)

    def _check_admissible_py(self, req: RouteRequest) -> None:
        """``check_admissible``'s reference."""
        s = self._shared.settings
        if req.request_id and req.request_id in self.requests:
            raise InvalidRequest(f"request_id {req.request_id!r} is already in flight")
        limit = s.max_inflight_per_client
        if limit and req.client and self.by_client.get(req.client, 0) >= limit:
            raise Overloaded(
                f"this client already has {limit} routed, not completed requests, limits.max_inflight_per_client: "
                "complete requests (or let them expire after limits.inflight_timeout_s) first"
            )
        byte_limit = s.max_inflight_bytes
        if not byte_limit:
            return
        held = self.inflight_bytes + self.waiting_bytes
        # the exact bytes only near the limit: a request validated so far costs at most the entry,
        # a list's bytes a key, five ids of max_id_length each and its client's name (request_bytes'
        # terms; its candidates' names are not bounded here: then always exact). request_bytes was
        # ~0.25 us of every decision.
        most = INFLIGHT_ENTRY_BYTES + _LIST_KEY_BYTES * len(req.keys) + 5 * s.max_id_length + len(req.client)
        if (held + most > byte_limit or req.candidate_workers) and held + request_bytes(req) > byte_limit:
            waiting = f" and {self.waiting_bytes} bytes of requests waiting for admission" if self.waiting_bytes else ""
            raise Overloaded(
                f"the in-flight table holds {self.inflight_bytes} bytes of routed, not completed requests{waiting}; "
                f"this one ({request_bytes(req)} bytes) would exceed limits.max_inflight_bytes={byte_limit}: "
                "complete requests (or let them expire) first"
            )

    def hold_waiting(self, req: RouteRequest) -> int:
        """Count ``req``, decided and about to wait in an admission queue, against
        ``max_inflight_bytes``; returns the bytes charged, for ``release_waiting``."""
        held = request_bytes(req)
        self.waiting_bytes += held
        return held

    def release_waiting(self, held: int) -> None:
        """A waiting request left its queue (admitted, shed, cancelled): release its bytes."""
        self.waiting_bytes -= held

    def commit(self, decision: Decision, ctx: RoutingContext, policy: RoutingPolicy) -> RouteResult:
        """Commit a decision from ``decide`` made in this same step (nothing may change in between)."""
        shared = self._shared
        req = ctx.request
        if not req.request_id:
            req.request_id = self.new_request_id()
        worker = shared.workers.get(decision.worker_id)
        if _ledger_commit is None or _ledger_commit(self, decision, ctx, worker, shared.workers, shared.counters,
                                                    NONE_CLAIMED) is NotImplemented:
            self._commit_py(decision, ctx, worker)
        evicted = self._record_access(worker, req, ctx, decision.overlap_blocks)
        policy.on_dispatch(decision, ctx)
        alternative = shared.workers.find(decision.alternative_worker_id) if decision.alternative_worker_id else None
        return _new_route_result(decision, worker, req, alternative, evicted, None, ())

    def _commit_py(self, decision: Decision, ctx: RoutingContext, worker: Worker) -> None:
        """What ``commit`` charges and counts for ``decision``: its overlap, the policy's prefix
        hit, the charge to ``worker``, the request kept, the decision counted. The reference of
        the native ``ledger_commit`` (``index/_native.c``)."""
        shared = self._shared
        req = ctx.request
        overlap = ctx.overlap(worker)
        decision.overlap_blocks = overlap
        self._count_prefix_hit(decision.policy, overlap, len(ctx.match.path))
        # a disaggregated request's decode worker receives its KV: it prefills nothing
        shared.workers.charge(worker, req.request_id, 0 if decision.prefill is not None else ctx.uncached_tokens(worker),
                              req.prompt_tokens, overlap, ctx.now, decision.policy)
        self._keep(req)
        shared.counters["decisions"] += 1
        self.decisions_by_policy[decision.policy] = self.decisions_by_policy.get(decision.policy, 0) + 1

    def announce(self, result: RouteResult) -> None:
        """Replica sync: hand a committed request, both hops charged, to ``on_committed``
        (after the prefill hop's commit, so the publisher sees the whole decision)."""
        if self.on_committed is not None:
            rid = result.request.request_id
            self._completed.pop(rid, None)  # a reused id is in flight again
            self._completed.pop(prefill_hop_id(rid), None)
            self.on_committed(result)

    def commit_prefill_hop(self, result: RouteResult, worker: Worker, ctx: RoutingContext, policy: RoutingPolicy) -> None:
        """Charge a committed disaggregated request's prefill hop to ``worker`` (``ctx``: that
        worker alone, under the hop's id, from ``Disaggregation.hop_context``), which now
        caches the prompt as it computes it; its policy sees the dispatch."""
        hop = result.decision.prefill
        assert hop is not None
        req = ctx.request
        self._hops_charged = True
        self._shared.workers.commit(InFlight(
            request_id=req.request_id, worker_id=worker.id, prefill_tokens=hop.uncached_tokens,
            prompt_tokens=req.prompt_tokens, overlap_blocks=hop.overlap_blocks, started_at=ctx.now,
            policy=result.decision.policy,
        ))
        result.prefill_evicted = self._record_access(worker, req, ctx, ctx.overlap(worker))
        policy.on_dispatch(Decision(worker.id, result.decision.policy, hop.reason, hop.candidates,
                                    overlap_blocks=hop.overlap_blocks), ctx)
        result.prefill_worker = worker

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
        shared = self._shared
        index, eviction = shared.index, shared.policies.eviction
        now = ctx.now
        slot, mode = worker.slot, worker.spec.mode  # ``Worker.mode`` is a property: a Python call
        uncached = overlap < len(req.keys)
        modelled = mode is CacheMode.APPROXIMATE
        approximate = modelled and uncached
        # ``SpeculativeBlocks.enabled``, read without the property's Python call
        speculative = uncached and mode is CacheMode.EVENTS and shared.settings.speculative_ttl_s > 0
        info = None
        if overlap or approximate or speculative:  # a frozen dataclass costs a few us: only when a hook gets it
            info = _new_access_info(req.session_id, int(req.task), req.prompt_tokens, 0, _DECODE_FROM_NONE)
        if overlap:
            path = ctx.match.path
            # the whole path (a full match, the common case) is handed on as it is: no copy
            matched = path if overlap == len(path) else path[:overlap]
            index.touch_path(slot, matched, now)
            eviction.on_accessed(index, slot, matched, info, now)
        if mode is CacheMode.EVENTS and getattr(eviction, "wants_request_info", False):
            self._recent.remember(req)
        if speculative:
            assert info is not None
            self._speculative.claim(worker, req.request_id, req.keys, overlap, info, now)
        if not modelled:
            return []
        if approximate:
            assert info is not None
            self._assume_cached(worker, req.keys, overlap, info, now)
        # checked after every decision, a full hit's too
        return self.fit_to_capacity(worker, now, req.keys)

    def fit_to_capacity(self, worker: Worker, now: float, prompt: Sequence[int] = ()) -> list[int]:
        """Evict from an approximate-mode worker's modelled cache down to its capacity (issue
        #28 item 7: a hard bound) and return the keys evicted, ``prompt``'s first blocks the
        last to go. After every decision, and wherever else the cache may pass its capacity:
        Stored events its engine sends, a re-registration with a smaller capacity."""
        index, eviction = self._shared.index, self._shared.policies.eviction
        slot = worker.slot
        capacity = self._capacity(worker)
        excess = index.count(slot) - capacity if capacity else 0
        if excess <= 0:
            return []
        victims = eviction.rank(EvictionContext(index, slot, now, worker.id), excess, frozenset(prompt[:capacity]))
        drop_blocks(eviction, index, slot, victims)
        excess -= len(victims)
        if excess > 0:
            # the prompt's own blocks were all that could go (a held block above one of them is
            # no leaf while it stays): capacity is a hard bound, so the ranking takes them too
            more = eviction.rank(EvictionContext(index, slot, now, worker.id), excess, frozenset())
            drop_blocks(eviction, index, slot, more)
            victims += more
        self._shared.counters["approx_evicted"] += len(victims)
        return [block.key for block in victims]

    def _capacity(self, worker: Worker) -> int:
        """Blocks an approximate-mode worker's modelled cache holds at most (0: unbounded)."""
        return worker.spec.capacity_blocks or self._shared.settings.approximate_capacity_blocks

    def _assume_cached(self, worker: Worker, keys: Sequence[int], overlap: int, info: AccessInfo, now: float) -> None:
        """An approximate-mode worker now caches ``keys`` (it held the first ``overlap``), as
        far as its capacity goes: a prompt longer than the cache leaves its first blocks there
        (what a later request can reuse), never more blocks than the cache holds (issue #28
        item 7: 4,375 blocks were kept against 500)."""
        index, eviction = self._shared.index, self._shared.policies.eviction
        capacity = self._capacity(worker)
        end = min(len(keys), capacity) if capacity else len(keys)
        if end <= overlap:
            return
        parent = keys[overlap - 1] if overlap else None
        stored = index.store(worker.slot, parent, keys[overlap:end], now)
        eviction.on_stored(index, worker.slot, stored, replace(info, first_offset=overlap), now)

    def _forget_assumed(self, worker: Worker, keys: Iterable[int]) -> None:
        """Another replica's eviction dropped ``keys`` from its model of an approximate worker."""
        index, slot = self._shared.index, worker.slot
        doomed: dict[int, Block] = {}  # distinct held blocks, in order
        for key in keys:
            block = index.get(key)
            if block is not None and block.holders >> slot & 1:
                doomed[key] = block
        drop_blocks(self._shared.policies.eviction, index, slot, list(doomed.values()))

    def complete(self, completion: Completion) -> InFlight:
        """Stop charging a routed request, tell its policy how it went. Raises NotFound for a
        request not in flight here (see ``complete_anywhere`` when replicas share load)."""
        check_completion(completion)  # before anything changes: a fit reads its numbers
        return self._complete_checked(completion)

    def _complete_checked(self, completion: Completion) -> InFlight:
        entry = self._finish(completion)
        if self.on_completed is not None:
            self._note_completed(completion.request_id)
            self.on_completed(completion)
        return entry

    def complete_anywhere(self, completion: Completion, checked: bool = False) -> InFlight | None:
        """``complete`` for replicas sharing load, where a Complete may reach this replica
        before the Dispatch of the replica that routed it (the gateway is faster than the
        bus). An id not in flight here is remembered, so its Dispatch charges nothing when it
        comes, and published like any completion (None is returned); an id that already
        completed raises NotFound, as a second Complete does on one replica. ``checked``: the
        caller made ``completion`` with ``check_completion``'s checks passed (the server's
        ``convert.completion``), and a Completion does not change, so they are not run again."""
        rid = completion.request_id
        if not checked:
            check_completion(completion)
        if self.on_completed is None:  # alone: nothing to publish, no Dispatch to wait for
            return self._finish(completion)
        if self._shared.workers.inflight(rid) is not None:
            return self._complete_checked(completion)
        if rid in self._completed:
            raise NotFound(f"request {rid!r} already completed")
        self._note_completed(rid)
        self.on_completed(completion)
        return None

    def _note_completed(self, request_id: str) -> None:
        completed = self._completed
        completed.pop(request_id, None)  # re-inserted at the end: the dict stays in time order
        completed[request_id] = self._shared.clock.now()
        if len(completed) > MAX_COMPLETED_IDS:
            completed.popitem(last=False)

    def release_prefill(self, completion: Completion) -> InFlight | None:
        """Release a request's prefill hop before its Complete (``completion.prefill_done``);
        None when none is charged (aggregated, released already, expired). Raises NotFound
        for a request not in flight here.

        While replicas share load the release is published (once: a hop released already,
        here or by another replica, is not published again), and, as in ``complete_anywhere``,
        a request not in flight here yet (its Dispatch still on the bus) is no error: its hop is
        remembered as released, so its Dispatch charges nothing when it comes. A request that
        completed raises NotFound, as on one replica."""
        check_completion(completion)
        rid = completion.request_id
        if self.on_completed is None:
            if self._shared.workers.inflight(rid) is None:
                raise NotFound(f"request {rid!r} is not in flight (unknown, completed or expired)")
            return self._release_hop(completion)
        if rid in self._completed:
            raise NotFound(f"request {rid!r} already completed")
        hop_id = prefill_hop_id(rid)
        if hop_id in self._completed:
            return None
        hop = self._release_hop(completion)
        self._note_completed(hop_id)
        self.on_completed(completion)
        return hop

    def _release_hop(self, completion: Completion) -> InFlight | None:
        shared = self._shared
        hop = shared.workers.inflight(prefill_hop_id(completion.request_id))
        if hop is None:
            return None
        shared.workers.release(hop.request_id)
        # the hop's claim on the prefill worker, like the request's on its decode worker
        self._speculative.ended(hop.request_id, completion.success)
        policy = shared.policies.routing.get(hop.policy)
        if policy is not None:
            # the hop's own record, under the hop's id (a policy keeping per-request state
            # releases the hop's, not the request's); its latency is the prefill's
            ms = completion.prefill_ms + completion.kv_transfer_ms
            policy.on_complete(shared.workers.find(hop.worker_id), None,
                               Completion(hop.request_id, ttft_ms=ms, e2e_ms=ms, success=completion.success),
                               shared.clock.now())
        return hop

    def finish_plan(self) -> tuple[Any, ...] | None:
        """What the native ``stream_complete`` reads to release a completed request in place of
        ``complete_anywhere`` (this ledger, the workers, the speculative claims, the in-flight
        entry's constructor, the routing policies and their count): None while a routing policy
        hears its completions (an ``on_complete`` of its own), which ``_finish`` calls and the
        native pass does not. Read once per batch: the pass declines a Complete once the
        policies' count changed (one built since)."""
        routing = self._shared.policies.routing
        if any(map(hears_completions, routing.values())):
            return None
        return (self, self._shared.workers, self._speculative, new_inflight, routing, len(routing))

    def _finish(self, completion: Completion) -> InFlight:
        shared = self._shared
        released = NotImplemented if self._hops_charged or _ledger_finish is None else _ledger_finish(
            self, shared.workers, completion.request_id, completion.success, self._speculative, new_inflight)
        entry, packed = self._finish_py(completion) if released is NotImplemented else released
        policy = shared.policies.routing.get(entry.policy)
        # most policies (cache_aware, the default, among them) keep nothing per request: neither
        # the request is unpacked for them nor its worker looked up
        hears = policy is not None and hears_completions(policy)
        req = unpack_request(packed) if packed is not None and (hears or completion.session_ended) else None
        if hears:
            policy.on_complete(shared.workers.find(entry.worker_id), req, completion,  # type: ignore[union-attr]
                               shared.clock.now())
        if completion.session_ended and req is not None and req.session_id:
            # end-aware eviction (T-LRU section 4): a finished conversation's tail goes first
            for eviction in shared.policies.eviction_by_name.values():
                end_session = getattr(eviction, "end_session", None)
                if end_session is not None:
                    end_session(req.session_id)
        return entry

    def _finish_py(self, completion: Completion) -> tuple[InFlight, PackedRequest | None]:
        """What a completion releases: its charge (and its prefill hop's), its entry in the
        table, its speculative blocks' claims. The reference of the native ``ledger_finish``
        (``index/_native.c``), which runs it where no prefill hop was ever charged."""
        shared = self._shared
        entry = shared.workers.release(completion.request_id)
        if self._hops_charged:
            self._release_hop(completion)
        packed = self.forget_request(completion.request_id)
        self._speculative.ended(completion.request_id, completion.success)
        return entry, packed

    def _keep(self, req: RouteRequest) -> None:
        """Put a routed request in the table (packed), counting its bytes and its client's requests."""
        if native.module is None or native.module.ledger_keep(self, req) is NotImplemented:
            self._keep_py(req)

    def _keep_py(self, req: RouteRequest) -> None:
        """``_keep``'s reference, of the native ``ledger_keep`` (``index/_native.c``), which
        handles a request whose keys are an ``array('Q')`` and whose fields are of their exact types."""
        size = request_bytes(req)
        self.requests[req.request_id] = pack_request(req, size)
        self.inflight_bytes += size
        if req.client:
            self.by_client[req.client] = self.by_client.get(req.client, 0) + 1

    def forget_request(self, request_id: str) -> PackedRequest | None:
        """Drop a request from the table, its bytes from ``inflight_bytes`` and it from its
        client's count; returns it as kept (``unpack_request`` makes it a RouteRequest again:
        ~1 us, paid only where it is read)."""
        if native.module is not None:
            packed = native.module.ledger_forget(self, request_id)
            if packed is not NotImplemented:
                return packed
        return self._forget_py(request_id)

    def _forget_py(self, request_id: str) -> PackedRequest | None:
        """``forget_request``'s reference, of the native ``ledger_forget``."""
        packed = self.requests.pop(request_id, None)
        if packed is None:
            return None
        self.inflight_bytes -= packed[_SIZE]
        client = packed[_CLIENT]
        if client:
            left = self.by_client[client] - 1
            if left:
                self.by_client[client] = left
            else:
                del self.by_client[client]
        return packed

    def forget_worker(self, worker_id: str) -> None:
        """The worker is being removed: forget the requests in flight on it, and its claims."""
        workers = self._shared.workers
        worker = workers.find(worker_id)
        if worker is not None:
            self._speculative.forget_worker(worker)
        for rid in [rid for rid in self.requests if workers.inflight_worker(rid) == worker_id]:
            self.forget_request(rid)

    def request(self, request_id: str) -> RouteRequest | None:
        """The routed request ``request_id`` while it is in flight (an equal copy of it)."""
        packed = self.requests.get(request_id)
        return None if packed is None else unpack_request(packed)

    def request_model(self, request_id: str) -> str | None:
        """``request(request_id).model`` without unpacking the request (a Complete's metrics
        want the model alone); None when it is not in flight."""
        packed = self.requests.get(request_id)
        return None if packed is None else packed[_MODEL]

    def expire_inflight(self) -> list[InFlight]:
        """Stop charging requests whose completion never came (caller crashed, lost Complete)."""
        shared = self._shared
        cutoff = shared.clock.now() - shared.settings.inflight_timeout_s
        expired = shared.workers.expire(cutoff)
        for entry in expired:
            self.forget_request(entry.request_id)
        shared.counters["inflight_expired"] += len(expired)
        completed = self._completed
        while completed:
            rid, at = next(iter(completed.items()))
            if at >= cutoff:
                break
            del completed[rid]
        return expired

    # ---- replica sync -----------------------------------------------------------------
    def apply_dispatch(self, dispatch: Dispatch, *, own: bool = False) -> bool:
        """Another replica committed ``dispatch``: charge its load here too, and for an
        approximate-mode worker assume the routed prefix cached (and the blocks that replica
        evicted gone), as it did. Returns whether load was charged.

        A Dispatch whose request already completed (its Complete reached some replica first)
        charges nothing; a prefill hop's (its id is ``prefill_hop_id`` of the request's) charges
        nothing either once the hop was released (``prefill_done``) or its request completed, and
        is not kept in the request table, as on the replica that routed it.
        ``own``: this replica published it (read back in stream order): the
        load is already charged, but the approximate prefix is re-applied, so that every
        replica ends on the stream's order of stores and evictions, whatever order each saw
        them in locally. Dispatches name workers by id; one this replica does not know is
        counted and ignored (Dynamo's router replica sync works the same way, by request id).
        """
        shared = self._shared
        worker = shared.workers.find(dispatch.worker_id)
        if worker is None:
            shared.counters["remote_unknown_workers"] += 1
            return False
        now = shared.clock.now()
        charged = False
        rid = dispatch.request_id
        hop = rid.startswith(PREFILL_HOP_PREFIX)
        late = False
        if not own:
            if rid in self._completed or (hop and rid[len(PREFILL_HOP_PREFIX):] in self._completed):
                shared.counters["remote_late_dispatches"] += 1
                late = True
            elif shared.workers.inflight(rid) is None:
                self._hops_charged |= hop
                shared.workers.commit(InFlight(
                    request_id=rid, worker_id=worker.id, prefill_tokens=dispatch.prefill_tokens,
                    prompt_tokens=dispatch.prompt_tokens, overlap_blocks=dispatch.overlap_blocks,
                    # expiry order follows arrival (InFlight entries are queued as committed): an
                    # old Dispatch expires at most its delivery lag late
                    started_at=now - max(0.0, dispatch.age_s), policy=dispatch.policy,
                ))
                if not hop:  # counted, never refused: routed elsewhere
                    self._keep(RouteRequest(rid, (), dispatch.prompt_tokens, session_id=dispatch.session_id,
                                            task=dispatch.task))
                shared.counters["remote_dispatches"] += 1
                charged = True
        if dispatch.keys and worker.mode is CacheMode.APPROXIMATE:
            self._apply_assumed(worker, dispatch, own, now)
        elif dispatch.keys and not own and not late and self._speculative.enabled:
            # a late one's request ended before it came (a fast refusal's Complete beats the
            # bus): no completion will end its claim, which would outlive it by the whole TTL
            self._claim_remote(worker, dispatch, now)
        return charged

    def _claim_remote(self, worker: Worker, dispatch: Dispatch, now: float) -> None:
        """Another replica routed this prompt to an events-mode worker: claim its blocks here
        too, from when it was routed, so this replica's next decision sees them as that one's
        does (the engine's Stored confirms them on every replica alike)."""
        keys = dispatch.keys
        overlap = self._shared.index.match(keys, worker.bit).overlap(worker.slot)
        if overlap < len(keys):
            info = AccessInfo(session_id=dispatch.session_id, task=int(dispatch.task), prompt_tokens=dispatch.prompt_tokens)
            self._speculative.claim(worker, dispatch.request_id, keys, overlap, info, now,
                                    since=now - max(0.0, dispatch.age_s))

    def _apply_assumed(self, worker: Worker, dispatch: Dispatch, own: bool, now: float) -> None:
        keys, slot, index = dispatch.keys, worker.slot, self._shared.index
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
                self._shared.policies.eviction.on_accessed(index, slot, matched, info, now)
            if overlap < len(keys):
                self._assume_cached(worker, keys, overlap, info, now)
        self._forget_assumed(worker, dispatch.evicted)

    def apply_completion(self, completion: Completion, *, own: bool = False) -> InFlight | None:
        """A Complete another replica received: release the load here and tell the policy, as
        ``complete`` does, without publishing it again. An unknown id is remembered (its
        Dispatch may still be on the way). Returns the released entry, if any.

        One with ``prefill_done`` releases the request's prefill hop alone, as
        ``release_prefill`` did where it was received; a hop not charged here (released
        already, or its Dispatch still on the way) is remembered as released."""
        if own:
            return None
        rid = completion.request_id
        if completion.prefill_done:
            hop = self._release_hop(completion)
            self._note_completed(prefill_hop_id(rid))
            if hop is not None:
                self._shared.counters["remote_prefill_releases"] += 1
            return hop
        if self._shared.workers.inflight(rid) is None:
            self._note_completed(rid)
            return None
        entry = self._finish(completion)
        self._note_completed(rid)
        self._shared.counters["remote_completions"] += 1
        return entry
