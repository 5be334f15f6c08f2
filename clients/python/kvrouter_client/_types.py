"""Plain result and event types of the SDK, and their conversion to and from the wire."""

from __future__ import annotations

import enum
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._generated.kvrouter.v1 import router_pb2 as pb
from .keys import le32_array

__all__ = [
    "CacheMode",
    "Cleared",
    "Event",
    "EvictAdvice",
    "Removed",
    "RouteResult",
    "Stored",
    "TaskCategory",
    "WorkerInfo",
    "WorkerState",
]


class TaskCategory(enum.IntEnum):
    """What kind of work a request is (mirrors kvrouter.v1.TaskCategory)."""

    UNSPECIFIED = 0
    CHAT = 1
    AGENTIC = 2
    UNTEMPLATED = 3
    TEMPLATED = 4


class CacheMode(enum.IntEnum):
    """How the router knows a worker's cache (mirrors kvrouter.v1.CacheStateMode)."""

    UNSPECIFIED = 0
    EVENTS = 1
    APPROXIMATE = 2


class WorkerRole(enum.IntEnum):
    """A worker's part in a disaggregated pool (mirrors kvrouter.v1.WorkerRole)."""

    UNSPECIFIED = 0
    BOTH = 1
    PREFILL = 2
    DECODE = 3


class WorkerState(enum.IntEnum):
    UNSPECIFIED = 0
    READY = 1
    DEGRADED = 2
    DRAINING = 3


@dataclass(frozen=True, slots=True)
class RouteResult:
    """Where to send a request. ``fallback`` is True when the router was unreachable and the
    caller's fallback chose the worker; such a result needs no ``complete()``."""

    request_id: str
    worker_id: str
    worker_address: str
    matched_blocks: int = 0
    matched_tokens: int = 0
    prompt_blocks: int = 0
    alternative_worker_id: str = ""
    alternative_worker_address: str = ""
    policy: str = ""
    reason: str = ""
    estimated_ttft_ms: float = 0.0
    fallback: bool = False
    #: a prefill/decode pool's two hops: ``worker_*`` is the decode worker; when
    #: ``disaggregated``, prefill on ``prefill_worker_address`` first, which sends the KV to it
    #: (llm-d's ``x-prefiller-host-port``), else the decode worker prefills itself.
    #: ``disaggregation_reason`` says why ("" = not a P/D pool); the uncached counts are the
    #: prompt tokens each hop computes (the decode hop's: computes or receives)
    disaggregated: bool = False
    disaggregation_reason: str = ""
    prefill_worker_id: str = ""
    prefill_worker_address: str = ""
    prefill_uncached_tokens: int = 0
    decode_uncached_tokens: int = 0

    @classmethod
    def from_pb(cls, msg: pb.RouteResponse) -> RouteResult:
        return cls(
            request_id=msg.request_id,
            worker_id=msg.worker_id,
            worker_address=msg.worker_address,
            matched_blocks=msg.matched_blocks,
            matched_tokens=msg.matched_tokens,
            prompt_blocks=msg.prompt_blocks,
            alternative_worker_id=msg.alternative_worker_id,
            alternative_worker_address=msg.alternative_worker_address,
            policy=msg.policy,
            reason=msg.reason,
            estimated_ttft_ms=msg.estimated_ttft_ms,
            disaggregated=msg.disaggregated,
            disaggregation_reason=msg.disaggregation_reason,
            prefill_worker_id=msg.prefill_worker_id,
            prefill_worker_address=msg.prefill_worker_address,
            prefill_uncached_tokens=msg.prefill_uncached_tokens,
            decode_uncached_tokens=msg.decode_uncached_tokens,
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    id: str
    address: str
    capacity_blocks: int
    block_size: int
    labels: Mapping[str, str]
    state: WorkerState
    mode: CacheMode
    cached_blocks: int
    inflight_requests: int
    pending_prefill_tokens: int
    kv_events_endpoint: str
    #: base models served (empty = any), adapters it can load (empty = any of its models'),
    #: adapters loaded at once (0 = unknown), its role, and the adapters the router believes loaded
    models: tuple[str, ...] = ()
    loras: tuple[str, ...] = ()
    max_loras: int = 0
    role: WorkerRole = WorkerRole.BOTH
    loaded_loras: tuple[str, ...] = ()
    #: KV-event batches applied from it and seconds since the last (0 = none): a decode worker
    #: in events mode with none is one whose cache the P/D bypass check cannot read
    event_batches: int = 0
    last_event_age_s: float = 0.0

    @classmethod
    def from_pb(cls, msg: pb.Worker) -> WorkerInfo:
        return cls(
            id=msg.id,
            address=msg.address,
            capacity_blocks=msg.capacity_blocks,
            block_size=msg.block_size,
            labels=dict(msg.labels),
            state=WorkerState(msg.state),
            mode=CacheMode(msg.mode),
            cached_blocks=msg.cached_blocks,
            inflight_requests=msg.inflight_requests,
            pending_prefill_tokens=msg.pending_prefill_tokens,
            kv_events_endpoint=msg.kv_events_endpoint,
            models=tuple(msg.models),
            loras=tuple(msg.loras),
            max_loras=msg.max_loras,
            role=WorkerRole(msg.role) if msg.role in WorkerRole._value2member_map_ else WorkerRole.UNSPECIFIED,
            loaded_loras=tuple(msg.loaded_loras),
            event_batches=msg.event_batches,
            last_event_age_s=msg.last_event_age_s,
        )


@dataclass(frozen=True, slots=True)
class EvictAdvice:
    """Blocks to evict, in order (leaves first). ``engine_hashes[i]`` is the engine's hash of
    ``keys[i]`` (the key itself when the engine publishes kvrouterd keys)."""

    keys: list[int]
    engine_hashes: list[int]
    exhausted: bool
    policy: str


@dataclass(frozen=True, slots=True)
class Stored:
    """The engine cached a chain of full blocks: ``token_ids`` holds all their tokens.

    ``engine_hashes`` are the engine's ids for the blocks, used in later removals; None means
    the engine uses kvrouterd keys (``kvrouter_client.keys``) as its hashes.
    ``parent_engine_hash`` names the block before the first one (None for a prompt's start).
    ``cache_salt``: the engine's salt for the request that cached them (vLLM/SGLang
    ``cache_salt``); a Route matches them only with the same salt, as the engine does.
    """

    token_ids: Sequence[int]
    engine_hashes: Sequence[int] | None = None
    parent_engine_hash: int | None = None
    model: str = ""
    lora: str = ""
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class Removed:
    """The engine evicted these blocks (engine hashes, or kvrouterd keys)."""

    engine_hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped its whole prefix cache."""


Event = Stored | Removed | Cleared


def packed_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as the wire's ``token_ids_le32`` (little-endian uint32 bytes), which the router
    hashes as they are. Raises ValueError for an id outside [0, 2**32), as the repeated field did."""
    return packed_array(tokens).tobytes()


def packed_array(tokens: Sequence[int]) -> array:
    """``packed_tokens`` as an array whose buffer holds those bytes, without copying them out
    (``tokens`` itself when it is an ``array('I')``: see ``keys.le32_array``)."""
    try:
        return le32_array(tokens)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32)") from None


def event_to_pb(ev: Event, block_size: int) -> pb.CacheEvent:
    if isinstance(ev, Stored):
        msg = pb.StoredBlocks(token_ids_le32=packed_tokens(ev.token_ids), block_size=block_size, model=ev.model,
                              lora=ev.lora, cache_salt=ev.cache_salt)
        if ev.engine_hashes is not None:
            msg.engine_hashes.extend(ev.engine_hashes)
        if ev.parent_engine_hash is not None:
            msg.parent_engine_hash = ev.parent_engine_hash
        return pb.CacheEvent(stored=msg)
    if isinstance(ev, Removed):
        return pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=ev.engine_hashes))
    if isinstance(ev, Cleared):
        return pb.CacheEvent(cleared=pb.AllBlocksCleared())
    raise TypeError(f"not a cache event: {type(ev).__name__}")


def validate_stored(ev: Stored, block_size: int) -> None:
    """Reject what the router would reject, at the call site rather than mid-stream."""
    n = len(ev.token_ids)
    if n == 0 or n % block_size:
        raise ValueError(f"token_ids holds {n} tokens, not a positive multiple of block_size {block_size}")
    if any(not 0 <= t < 2**32 for t in ev.token_ids):
        raise ValueError("token ids must be in [0, 2**32)")
    if ev.engine_hashes is not None:
        if len(ev.engine_hashes) != n // block_size:
            raise ValueError(f"{len(ev.engine_hashes)} engine hashes for {n // block_size} blocks")
        if any(not 0 <= h < 2**64 for h in ev.engine_hashes):
            raise ValueError("engine hashes must be unsigned 64-bit ints")
    if ev.parent_engine_hash is not None and not 0 <= ev.parent_engine_hash < 2**64:
        raise ValueError("parent_engine_hash must be an unsigned 64-bit int")


@dataclass(slots=True)
class PublisherStats:
    """What an EventPublisher has done; all counters only grow."""

    events_recorded: int = 0
    batches_sealed: int = 0
    batches_written: int = 0
    batches_acked: int = 0
    streams: int = 0
    reconnects: int = 0
    overflows: int = 0
    resyncs: int = 0
    events_dropped: int = 0
    rejected: int = 0
    #: resyncs (counted in ``resyncs`` too) sent because the router said its view of this worker
    #: is incomplete, or because it restarted
    resyncs_requested: int = 0
    #: changes of the router's epoch seen (it restarted, or another replica answered)
    router_restarts: int = 0
    #: registrations repeated after a router restart, and empty streams sent to read its epoch
    reregistrations: int = 0
    probes: int = 0
    last_error: str = ""
