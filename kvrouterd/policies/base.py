"""The policy protocols: what a routing or eviction policy sees and returns.

Selection is side-effect free: ``RoutingPolicy.select`` reads a ``RoutingContext`` and
returns a ``Decision``; the host (router) commits load and then calls ``on_dispatch``.
Hooks default to doing nothing, as in SGLang's LoadBalancingPolicy. Time and randomness come
in as arguments (``ctx.now``, the ``random.Random`` given at construction) so the simulator
and tests drive policies deterministically.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from types import MappingProxyType
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..index import native
from ..index.radix import Block, MatchResult, RadixIndex
from ..index.workers import Worker
from ..protocols import CandidateScore, Completion, Decision, RouteRequest

__all__ = [
    "CONTEXT_MEMBERS",
    "EXPLAINED_CANDIDATES",
    "NONE_CLAIMED",
    "AccessInfo",
    "EvictionContext",
    "EvictionPolicy",
    "EvictionPolicyBase",
    "NoParams",
    "RoutingContext",
    "RoutingPolicy",
    "RoutingPolicyBase",
    "drop_blocks",
    "fill_routing_context",
]


#: ``RoutingContext.claimed`` when nothing is speculative: one shared, read-only empty map, not
#: a new dict per decision
NONE_CLAIMED: Mapping[int, int] = MappingProxyType({})

#: candidates an explained Decision (a traced one) lists at most (``RoutingContext.explained``);
#: ``Decision.candidate_count`` says how many there were. Listing every one made a traced Route
#: + Complete cost 2.8 ms at 1,024 workers and 0.67 ms at 256 (24 and 22 us untraced), most of
#: it the SDK cleaning span attributes of 1,024 elements each, the rest building their records
EXPLAINED_CANDIDATES = 16
#: the load a listed candidate is ranked by when it holds none of the prompt
_LOAD = attrgetter("pending_prefill_tokens", "inflight_requests")


@dataclass(frozen=True)
class NoParams:
    """For policies without parameters."""

class RoutingContext:
    """One request and the workers it may go to, with their cache overlap and load."""

    __slots__ = ("_overlaps", "block_size", "candidate_slots", "candidates", "claimed", "explain", "index", "match",
                 "now", "request")

    def __init__(
        self,
        request: RouteRequest,
        candidates: Sequence[Worker],
        match: MatchResult,
        block_size: int,
        now: float,
        index: RadixIndex,
        explain: bool = True,
        claimed: Mapping[int, int] | None = None,
        candidate_slots: Any = None,
    ) -> None:
        self.request = request
        #: eligible workers, in registration-slot order (stable across calls)
        self.candidates = candidates
        self.match = match
        self.block_size = block_size
        self.now = now
        #: the global index, read-only for policies
        self.index = index
        #: whether the Decision should list every candidate with its terms (and may leave out
        #: attributes that are only for the record). The host sets it False when nobody will
        #: read them (an unsampled trace): building 64 CandidateScores costs about as much as
        #: the whole rest of a decision. The choice (worker, reason, overlap) must not depend on it.
        self.explain = explain
        self._overlaps = match.overlaps
        #: slot -> blocks at the end of its overlap that are only speculative (``router.speculative``):
        #: the prompt that will store them is still being prefilled, so they show where the prefix
        #: is going (``overlap``) but a request admitted meanwhile computes them again (``uncached_tokens``)
        self.claimed: Mapping[int, int] = claimed or NONE_CLAIMED
        #: the candidates' slots as a native ``CandidateSlots`` (made with them, when membership
        #: last changed), or None: the native candidate scan reads it instead of every worker
        #: (``policies._scan``); it never changes an answer
        self.candidate_slots = candidate_slots

    @property
    def prompt_blocks(self) -> int:
        return len(self.request.keys)

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens

    def overlap(self, worker: Worker) -> int:
        """Leading prompt blocks ``worker`` already holds."""
        return self._overlaps.get(worker.slot, 0)

    def cached_blocks(self, worker: Worker) -> int:
        """Blocks the index holds for ``worker`` (its cache occupancy as the router sees it)."""
        return self.index.count(worker.slot)

    def uncached_tokens(self, worker: Worker) -> int:
        """Prompt tokens ``worker`` would have to prefill (its speculative blocks included)."""
        cached = self._overlaps.get(worker.slot, 0)
        if self.claimed:
            cached -= self.claimed.get(worker.slot, 0)
        return max(0, self.request.prompt_tokens - cached * self.block_size)

    def explained(self, *keep: Worker) -> Sequence[Worker]:
        """The candidates an explained Decision lists, in candidate order: all of them up to
        ``EXPLAINED_CANDIDATES``; past that ``keep`` (the chosen worker), then those holding the
        longest prefixes of the prompt, then the least loaded (pending prefill tokens, then
        requests in flight) of the rest. Reads the walk's entries, not every candidate's."""
        candidates = self.candidates
        if len(candidates) <= EXPLAINED_CANDIDATES:
            return candidates
        listed = {w.slot for w in keep}
        # sorted (stable: ties in walk order) and cut: a third of what heapq.nlargest's Python loop takes
        for slot, _ in sorted(self._overlaps.items(), key=itemgetter(1), reverse=True):
            if len(listed) >= EXPLAINED_CANDIDATES:
                break
            listed.add(slot)
        chosen = [w for w in candidates if w.slot in listed]
        # fewer: fewer workers hold any of the prompt, or the walk's entries name workers that
        # are not candidates (a narrowed context shares the walk)
        room = EXPLAINED_CANDIDATES - len(chosen)
        if room > 0:
            rest = (w for w in candidates if w.slot not in listed)
            listed.update(w.slot for w in heapq.nsmallest(room, rest, key=_LOAD))
            chosen = [w for w in candidates if w.slot in listed]
        return chosen

    def candidate(self, worker: Worker, score: float = 0.0, **terms: float) -> CandidateScore:
        """A CandidateScore for the decision record, with the policy's own terms."""
        return CandidateScore(
            worker_id=worker.id,
            overlap_blocks=self._overlaps.get(worker.slot, 0),
            pending_prefill_tokens=worker.pending_prefill_tokens,
            inflight_requests=worker.inflight_requests,
            score=score,
            terms=terms,
        )


#: ``RoutingContext(request, candidates, match, block_size, now, index, explain, claimed,
#: candidate_slots)`` for the router's own decisions (``Selector.decide``), built natively
#: without ``__init__``: given its members in this order, the last two ``claimed or
#: NONE_CLAIMED`` and ``match.overlaps``, as ``__init__`` stores them, it is the same object
#: (~1 us less a Route of argument binding and stores). None without the extension.
CONTEXT_MEMBERS = ("request", "candidates", "match", "block_size", "now", "index", "explain", "candidate_slots",
                   "claimed", "_overlaps")
fill_routing_context: Callable[..., RoutingContext] | None = (
    native.module.slots_filler(RoutingContext, CONTEXT_MEMBERS) if native.module is not None else None)


@runtime_checkable
class RoutingPolicy(Protocol):
    """Picks one worker among ``ctx.candidates`` (never empty)."""

    name: ClassVar[str]

    def select(self, ctx: RoutingContext) -> Decision: ...

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None: ...

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None: ...

    def on_worker_added(self, worker: Worker) -> None: ...

    def on_worker_removed(self, worker: Worker) -> None: ...

    def tick(self, now: float) -> None: ...


class RoutingPolicyBase:
    """Default no-op hooks; concrete policies subclass this and implement ``select``."""

    name: ClassVar[str] = ""
    #: the context and worker of the last ``decide`` (``dispatched_worker``)
    _last_decided: tuple[RoutingContext | None, Worker | None] = (None, None)

    def __init__(self, params: object, rng: random.Random) -> None:
        self.params = params
        self.rng = rng

    def select(self, ctx: RoutingContext) -> Decision:  # pragma: no cover - protocol
        raise NotImplementedError

    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        return None

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        return None

    def on_worker_added(self, worker: Worker) -> None:
        return None

    def on_worker_removed(self, worker: Worker) -> None:
        return None

    def tick(self, now: float) -> None:
        return None

    def counters(self) -> dict[str, int]:
        """Cumulative counts of the policy's own rules firing (exported as metrics); none by default."""
        return {}

    def decide(self, ctx: RoutingContext, chosen: Worker, reason: str, candidates: list[CandidateScore], **extra: float | str) -> Decision:
        """Build the Decision record for ``chosen``; of ``candidates``, those ``ctx.explained`` lists."""
        if len(candidates) > EXPLAINED_CANDIDATES:
            listed = {w.id for w in ctx.explained(chosen)}
            candidates = [c for c in candidates if c.worker_id in listed]
        self._last_decided = (ctx, chosen)
        return Decision(
            worker_id=chosen.id,
            policy=self.name,
            reason=reason,
            candidates=candidates,
            overlap_blocks=ctx.overlap(chosen),
            attributes=dict(extra),
        )

    def dispatched_worker(self, decision: Decision, ctx: RoutingContext) -> Worker | None:
        """The candidate of ``ctx`` that ``decision`` sends its request to (None: none is): the
        worker this policy's last ``decide`` chose, where that decision was made in ``ctx`` for
        it; any other (a P/D pool's prefill hop, another policy's) is looked up among the
        candidates, a pass that reaches the last of 1,024 workers in ~20 us."""
        decided_in, chosen = self._last_decided
        if decided_in is ctx and chosen is not None and chosen.id == decision.worker_id:
            return chosen
        return next((w for w in ctx.candidates if w.id == decision.worker_id), None)


@dataclass(slots=True, frozen=True)
class AccessInfo:
    """What the router knows about the request that stored or touched blocks."""

    session_id: str = ""
    task: int = 0  # protocols.TaskCategory value
    prompt_tokens: int = 0
    #: first block index (0-based) of the chain the blocks belong to
    first_offset: int = 0
    #: blocks at or beyond this offset hold generated (decode) tokens
    decode_from_block: int = 1 << 62


class EvictionContext:
    """A worker's cached blocks as an eviction policy sees them (read-only)."""

    __slots__ = ("index", "now", "scored", "slot", "worker_id")

    def __init__(self, index: RadixIndex, slot: int, now: float, worker_id: str = "",
                 scored: Iterator[tuple[Any, int, Block]] | None = None) -> None:
        self.index = index
        self.slot = slot
        self.now = now
        self.worker_id = worker_id
        #: the slot's leaves as ``(priority, key, block)`` ascending, scored by the host in steps
        #: with the policy's ``leaf_priority`` (None: a policy scoring every leaf does it itself)
        self.scored = scored

    def leaves(self) -> Iterable[Block]:
        return self.index.leaves(self.slot)

    def recency(self, node: Block) -> float:
        return self.index.recency(node, self.slot)

    def hits(self, node: Block) -> int:
        return self.index.hits(node, self.slot)

    def held(self, node: Block) -> bool:
        return bool(node.holders >> self.slot & 1)


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders a worker's blocks for eviction.

    ``rank`` returns at most ``count`` blocks, never a block in ``pinned`` (kvrouterd keys),
    never a block before a cached descendant of it on that worker; fewer than ``count`` only
    when nothing else is evictable. It does not change the index.

    ``on_accessed`` gets the prefix a routed request reuses, after ``RadixIndex.touch_path``:
    a chain of blocks the slot holds, each the parent of the next, so only the last one can be
    a leaf.

    The hooks get the index the blocks are in: a block's recency and hits are read through it
    (``index.recency(block, slot)``), as the index keeps a reused prefix's pending accesses.

    ``on_removed_many`` (optional) is ``on_removed`` for several blocks at once, called before
    the index drops any of them: the policy must end up exactly as if ``on_removed`` had been
    called for each block in order, the index dropping each block after its call (so a block
    earlier in ``blocks`` counts as no longer held). A policy without it gets ``on_removed``
    per block (``drop_blocks``). One call per engine removal event lets a leaf policy skip
    re-scoring parents that are themselves being removed.
    """

    name: ClassVar[str]

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]: ...

    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None: ...

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None: ...

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None: ...

    def on_cleared(self, slot: int) -> None: ...

    def leaf_priority(self, ctx: EvictionContext) -> Callable[[Block], Any] | None:
        """The priority ``rank`` would score every leaf of ``ctx.slot`` with, lowest evicted
        first, when the policy keeps no order of its own for the slot (built for one hint, it
        saw no hooks); None when it does. A host scores the leaves with it in steps and passes
        them sorted as ``ctx.scored`` (``Router.evict_hint_steps``): scoring 25k leaves in one
        call held the loop 50-300 ms (issue #16)."""
        ...

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        """``on_cleared`` in parts of at most ``step`` entries, yielding between them, for a
        slot nothing reads or changes meanwhile (the router moved its worker off it first):
        a policy's state for a large worker took 10-125 ms to drop at once (issue #16)."""
        ...

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        """``rank`` in parts of about ``step`` entries of work, yielding between them (None: at
        once, the same blocks ``rank`` gives): ranking 1,024 blocks held the loop 4-58 ms
        (issue #16). The host may apply events between parts; the policy keeps reading valid
        state (a copy of its own order, the index as it is then) and never takes a key twice;
        the host drops what the events made wrong to name (``_leaves.still_evictable``)."""
        ...


def drop_blocks(policy: EvictionPolicy, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
    """``slot`` no longer holds ``blocks`` (distinct, each held by it): tell the policy, then the
    index. One ``on_removed_many`` call where the policy has it, else ``on_removed`` per block
    with the index dropping each block after its call, as the hook contract says."""
    many = getattr(policy, "on_removed_many", None)
    if many is not None:
        many(index, slot, blocks)
        for block in blocks:
            index.remove(slot, block.key)
        return
    for block in blocks:
        policy.on_removed(index, slot, block)
        index.remove(slot, block.key)


class EvictionPolicyBase:
    """Default no-op hooks for eviction policies."""

    name: ClassVar[str] = ""

    def __init__(self, params: object, rng: random.Random) -> None:
        self.params = params
        self.rng = rng

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:  # pragma: no cover
        raise NotImplementedError

    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        return None

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        return None

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        return None

    def on_cleared(self, slot: int) -> None:
        return None

    def leaf_priority(self, ctx: EvictionContext) -> Callable[[Block], Any] | None:
        return None

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        """``on_cleared`` at once: a policy that keeps little per slot need not do better."""
        self.on_cleared(slot)
        return iter(())

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        """``rank`` at once: a policy whose ranking is cheap need not do better."""
        return self.rank(ctx, count, pinned)
        yield  # a generator: the host drives every policy's ranking the same way
