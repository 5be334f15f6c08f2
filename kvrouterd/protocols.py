"""The core's vocabulary: what flows from the edges into the router and back out.

Edges (gRPC, ZMQ adapters, the simulator) convert their wire types into these slotted
dataclasses; nothing inside ``index/``, ``policies/`` or ``router/`` sees protobuf or msgpack.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

__all__ = [
    "BatchOutcome",
    "CacheEvent",
    "CacheMode",
    "CandidateScore",
    "Cleared",
    "Completion",
    "Decision",
    "Dispatch",
    "EventBatch",
    "EvictAdvice",
    "EvictRequest",
    "PrefillHop",
    "Removed",
    "RouteRequest",
    "Stored",
    "TaskCategory",
    "WorkerRole",
    "WorkerState",
]


class TaskCategory(enum.IntEnum):
    """Mirrors kvrouter.v1.TaskCategory (same numbers)."""

    UNSPECIFIED = 0
    CHAT = 1
    AGENTIC = 2
    UNTEMPLATED = 3
    TEMPLATED = 4

    def resolve(self, has_session: bool) -> TaskCategory:
        """An unlabelled request is CHAT with a session id, TEMPLATED without (keep its prefix)."""
        if self is TaskCategory.UNSPECIFIED:
            return TaskCategory.CHAT if has_session else TaskCategory.TEMPLATED
        return self


class CacheMode(enum.IntEnum):
    """How the router knows a worker's cache. Mirrors kvrouter.v1.CacheStateMode."""

    EVENTS = 1
    APPROXIMATE = 2


class WorkerRole(enum.IntEnum):
    """What a worker does in a disaggregated pool. Mirrors kvrouter.v1.WorkerRole (same numbers).

    A pool with PREFILL workers routes in two hops (``router.disagg``): a prefill worker
    computes the prompt's KV, a DECODE (or BOTH) worker receives it and generates."""

    BOTH = 1
    PREFILL = 2
    DECODE = 3


class WorkerState(enum.IntEnum):
    """Mirrors kvrouter.v1.WorkerState."""

    READY = 1
    DEGRADED = 2
    DRAINING = 3


@dataclass(slots=True, frozen=True)
class Stored:
    """The engine cached a chain of full blocks.

    ``token_ids`` holds every block's tokens back to back (little-endian uint32 bytes or a
    sequence of ints). ``engine_hashes`` is the engine's id for each block; None means the
    publisher uses kvrouterd keys as its hashes (our SDK does), so no mapping is kept.
    """

    token_ids: bytes | tuple[int, ...]
    engine_hashes: tuple[int, ...] | None
    parent_engine_hash: int | None = None
    block_size: int = 0
    model: str = ""
    lora: str = ""
    #: hybrid KV-cache group that stored the blocks (vLLM ``group_idx``; None = one group)
    group: int | None = None
    #: the group's cache kind (vLLM ``kv_cache_spec_kind``), e.g. "full_attention"
    group_kind: str | None = None
    #: the engine's cache salt (SGLang ``cache_salt``): salts the keys like model and lora
    salt: str = ""
    #: per engine block, a hash of the block's extra keys (vLLM ``extra_keys``: multimodal
    #: content hashes, ...; 0 = none), folded into that block's key (``index.keys``)
    extra_hashes: tuple[int, ...] | None = None


@dataclass(slots=True, frozen=True)
class Removed:
    """The engine evicted these blocks (engine hashes, or kvrouterd keys for our SDK)."""

    engine_hashes: tuple[int, ...]
    #: the hybrid KV-cache group that evicted them (None = the whole engine)
    group: int | None = None


@dataclass(slots=True, frozen=True)
class Cleared:
    """The engine dropped its whole prefix cache."""


CacheEvent = Union[Stored, Removed, Cleared]


@dataclass(slots=True, frozen=True)
class EventBatch:
    """Events from one worker, numbered by the publisher (+1 per batch, 0 after a restart)."""

    worker_id: str
    sequence: int
    events: tuple[CacheEvent, ...]


@dataclass(slots=True)
class BatchOutcome:
    """What applying a batch did; the host turns it into metrics, logs and a span."""

    applied: bool
    duplicate: bool = False
    gap: int = 0  # batches missing before this one (0 = in order)
    restarted: bool = False
    blocks_stored: int = 0
    blocks_removed: int = 0
    orphan_blocks: int = 0  # stored blocks whose parent the router never saw
    unknown_removals: int = 0
    #: events that could not be applied, by reason (the rest of the batch still was)
    rejected: dict[str, int] = field(default_factory=dict)
    #: a rejected event may have been a removal: the worker's view may hold stale blocks
    lost_removal: bool = False


@dataclass(slots=True)
class RouteRequest:
    """One request to place. ``keys`` are the prompt's full-block keys (see index.keys): a list,
    or an ``array('Q')`` as Route computes them."""

    request_id: str
    keys: Sequence[int]
    prompt_tokens: int
    session_id: str = ""
    task: TaskCategory = TaskCategory.UNSPECIFIED
    ttft_slo_ms: float = 0.0
    expected_output_tokens: int = 0
    policy: str = ""
    candidate_workers: tuple[str, ...] = ()
    model: str = ""
    #: the LoRA adapter the request runs with ("" = the base model)
    lora: str = ""
    #: who sent it, as the host names its callers (the daemon: the gRPC peer, one client
    #: connection); requests in flight are bounded per client (``limits.max_inflight_per_client``).
    #: "" = not bounded by client (the simulator, in-process callers)
    client: str = ""


@dataclass(slots=True)
class CandidateScore:
    """One worker as a policy saw it. ``terms`` holds the policy's own cost terms."""

    worker_id: str
    overlap_blocks: int
    pending_prefill_tokens: int
    inflight_requests: int
    score: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class PrefillHop:
    """The prefill hop of a disaggregated decision: the prefill worker the policy chose among
    the pool's prefill workers, what it holds of the prompt and what it must compute."""

    worker_id: str
    overlap_blocks: int
    uncached_tokens: int
    #: the policy's rule for this hop, and every prefill candidate it saw (explain only)
    reason: str = ""
    candidates: list[CandidateScore] = field(default_factory=list)


@dataclass(slots=True)
class Decision:
    """A routing decision as data: telemetry and the host read it, policies produce it."""

    worker_id: str
    policy: str
    reason: str
    candidates: list[CandidateScore]
    overlap_blocks: int = 0
    alternative_worker_id: str = ""
    estimated_ttft_ms: float = 0.0
    attributes: dict[str, float | int | str] = field(default_factory=dict)
    #: the model pool the request was placed in: the declared model it asked for ("" = the
    #: whole fleet: no model asked, or no worker declares models); set by the router, not policies
    pool: str = ""
    #: for a LoRA request, how its adapter stood on the chosen worker: "loaded", "free_slot"
    #: (it loads it into a free slot) or "swap" (it evicts another adapter); "" otherwise
    lora_placement: str = ""
    #: in a prefill/decode pool (``router.disagg``): the prefill hop, None when the decode
    #: worker prefills locally; ``pd_reason`` why ("" = not a P/D pool); the decode worker's
    #: prompt tokens not cached there (what it computes locally or receives by KV transfer)
    prefill: PrefillHop | None = None
    pd_reason: str = ""
    decode_uncached_tokens: int = 0
    #: how many workers the policy chose among; ``candidates`` lists at most
    #: ``policies.base.EXPLAINED_CANDIDATES`` of them (0 = as many as it lists; set by the router)
    candidate_count: int = 0


@dataclass(slots=True, frozen=True)
class Completion:
    """What the caller observed for a routed request."""

    request_id: str
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    cached_tokens: int = -1
    output_tokens: int = 0
    success: bool = True
    #: the caller says the request's conversation is over (no next turn will come)
    session_ended: bool = False
    #: a disaggregated request's prefill hop: its time on the prefill worker and the KV
    #: transfer's to the decode worker, ms (0 = not measured)
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0
    #: only the prefill hop finished (its KV reached the decode worker): release the prefill
    #: worker now; the request's own Complete follows
    prefill_done: bool = False


@dataclass(slots=True, frozen=True)
class Dispatch:
    """A routing decision another router replica committed (replica sync on the event bus).

    ``keys`` / ``evicted`` are set for approximate-mode workers: the routed prompt's block
    keys the worker is now assumed to cache, and the blocks the routing replica's eviction
    dropped from its model of that worker. With speculative indexing on, ``keys`` is set for an
    events-mode worker too: the receiver claims them until the engine's Stored confirms them. ``age_s``: how long ago it was committed, so every
    replica expires a lost request at about the same time."""

    request_id: str
    worker_id: str
    prefill_tokens: int
    prompt_tokens: int
    overlap_blocks: int = 0
    policy: str = ""
    keys: Sequence[int] = ()
    evicted: Sequence[int] = ()
    session_id: str = ""
    task: TaskCategory = TaskCategory.UNSPECIFIED
    age_s: float = 0.0


@dataclass(slots=True, frozen=True)
class EvictRequest:
    """How many blocks a worker wants to free, and which it cannot drop right now."""

    worker_id: str
    blocks: int
    pinned_keys: frozenset[int] = frozenset()
    policy: str = ""


@dataclass(slots=True)
class EvictAdvice:
    """Blocks to evict in order (leaves before ancestors) with the engine's hash for each."""

    keys: list[int]
    engine_hashes: list[int]
    exhausted: bool
    policy: str
