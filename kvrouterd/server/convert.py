"""Protobuf messages <-> the core vocabulary; the one module that imports the generated message classes.

Other modules reach the classes through ``convert.pb``: the servicer builds its answers with
them, and ``off_loop`` parses what is left of a huge Route once ``wire`` has cut its prompt out.

Everything here validates shape (which fields are set, sizes) and raises InvalidRequest;
semantic checks (known worker, sequence order) stay in the Router.
Token ids come packed (``token_ids_le32``: little-endian uint32 bytes, what the SDK sends), which
is already the buffer the block hash reads, or repeated (``token_ids``, older clients and grpcurl),
converted with numpy: ``np.asarray(repeated_field)`` reads upb's packed buffer
directly (3 us for 4,000 tokens here) where ``array('I', field)`` iterates it (250 us).
Engine hashes end up as Python ints anyway, so they are sliced out of the field (a list built in
C): a numpy round trip costs more than that for the tens of hashes an event carries (a third of
the conversion's instructions per stored block, by callgrind). A Route's block keys go through
numpy into an ``array('Q')``, as hashing its token ids gives them: for a prompt's hundreds of
keys that is cheaper than the list, and the ledger keeps an array's bytes without a key-by-key pack.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from .._generated.kvrouter.v1 import router_pb2 as pb
from ..bounds import MAX_CACHED_TOKENS, MAX_LATENCY_MS, MAX_OUTPUT_TOKENS, check_completion
from ..errors import InvalidRequest, Overloaded, quote
from ..index import native
from ..index.workers import Worker, WorkerSpec
from ..protocols import (
    CacheEvent,
    CacheMode,
    Cleared,
    Completion,
    Dispatch,
    EventBatch,
    EvictRequest,
    Removed,
    RouteRequest,
    Stored,
    TaskCategory,
    WorkerRole,
    WorkerState,
)
from ..router import Router, RouteResult, prefill_hop_id
from .stream_wire import WireComplete, WireRoute, as_message
from .wire import WirePrompt

__all__ = [
    "EVENT_BLOCKS",
    "BatchLimits",
    "BatchTooLarge",
    "HashedPrompt",
    "batch_blocks",
    "block_keys",
    "check_id",
    "check_split",
    "completed_delta",
    "completion",
    "dispatched_delta",
    "event_batch",
    "event_batch_bytes",
    "event_batch_message",
    "evict_request",
    "le_u32",
    "load_delta",
    "marker_delta",
    "pb",
    "route_request",
    "route_response",
    "worker_message",
    "worker_spec",
]

_MODE_FROM_PB = {pb.CACHE_STATE_MODE_EVENTS: CacheMode.EVENTS, pb.CACHE_STATE_MODE_APPROXIMATE: CacheMode.APPROXIMATE}
_MODE_TO_PB = {v: k for k, v in _MODE_FROM_PB.items()}
_STATE_TO_PB = {
    WorkerState.READY: pb.WORKER_STATE_READY,
    WorkerState.DEGRADED: pb.WORKER_STATE_DEGRADED,
    WorkerState.DRAINING: pb.WORKER_STATE_DRAINING,
}
_ROLE_FROM_PB = {pb.WORKER_ROLE_UNSPECIFIED: WorkerRole.BOTH, pb.WORKER_ROLE_BOTH: WorkerRole.BOTH,
                 pb.WORKER_ROLE_PREFILL: WorkerRole.PREFILL, pb.WORKER_ROLE_DECODE: WorkerRole.DECODE}
_ROLE_TO_PB = {WorkerRole.BOTH: pb.WORKER_ROLE_BOTH, WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
               WorkerRole.DECODE: pb.WORKER_ROLE_DECODE}
_TASKS = {int(t): t for t in TaskCategory}
#: dtype objects, not strings: numpy parses a dtype string on every call (1.5 us of 4.8 for 4,000 tokens)
_U32_LE = np.dtype("<u4")
_U64 = np.dtype("=u8")  # an array('Q')'s own layout


def le_u32(field: Iterable[int]) -> bytes:
    """Repeated token ids as the little-endian uint32 buffer the block hash reads."""
    return np.asarray(field, dtype=_U32_LE).tobytes()


def block_keys(field: Iterable[int]) -> array:
    """A Route's ``block_keys`` as the ``array('Q')`` hashing token ids gives (``keys_for_tokens``),
    so the rest of the Route is the same whichever form came: the ledger keeps an array's bytes
    as they are where it packs a list key by key, and reads them back as bytes, not as ints."""
    keys = array("Q")
    keys.frombytes(np.asarray(field, dtype=_U64).tobytes())
    return keys


def _packed_count(name: str, packed: bytes | int) -> int:
    """Token ids in a ``token_ids_le32`` field (or its length): 4 bytes each, so any other length is malformed."""
    size = packed if isinstance(packed, int) else len(packed)
    if size % 4:
        raise InvalidRequest(f"{name} holds {size} bytes, not a multiple of 4 (little-endian uint32 token ids)")
    return size // 4


def _stored_tokens(st: pb.StoredBlocks, i: int) -> bytes:
    """A stored event's tokens as little-endian uint32 bytes, from either token field: the packed
    one is already that buffer (no per-token decoding at all), the repeated one goes through numpy."""
    packed = st.token_ids_le32
    if not packed:
        return le_u32(st.token_ids)
    if len(st.token_ids):
        raise InvalidRequest(f"events[{i}].stored: set exactly one of token_ids and token_ids_le32, not both")
    _packed_count(f"events[{i}].stored.token_ids_le32", packed)
    return packed


def check_id(name: str, value: str, limit: int) -> str:
    """``value`` if it is at most ``limit`` characters (``limits.max_id_length``), else
    INVALID_ARGUMENT quoting its start: a megabyte id must not become a megabyte message."""
    if len(value) > limit:
        raise InvalidRequest(f"{name} {quote(value)} is longer than limits.max_id_length={limit}")
    return value


#: the answer to a Route carrying more than one form of its prompt (checked on both Route paths)
_ONE_PROMPT_FORM = "set exactly one of token_ids, token_ids_le32 and block_keys, not several"


def _route_task(msg: pb.RouteRequest, router: Router) -> TaskCategory:
    """The checks after the prompt's form: a known task, ids within limits."""
    task = _TASKS.get(msg.task)
    if task is None:
        raise InvalidRequest(f"unknown task category {msg.task}")
    id_limit = router.settings.max_id_length
    if len(msg.model) > id_limit or len(msg.lora) > id_limit or len(msg.cache_salt) > id_limit:
        check_id("model", msg.model, id_limit)  # before they salt the hash
        check_id("lora", msg.lora, id_limit)
        check_id("cache_salt", msg.cache_salt, id_limit)
    return task


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    """A split Route's prompt, counted and hashed off the loop (``off_loop.hash_wire_prompt``)."""

    tokens: int
    #: None when ``tokens`` is over the limit (nothing was hashed)
    keys: array | None


#: RouteRequest built without the dataclass ``__init__`` (0.6 us with twelve keywords, on every Route)
_new_route_request = native.positional_constructor(RouteRequest)


#: ``_route_request_py`` for a prompt sent packed, in one native call (None: no extension)
_route_request_packed = native.module.route_request_packed if native.module is not None else None
if native.module is not None:  # the native passes read these messages' set fields in one call
    native.module.message_layouts(pb.RouteRequest, pb.CompleteRequest)


def route_request(msg: pb.RouteRequest | WireRoute, router: Router, hashed: HashedPrompt | None = None,
                  client: str = "") -> RouteRequest:
    """A RouteRequest with block keys, from token ids or from caller-computed keys; ``client``
    names who sent it (the gRPC peer: ``RouteRequest.client``). See ``_route_request_py``; a
    prompt sent as ``token_ids_le32`` (what the SDK and ext_proc send) that passes every check
    is converted natively (``route_request_packed``), the same request. ``msg`` may be a
    RouteStream batch's Route as read from its bytes (``stream_wire``), which the reference
    reads parsed from the Route's own bytes."""
    if hashed is None and _route_request_packed is not None:
        settings = router.settings
        req = _route_request_packed(msg, _new_route_request, _TASKS, router.adapter_bases, settings.max_id_length,
                                    settings.max_prompt_tokens, router.block_size, client)
        if req is not NotImplemented:
            return req
    return _route_request_py(as_message(msg, pb.RouteRequest), router, hashed, client)


def _route_request_py(msg: pb.RouteRequest, router: Router, hashed: HashedPrompt | None = None,
                      client: str = "") -> RouteRequest:
    """``route_request``'s reference, of the native ``route_request_packed`` (``index/_native.c``).

    Checks run in this order (the first failing one answers): exactly one prompt form, a known
    task, the prompt-size limit. The limit is checked before hashing so an oversized prompt
    costs nothing; the Router checks it again for callers that build RouteRequests themselves.
    ``hashed``: the prompt of a ``SplitRoute`` (``msg`` then carries no token ids), already
    counted and hashed off the event loop by ``off_loop.hash_wire_prompt``.
    """
    tokens = msg.token_ids
    n_keys = len(msg.block_keys)
    if hashed is not None:
        packed = b""
        n_tokens = hashed.tokens
        if n_keys:
            raise InvalidRequest(_ONE_PROMPT_FORM)
    elif packed := msg.token_ids_le32:
        if len(tokens) or n_keys:
            raise InvalidRequest(_ONE_PROMPT_FORM)
        n_tokens = _packed_count("token_ids_le32", packed)
    else:
        n_tokens = len(tokens)
        if n_tokens and n_keys:
            raise InvalidRequest(_ONE_PROMPT_FORM)
        if not n_tokens and not n_keys:
            raise InvalidRequest("the prompt is empty: set token_ids, token_ids_le32 or block_keys")
    task = _route_task(msg, router)
    if n_tokens:
        limit = router.settings.max_prompt_tokens
        if n_tokens > limit:
            raise Overloaded(f"prompt of {n_tokens} tokens exceeds max_prompt_tokens={limit}")
        if hashed is not None:
            assert hashed.keys is not None  # hash_wire_prompt leaves them out only past the limit
            keys = hashed.keys
        else:
            keys = router.keys_for_tokens(packed or le_u32(tokens), msg.model, msg.lora, msg.cache_salt)
        prompt_tokens = n_tokens
    else:
        keys = block_keys(msg.block_keys)
        prompt_tokens = msg.prompt_tokens or n_keys * router.block_size
    candidates = msg.candidate_workers
    # every field, in declaration order (see _new_route_request)
    return _new_route_request(msg.request_id, keys, prompt_tokens, msg.session_id, task, msg.ttft_slo_ms,
                              msg.expected_output_tokens, msg.policy, tuple(candidates) if len(candidates) else (),
                              msg.model, msg.lora, client)


def check_split(prompt: WirePrompt, msg: pb.RouteRequest, router: Router) -> None:
    """``route_request``'s checks of a split Route (``prompt`` cut out of ``msg`` by ``wire``), in
    its order, as far as they go before the prompt is decoded: a request they reject costs no
    hashing (the size limit is applied while hashing)."""
    if prompt.both or len(msg.block_keys):
        raise InvalidRequest(_ONE_PROMPT_FORM)
    if prompt.packed:
        _packed_count("token_ids_le32", prompt.size)
    _route_task(msg, router)


def route_response(result: RouteResult, block_size: int, into: pb.RouteResponse | None = None) -> pb.RouteResponse:
    """The RouteResponse for ``result``, written into ``into`` when given: a RouteStream reply's
    own ``route`` field, filled in place, costs half of building a message and copying it in."""
    d = result.decision
    worker = result.worker
    overlap = d.overlap_blocks
    msg = pb.RouteResponse() if into is None else into
    msg.request_id = result.request.request_id
    msg.worker_id = worker.id
    msg.worker_address = worker.spec.address  # not the ``address`` property: a Python call a Route
    msg.matched_blocks = overlap
    msg.matched_tokens = overlap * block_size
    msg.prompt_blocks = len(result.request.keys)
    msg.policy = d.policy
    msg.reason = d.reason
    msg.estimated_ttft_ms = d.estimated_ttft_ms
    alt = result.alternative
    if alt is not None:
        msg.alternative_worker_id = alt.id
        msg.alternative_worker_address = alt.address
    if d.pd_reason:
        msg.disaggregation_reason = d.pd_reason
        msg.decode_uncached_tokens = d.decode_uncached_tokens
        hop, prefill = d.prefill, result.prefill_worker
        if hop is not None and prefill is not None:
            msg.disaggregated = True
            msg.prefill_worker_id = prefill.id
            msg.prefill_worker_address = prefill.address
            msg.prefill_uncached_tokens = hop.uncached_tokens
    return msg


#: Completion built without its frozen ``__init__`` (1.5 us of ten ``object.__setattr__``, on every Complete)
_new_completion = native.positional_constructor(Completion)


#: ``_completion_py`` for a Complete that passes its checks, in one native call (None: no extension)
_completion_of = native.module.completion_of if native.module is not None else None
_COMPLETION_LIMITS = (MAX_LATENCY_MS, MAX_OUTPUT_TOKENS, MAX_CACHED_TOKENS)


def completion(msg: pb.CompleteRequest | WireComplete, max_id_length: int = 0) -> Completion:
    """``max_id_length`` 0: unchecked (a replica's load delta, checked where the call came in).
    See ``_completion_py``; natively ``completion_of`` builds the same Completion for one that
    passes every check. ``msg`` may be a RouteStream batch's Complete as read from its bytes
    (``stream_wire``), which the reference reads parsed from the Complete's own bytes."""
    if _completion_of is not None:
        done = _completion_of(msg, _new_completion, max_id_length, _COMPLETION_LIMITS)
        if done is not NotImplemented:
            return done
    return _completion_py(as_message(msg, pb.CompleteRequest), max_id_length)


def completion_reading(max_id_length: int) -> tuple[Any, int, tuple[float, int, int]]:
    """What the native passes that build a Completion read (``completion_of``'s arguments
    after the message): the constructor, ``max_id_length`` and the checks' bounds."""
    return _new_completion, max_id_length, _COMPLETION_LIMITS


def _completion_py(msg: pb.CompleteRequest, max_id_length: int = 0) -> Completion:
    """``completion``'s reference, of the native ``completion_of`` (``index/_native.c``)."""
    if not msg.request_id:
        raise InvalidRequest("request_id is required")
    if max_id_length:
        check_id("request_id", msg.request_id, max_id_length)
    # every field, in declaration order (see _new_completion)
    done = _new_completion(msg.request_id, msg.ttft_ms, msg.e2e_ms, msg.cached_tokens, msg.output_tokens, msg.success,
                           msg.session_ended, msg.prefill_ms, msg.kv_transfer_ms, msg.prefill_done)
    check_completion(done)  # a replica's delta is refused here, at its edge
    return done


def worker_spec(msg: pb.Worker) -> WorkerSpec:
    if msg.mode == pb.CACHE_STATE_MODE_UNSPECIFIED:
        mode = CacheMode.EVENTS if msg.kv_events_endpoint else CacheMode.APPROXIMATE
    elif msg.mode in _MODE_FROM_PB:
        mode = _MODE_FROM_PB[msg.mode]
    else:
        raise InvalidRequest(f"unknown cache state mode {msg.mode}")
    role = _ROLE_FROM_PB.get(msg.role)
    if role is None:
        raise InvalidRequest(f"unknown worker role {msg.role}")
    return WorkerSpec(
        id=msg.id,
        address=msg.address,
        capacity_blocks=msg.capacity_blocks,
        block_size=msg.block_size,
        labels=dict(msg.labels),
        mode=mode,
        kv_events_endpoint=msg.kv_events_endpoint,
        models=tuple(msg.models),
        loras=tuple(msg.loras),
        max_loras=msg.max_loras,
        role=role,
    )


def worker_message(worker: Worker, cached_blocks: int, block_size: int, now: float = 0.0) -> pb.Worker:
    """``now``: the router's clock, for ``last_event_age_s`` (0 leaves it unset: a snapshot's copy)."""
    s = worker.spec
    return pb.Worker(
        id=s.id,
        address=s.address,
        capacity_blocks=s.capacity_blocks,
        block_size=s.block_size or block_size,
        labels=dict(s.labels),
        state=_STATE_TO_PB[worker.state],
        mode=_MODE_TO_PB[s.mode],
        cached_blocks=cached_blocks,
        inflight_requests=worker.inflight_requests,
        pending_prefill_tokens=max(0, worker.pending_prefill_tokens),
        kv_events_endpoint=s.kv_events_endpoint,
        state_reason=worker.state_reason,
        events_rejected=worker.events_rejected,
        models=s.models,
        loras=s.loras,
        max_loras=s.max_loras,
        role=_ROLE_TO_PB[s.role],
        loaded_loras=list(worker.loras),
        event_batches=worker.batches_applied,
        last_event_age_s=max(0.0, now - worker.last_event_at) if now and worker.batches_applied else 0.0,
    )


#: Stored(*every field in order), built natively without the frozen __init__ (index.native)
_new_stored = native.positional_constructor(Stored)


def _events(msgs: Iterable[pb.CacheEvent]) -> tuple[CacheEvent, ...]:
    out: list[CacheEvent] = []
    for i, ev in enumerate(msgs):
        kind = ev.WhichOneof("event")
        if kind == "stored":
            st = ev.stored
            hashes = st.engine_hashes
            hashes = tuple(hashes[:]) if len(hashes) else None
            out.append(
                _new_stored(
                    _stored_tokens(st, i),  # token_ids
                    hashes,  # engine_hashes
                    st.parent_engine_hash if st.HasField("parent_engine_hash") else None,
                    st.block_size,
                    st.model,
                    st.lora,
                    None,  # group: one KV-cache group
                    None,  # group_kind
                    st.cache_salt,  # salt
                    None,  # extra_hashes
                )
            )
        elif kind == "removed":
            out.append(Removed(tuple(ev.removed.engine_hashes[:])))
        elif kind == "cleared":
            out.append(Cleared())
        else:
            raise InvalidRequest(f"events[{i}] has no event set")
    return tuple(out)


#: Batches count +1 from 0, so no publisher reaches 2**63; a larger number would be applied and
#: then not fit the int64 ``WorkerSequence.last_sequence`` the answer reports it in (the fuzz test
#: found that as an UNKNOWN status after the batch had changed the index).
MAX_EVENT_SEQUENCE = 2**63 - 1


# ---- how much one event batch may carry (issue #16 items 1 and 3) ------------------------------
#
# A batch is read, converted and applied in one turn of the event loop (grpc.aio runs the
# deserializer on the loop, and upb and the native reader hold the GIL, so a thread would not
# help): one PublishEvents message of 219k blocks held the loop 23-35 ms reading natively,
# 84-97 ms parsing on the reference path, then 66-100 ms applying. So its size is bounded
# twice, and more is RESOURCE_EXHAUSTED before the work: its bytes (``limits.max_event_batch_bytes``,
# on len(data) before any parsing: bounds what upb parses) and its blocks
# (``limits.max_batch_blocks``, ``batch_blocks``: bounds the ints made and what the router
# applies; counted before a hash is read). The SDK splits what it sends under both.
#
# An event costs more than a block by itself (natively ~6.5 us to convert and apply a one-block
# stored event, ~0.26 us a block of a long one; a removal ~1.1 us, a clear ~2.7 us), so every
# event counts at least EVENT_BLOCKS: without that, 4,096 one-block events held the loop 27 ms.
# 8, not the ~25 the costs suggest: the SDK's batches of up to 512 small events (its default
# max_batch_events, before it cut batches to the limits) still fit the default 4,096, and 512
# one-block events hold the loop ~3.5 ms.

#: the least one event counts against limits.max_batch_blocks (the SDK counts the same)
EVENT_BLOCKS = 8


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one event batch may carry (config ``limits``); ``block_size``: the router's, which
    a stored event without its own block_size counts its blocks in."""

    max_events: int
    max_id_length: int
    max_bytes: int
    max_blocks: int
    block_size: int

    def too_many_bytes(self, size: int) -> str:
        return (f"event batch of {size} bytes exceeds limits.max_event_batch_bytes={self.max_bytes}: "
                f"split the batch; the kvrouter_client SDK does")

    def too_many_blocks(self) -> str:
        return (f"event batch carries more than limits.max_batch_blocks={self.max_blocks} blocks (stored pages "
                f"and removed hashes; each event counts at least {EVENT_BLOCKS}): split the batch; the kvrouter_client "
                f"SDK does")


@dataclass(frozen=True, slots=True)
class BatchTooLarge:
    """A PublishEvents message over ``limits.max_event_batch_bytes``, as its deserializer hands it
    over, unparsed: ``message`` is RESOURCE_EXHAUSTED's (the handler aborts with it)."""

    size: int
    message: str


def batch_blocks(msg: pb.EventBatch, block_size: int, limit: int) -> int:
    """The blocks of a batch, as ``limits.max_batch_blocks`` counts them, up to the first count
    over ``limit`` (then the rest is not looked at): a stored event counts its pages,
    ``tokens // (its block_size or the router's block_size)``, or its engine hashes if they are
    more (what the reader makes an int of); a removed event its engine hashes; every event at
    least ``EVENT_BLOCKS``, so the limit bounds the events a batch converts too. The native reader
    (``read_event_batch``) counts the same way."""
    total = 0
    for ev in msg.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            st = ev.stored
            tokens = len(st.token_ids_le32) // 4 or len(st.token_ids)
            blocks = max(tokens // (st.block_size or block_size), len(st.engine_hashes))
        elif kind == "removed":
            blocks = len(ev.removed.engine_hashes)
        else:
            blocks = 1
        total += blocks if blocks > EVENT_BLOCKS else EVENT_BLOCKS
        if total > limit:
            break
    return total


def event_batch(msg: pb.EventBatch, limits: BatchLimits) -> EventBatch:
    if not msg.worker_id:
        raise InvalidRequest("event batch without worker_id")
    check_id("worker_id", msg.worker_id, limits.max_id_length)
    if msg.sequence > MAX_EVENT_SEQUENCE:
        raise InvalidRequest(f"event batch sequence {msg.sequence} is above 2**63-1 (batches count +1 from 0)")
    if len(msg.events) > limits.max_events:
        raise Overloaded(f"event batch of {len(msg.events)} events exceeds max_batch_events={limits.max_events}")
    if batch_blocks(msg, limits.block_size, limits.max_blocks) > limits.max_blocks:
        raise Overloaded(limits.too_many_blocks())
    return EventBatch(worker_id=msg.worker_id, sequence=msg.sequence, events=_events(msg.events))


#: EventBatch and Removed built as _new_stored builds Stored
_new_batch = native.positional_constructor(EventBatch)
_new_removed = native.positional_constructor(Removed)
#: the native reader of a plain EventBatch message (None on the pure-Python path)
_read_event_batch = getattr(native.module, "read_event_batch", None)


def event_batch_message(data: bytes, limits: BatchLimits) -> EventBatch | pb.EventBatch | BatchTooLarge:
    """``PublishEvents``' request deserializer: ``BatchTooLarge`` for a message over
    ``limits.max_bytes`` (nothing parsed); else ``event_batch``'s batch for ``data``, read natively
    from the bytes where the message has the plain form protobuf encoders write and nothing in it
    is refused; otherwise (or without the extension) the parsed message, for ``event_batch`` to
    convert or refuse. Parsing then converting costs ~290 ns a stored block of the bench's 32-block
    events, reading natively ~80 (``_native.c``: read_event_batch, which says what it leaves to
    protobuf; most of the rest is the engine hashes' ints, which the core events hold). A batch
    over ``limits.max_blocks`` is left to the reference too, which refuses it: the reader stops
    at the first event past the limit, before making its ints."""
    if len(data) > limits.max_bytes:
        return BatchTooLarge(len(data), limits.too_many_bytes(len(data)))
    if _read_event_batch is not None:
        batch = _read_event_batch(data, limits.max_events, limits.max_id_length, _new_batch, _new_stored, _new_removed,
                                  Cleared, limits.max_blocks, limits.block_size, EVENT_BLOCKS)
        if batch is not None:
            return batch  # type: ignore[no-any-return]
    return pb.EventBatch.FromString(data)


def event_batch_bytes(data: bytes, limits: BatchLimits) -> EventBatch:
    """An ``EventBatch`` message as read from the event bus (serialized, as ``PublishEvents`` sends
    it), under the same limits."""
    try:
        msg = event_batch_message(data, limits)
    except DecodeError as exc:
        raise InvalidRequest(f"event batch does not parse: {exc}") from None
    if type(msg) is BatchTooLarge:
        raise Overloaded(msg.message)
    return msg if isinstance(msg, EventBatch) else event_batch(msg, limits)  # type: ignore[arg-type]


def dispatched_delta(replica_id: str, result: RouteResult, prefill_tokens: int, speculative: bool = False) -> bytes:
    """The load delta (``LoadDelta.dispatched``) of a committed decision, for replica sync.

    The prompt's keys go with it for an approximate-mode worker (the other replicas assume
    them cached, as this one did) and, with ``speculative`` indexing on, for an events-mode one
    (they claim them until the engine's Stored, which every replica receives, confirms them)."""
    return _dispatched(replica_id, result, result.request.request_id, result.worker, prefill_tokens,
                       result.decision.overlap_blocks, result.evicted, speculative)


def prefill_hop_delta(replica_id: str, result: RouteResult, speculative: bool = False) -> bytes:
    """The load delta of a committed disaggregated decision's prefill hop: a Dispatch of its
    own under the hop's in-flight id (``router.disagg.prefill_hop_id``), charging the prefill
    worker the tokens to prefill, as ``dispatched_delta`` does the decode hop."""
    hop, worker = result.decision.prefill, result.prefill_worker
    assert hop is not None and worker is not None
    return _dispatched(replica_id, result, prefill_hop_id(result.request.request_id), worker, hop.uncached_tokens,
                       hop.overlap_blocks, result.prefill_evicted, speculative)


def _dispatched(replica_id: str, result: RouteResult, request_id: str, worker: Worker, prefill_tokens: int,
                overlap_blocks: int, evicted: Sequence[int], speculative: bool) -> bytes:
    req = result.request
    msg = pb.Dispatched(
        request_id=request_id, worker_id=worker.id, prefill_tokens=prefill_tokens,
        prompt_tokens=req.prompt_tokens, overlap_blocks=overlap_blocks,
        policy=result.decision.policy, session_id=req.session_id, task=int(req.task),
    )
    if worker.mode is CacheMode.APPROXIMATE:
        msg.keys.extend(req.keys)
        msg.evicted_keys.extend(evicted)
    elif speculative and overlap_blocks < len(req.keys):
        msg.keys.extend(req.keys)
    return pb.LoadDelta(replica_id=replica_id, dispatched=msg).SerializeToString()


def completed_delta(replica_id: str, done: Completion) -> bytes:
    """A Complete this replica received (a ``prefill_done`` one releases the prefill hop alone)."""
    msg = pb.CompleteRequest(
        request_id=done.request_id, ttft_ms=done.ttft_ms, e2e_ms=done.e2e_ms, cached_tokens=done.cached_tokens,
        output_tokens=done.output_tokens, success=done.success, session_ended=done.session_ended,
        prefill_ms=done.prefill_ms, kv_transfer_ms=done.kv_transfer_ms, prefill_done=done.prefill_done,
    )
    return pb.LoadDelta(replica_id=replica_id, completed=msg).SerializeToString()


def marker_delta(replica_id: str) -> bytes:
    return pb.LoadDelta(replica_id=replica_id).SerializeToString()


def load_delta(data: bytes, age_s: float) -> tuple[str, Dispatch | Completion | None]:
    """``(publishing replica, Dispatch | Completion | None for a marker)`` from the load stream."""
    try:
        msg = pb.LoadDelta.FromString(data)
    except DecodeError as exc:
        raise InvalidRequest(f"load delta does not parse: {exc}") from None
    kind = msg.WhichOneof("kind")
    if kind == "completed":
        return msg.replica_id, completion(msg.completed)
    if kind != "dispatched":
        return msg.replica_id, None
    d = msg.dispatched
    if not d.request_id or not d.worker_id:
        raise InvalidRequest("load delta without request_id or worker_id")
    return msg.replica_id, Dispatch(
        request_id=d.request_id, worker_id=d.worker_id, prefill_tokens=d.prefill_tokens, prompt_tokens=d.prompt_tokens,
        overlap_blocks=d.overlap_blocks, policy=d.policy, keys=list(d.keys), evicted=list(d.evicted_keys),
        session_id=d.session_id, task=_TASKS.get(d.task, TaskCategory.UNSPECIFIED), age_s=age_s,
    )


def evict_request(msg: pb.EvictHintRequest, router: Router) -> tuple[EvictRequest, tuple[int, ...]]:
    if not msg.worker_id:
        raise InvalidRequest("worker_id is required")
    check_id("worker_id", msg.worker_id, router.settings.max_id_length)
    check_id("policy", msg.policy, router.settings.max_id_length)
    if bool(msg.blocks) == bool(msg.tokens):
        raise InvalidRequest("set exactly one of blocks and tokens to a positive number")
    pinned = len(msg.pinned_keys) + len(msg.pinned_engine_hashes)
    if pinned > router.settings.max_evict_pinned:
        # checked before the sets are built: their cost is what the limit bounds
        raise Overloaded(f"{len(msg.pinned_keys)} pinned_keys and {len(msg.pinned_engine_hashes)} "
                         f"pinned_engine_hashes exceed limits.max_evict_pinned={router.settings.max_evict_pinned}")
    blocks = msg.blocks or router.blocks_to_free(msg.worker_id, msg.tokens)
    req = EvictRequest(worker_id=msg.worker_id, blocks=blocks, pinned_keys=frozenset(msg.pinned_keys), policy=msg.policy)
    return req, tuple(msg.pinned_engine_hashes)
