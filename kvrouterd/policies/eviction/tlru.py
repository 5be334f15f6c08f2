"""``tlru``: Tail-Optimized LRU (T-LRU paper, sections 1 and 4).

TTFT is roughly linear in uncached blocks (``alpha`` ms each), so a conversation whose next
turn will need at most ``xi / alpha`` uncached blocks meets the latency threshold ``xi``
anyway. For a conversation with history length L (blocks) whose next prompt is expected to
add P blocks, caching more than its *TEL-safe budget*

    budget = L + P - xi / alpha

blocks cannot lower its Tail Excess Latency, so the blocks beyond the budget (the tail end
of its history, depth > budget) are evicted first, as if "infinitely old"; when more space is
needed, plain leaf LRU follows (``lru``). A block also inside another conversation's budget
(a shared prefix) is not trimmed. Leaves only, parents after their children, as in every
leaf policy; trimmed blocks among themselves and the rest go least recently used first.

Conversations are the requests' session ids (requests without one are plain LRU blocks).
L is the length of the conversation's latest request on the worker. P is
``next_prompt_blocks`` if set, else the running mean of how much a conversation's prompt
grew from one turn to the next (the previous answer plus the new user message), 0 before
any follow-up turn is seen. End-aware T-LRU: ``end_session(id)`` tells the policy a
conversation will not return; its budget becomes 0 and all its blocks are trimmed first.

Parameters (``TLRUParams``), thresholds from the paper's evaluation:
    latency_threshold_ms  = 200.0   xi, the TTFT threshold (the paper sweeps 50-500 ms)
    prefill_ms_per_block  = 1.6     alpha, prefill time per uncached block; the paper fits it
                                    per model and GPU (not a paper value: ~0.1 ms/token on
                                    an A100 for a 7B model, 16-token blocks)
    next_prompt_blocks    = -1.0    P; negative = running mean of observed prompt growth
    max_sessions          = 65536   conversations remembered, all workers together (ours)
    max_session_bytes     = 64 MiB  bytes they may hold: ids, bookkeeping and the keys of
                                    each one's latest path, ~1.6M path blocks (ours)

Session ids are client-chosen, so the conversations remembered are bounded in count and in
bytes (``session_bytes``: ``CONVERSATION_BYTES`` + id length + ``PATH_BLOCK_BYTES`` per block
of its latest path, which the trimming lists hold). Past either bound the least recently
active are forgotten until within both (a new turn makes a conversation the most recent);
a forgotten conversation's blocks rank as plain LRU blocks until it returns.

P - xi/alpha moves every budget at once, and P (the running mean) moves with every turn.
So the trimming state does not depend on it (section 1, footnote 2: P and xi/alpha act as
one parameter, how many blocks at the end of a history are safe to evict): each key keeps
its *reach*, the greatest distance from a remembered conversation's tip at which a path
holds it (``_reach.Trim``), and is trimmed iff that is below ``tail = max(0, -floor(P -
xi/alpha))``. The hooks keep the leaves sorted by (reach, least recent first); ``rank``
merges the few runs of equal reach as (trimmed first, least recent first). A call costs
O(k log L) for k blocks, plus the path of each conversation whose latest request changed
since the last call; a budget shift costs O(1) (moving every conversation's split instead
held the routing loop 0.56 s at 65,536 conversations of 20 blocks, walking every path 1.8 s
at 1.2M path blocks).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from ...index.radix import Block, RadixIndex
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from . import _reach
from ._leaves import SortedLeaves, run_steps
from ._reach import NEVER, Trim
from ._release import release_steps

__all__ = ["CONVERSATION_BYTES", "MAX_TAIL_BLOCKS", "PATH_BLOCK_BYTES", "TLRUEviction", "TLRUParams", "trim_tail"]

#: changed conversations a hook lets wait before it folds them into the blocks' reach: a
#: hook pays at most this many paths at once, an EvictHint at most this many too
ABSORB_BATCH = 64
#: what one remembered conversation costs besides its id's characters and its path: the
#: _Conversation, its dict, tip-set, order and trim entries (CPython 3.11, 64-bit; an estimate)
CONVERSATION_BYTES = 400
#: per block of a conversation's latest path: its key in a trimming list (a pointer and an int)
PATH_BLOCK_BYTES = 40
#: the most blocks at the end of a history ``trim_tail`` calls safe to evict: more than any
#: conversation holds, so the bound never changes a ranking, only keeps the number an int
MAX_TAIL_BLOCKS = 1 << 40


def trim_tail(next_prompt_blocks: float, latency_threshold_ms: float, prefill_ms_per_block: float) -> int:
    """How many blocks at the end of each history lie beyond its TEL-safe budget,
    ``max(0, -floor(P - xi/alpha))`` (section 1, footnote 2), as an int in [0, MAX_TAIL_BLOCKS]
    whatever the floats: a tiny alpha makes xi/alpha infinite, and ``floor`` of that raises."""
    excess = next_prompt_blocks - latency_threshold_ms / prefill_ms_per_block if prefill_ms_per_block > 0 else -math.inf
    if math.isnan(excess):
        return 0
    return max(0, -math.floor(min(max(excess, -MAX_TAIL_BLOCKS), 0.0)))


@dataclass(frozen=True)
class TLRUParams:
    latency_threshold_ms: float = field(default=200.0, metadata={"help": "xi: TTFT threshold (ms) of the TEL objective"})
    prefill_ms_per_block: float = field(default=1.6, metadata={"help": "alpha: prefill time per uncached block (ms)"})
    next_prompt_blocks: float = field(default=-1.0, metadata={
        "help": "expected blocks the next turn adds; negative = running mean of observed growth"})
    max_sessions: int = field(default=1 << 16, metadata={"help": "conversations remembered, all workers together"})
    max_session_bytes: int = field(default=64 << 20, metadata={
        "help": "bytes the remembered conversations may hold (ids, bookkeeping, their latest paths' keys)"})

    def validate(self) -> None:
        if self.max_sessions < 1 or self.max_session_bytes < CONVERSATION_BYTES:
            raise ValueError(f"max_sessions must be >= 1 and max_session_bytes >= {CONVERSATION_BYTES}")
        if not 0 <= self.latency_threshold_ms < math.inf:
            raise ValueError(f"latency_threshold_ms must be a finite number >= 0, got {self.latency_threshold_ms}")
        if not 0 < self.prefill_ms_per_block < math.inf:
            raise ValueError(f"prefill_ms_per_block must be a finite number > 0, got {self.prefill_ms_per_block}")
        if not math.isfinite(self.next_prompt_blocks):
            raise ValueError(f"next_prompt_blocks must be a finite number, got {self.next_prompt_blocks}")


class _Conversation:
    __slots__ = ("delta", "ended", "length", "prev_length", "tip", "turn_now")

    def __init__(self) -> None:
        self.tip: Block | None = None
        self.length = 0  # blocks in the latest request's path
        self.turn_now = float("-inf")
        self.prev_length = -1  # length of the previous turn (-1: none yet)
        self.delta = 0  # this turn's contribution to the prompt-growth mean
        self.ended = False


class TLRUEviction(EvictionPolicyBase):
    params: TLRUParams
    #: ask the router to pass routed requests' metadata with engine Stored events
    wants_request_info = True

    def __init__(self, params: TLRUParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self._convs: dict[int, dict[str, _Conversation]] = {}
        #: slot -> tip key -> sessions whose latest request ends there (for on_removed)
        self._tips: dict[int, dict[int, set[str]]] = {}
        self._growth_sum = 0
        self._growth_n = 0
        #: (slot, session) of every remembered conversation, least recently active first
        self._recent: OrderedDict[tuple[int, str], None] = OrderedDict()
        #: what the remembered conversations hold, bytes (see the module docstring)
        self.session_bytes = 0
        # Trimming state, kept incrementally: a conversation's path is walked again only when
        # its tip moves or it ends; a budget shift (P - xi/alpha crossing an integer) changes
        # one number per worker (_reach.Trim).
        self._trim: dict[int, Trim] = {}
        # leaves sorted by (reach, last access), which no shift changes; rank reads them as
        # (trimmed, last access) by merging the runs of equal reach (_reach.trimmed_first)
        self._leaves = SortedLeaves(self._by_reach)

    def _by_reach(self, index: RadixIndex, block: Block, slot: int) -> tuple[int, float]:
        t = self._trim.get(slot)
        return (NEVER if t is None else t.reach.get(block.key, NEVER), index.recency(block, slot))

    def _order(self, index: RadixIndex, block: Block, slot: int) -> tuple[int, float]:
        """The eviction priority: trimmed (0) before the rest (1), least recent first."""
        t = self._trim.get(slot)
        trimmed = t is not None and t.reach.get(block.key, NEVER) < t.tail
        return (0 if trimmed else 1, index.recency(block, slot))

    # ---- what the policy believes --------------------------------------------------------
    def next_prompt_estimate(self) -> float:
        if self.params.next_prompt_blocks >= 0:
            return self.params.next_prompt_blocks
        return self._growth_sum / self._growth_n if self._growth_n else 0.0

    def budget(self, slot: int, session_id: str) -> float:
        """The TEL-safe budget (blocks) of a conversation on ``slot``."""
        conv = self._convs.get(slot, {}).get(session_id)
        if conv is None:
            return 0.0
        if conv.ended:
            return 0.0
        p = self.params
        return max(0.0, conv.length + self.next_prompt_estimate() - p.latency_threshold_ms / p.prefill_ms_per_block)

    def end_session(self, session_id: str) -> None:
        """End-aware T-LRU: this conversation will not come back."""
        for slot, convs in self._convs.items():
            conv = convs.get(session_id)
            if conv is not None:
                conv.ended = True
                self._trim_state(slot).dirty.add(session_id)

    # ---- hooks ---------------------------------------------------------------------------
    def _observe(self, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        if not info.session_id or not blocks:
            return
        sid = info.session_id
        convs = self._convs.setdefault(slot, {})
        conv = convs.get(sid)
        if conv is None:
            conv = convs[sid] = _Conversation()
            self.session_bytes += CONVERSATION_BYTES + len(sid)
        depth = info.first_offset + len(blocks)
        if now > conv.turn_now:  # a new turn
            self._recent[(slot, sid)] = None
            self._recent.move_to_end((slot, sid))  # the most recently active now
            if conv.tip is not None:
                conv.prev_length = conv.length
                self._growth_n += 1
            self._set_tip(slot, info.session_id, conv, None, 0)
            conv.turn_now, conv.delta = now, 0
            conv.ended = False
        if depth >= conv.length:
            self._set_tip(slot, info.session_id, conv, blocks[-1], depth)
        if conv.prev_length >= 0:
            delta = max(0, conv.length - conv.prev_length)
            self._growth_sum += delta - conv.delta
            conv.delta = delta
        p = self.params
        if len(self._recent) > p.max_sessions or self.session_bytes > p.max_session_bytes:
            self._forget_least_recent(keep=(slot, sid))

    def _forget_least_recent(self, keep: tuple[int, str]) -> None:
        """Forget the least recently active conversations until within both bounds; never
        ``keep`` (the one being observed). Only as many as that: each forgotten path is
        released at the next ranking, so forgetting a quarter at once (16,384 paths at the
        default bound) held that call for as long as a budget shift did."""
        p = self.params
        recent = self._recent
        while len(recent) > p.max_sessions or self.session_bytes > p.max_session_bytes:
            oldest = next(iter(recent))
            if oldest == keep:
                if len(recent) == 1:
                    return
                oldest = next(itertools.islice(recent, 1, None))
            self._forget(*oldest)

    def _forget(self, slot: int, sid: str) -> None:
        convs = self._convs[slot]
        # untipped: its trimming contribution goes at the next ranking (_refresh of a dirty,
        # unknown session), and its path's bytes are released
        self._set_tip(slot, sid, convs[sid], None, 0)
        del convs[sid]
        del self._recent[(slot, sid)]
        self.session_bytes -= CONVERSATION_BYTES + len(sid)

    def _set_tip(self, slot: int, sid: str, conv: _Conversation, tip: Block | None, length: int) -> None:
        tips = self._tips.setdefault(slot, {})
        if conv.tip is not None:
            owners = tips.get(conv.tip.key)
            if owners is not None:
                owners.discard(sid)
                if not owners:
                    del tips[conv.tip.key]
        self.session_bytes += PATH_BLOCK_BYTES * (length - conv.length)
        conv.tip, conv.length = tip, length
        self._trim_state(slot).dirty.add(sid)
        if tip is not None:
            tips.setdefault(tip.key, set()).add(sid)

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._observe(slot, blocks, info, now)
        self._leaves.accessed(index, slot, blocks)
        self._absorb_some(index, slot)

    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        self._observe(slot, blocks, info, now)
        self._leaves.stored(index, slot, blocks)
        self._absorb_some(index, slot)

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        self.on_removed_many(index, slot, (block,))

    def on_removed_many(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        self._leaves.removed_many(index, slot, blocks)
        tips = self._tips.get(slot)
        if tips:
            gone: set[int] = set()  # removed before the block at hand: no longer held by then
            for b in blocks:
                if b.key in tips:
                    self._tip_removed(slot, b, gone)
                gone.add(b.key)
            self._absorb_some(index, slot)  # tips moved: those conversations changed

    def _tip_removed(self, slot: int, block: Block, gone: AbstractSet[int]) -> None:
        """Conversations ending at ``block`` now end at its parent, or are gone with it."""
        owners = self._tips.get(slot, {}).get(block.key)
        if not owners:
            return
        convs = self._convs[slot]
        parent = block.parent
        held_parent = parent is not None and bool(parent.holders >> slot & 1) and parent.key not in gone
        for sid in sorted(owners):
            conv = convs[sid]
            if held_parent:
                self._set_tip(slot, sid, conv, parent, conv.length - 1)
            else:  # nothing of it is cached on this worker any more
                self._forget(slot, sid)

    def on_cleared(self, slot: int) -> None:
        for sid, conv in self._convs.pop(slot, {}).items():
            self.session_bytes -= CONVERSATION_BYTES + len(sid) + PATH_BLOCK_BYTES * conv.length
            del self._recent[(slot, sid)]
        self._tips.pop(slot, None)
        self._trim.pop(slot, None)
        self._leaves.cleared(slot)

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        """``on_cleared`` in parts: the slot's conversations are forgotten ``step`` at a time
        (65,536 at once held the loop ~125 ms), then its trimming state is released."""
        trim = self._trim.pop(slot, None)
        detached = [*self._leaves.detach(slot), self._tips.pop(slot, {})]
        if trim is not None:
            detached += [trim.reach, trim.shared, trim.contrib]
        convs = self._convs.get(slot, {})
        sids = list(convs)
        for start in range(0, len(sids), step):
            for sid in sids[start : start + step]:
                conv = convs.pop(sid, None)
                if conv is not None:  # else forgotten meanwhile (the conversation bound)
                    self.session_bytes -= CONVERSATION_BYTES + len(sid) + PATH_BLOCK_BYTES * conv.length
                    del self._recent[(slot, sid)]
            yield
        self.on_cleared(slot)  # what forgetting one meanwhile made again: a little
        yield from release_steps(detached, step)

    # ---- ranking -------------------------------------------------------------------------
    def _trim_state(self, slot: int) -> Trim:
        t = self._trim.get(slot)
        if t is None:
            t = self._trim[slot] = Trim()
        return t

    def _refresh(self, slot: int, ctx: EvictionContext) -> Trim:
        t = self._trim_state(slot)
        p = self.params
        # budget = L + P - xi/alpha and depths are integers, so "depth > budget" only depends
        # on L + floor(P - xi/alpha) (see Trim): a shift is this one assignment
        t.tail = trim_tail(self.next_prompt_estimate(), p.latency_threshold_ms, p.prefill_ms_per_block)
        if t.dirty:
            self._absorb(ctx.index, slot, t)
        return t

    def _absorb(self, index: RadixIndex, slot: int, t: Trim) -> None:
        """Fold the conversations whose path changed into the blocks' reach: O(their paths)."""
        convs = self._convs.get(slot, {})
        changed: set[int] = set()
        for sid in t.dirty:
            conv = convs.get(sid)
            new = None if conv is None else (_reach.path_keys(conv.tip), conv.length, not conv.ended)
            old = t.contrib.pop(sid, None)
            if new is not None:
                t.contrib[sid] = new
            _reach.move(t, old, new, changed)
        t.dirty.clear()
        self._leaves.rescore(index, slot, changed)

    def _absorb_some(self, index: RadixIndex, slot: int) -> None:
        """Absorb the changed conversations once ABSORB_BATCH of them wait, so the hooks that
        change them pay for them as they go: left to the next EvictHint, 65,536 new
        conversations took that one call ~1.5 s on the loop (issue #16 item 1). Absorbing
        earlier yields the same reach (it is a function of the paths alone), so the same order."""
        t = self._trim.get(slot)
        if t is not None and len(t.dirty) >= ABSORB_BATCH:
            self._absorb(index, slot, t)

    def trimmable(self, ctx: EvictionContext) -> set[int]:
        """Keys held by the worker beyond every owning conversation's TEL-safe budget."""
        t = self._refresh(ctx.slot, ctx)
        holds = ctx.index.holds
        return {k for k, reach in t.reach.items() if reach < t.tail and holds(ctx.slot, k)}

    def _priority(self, ctx: EvictionContext) -> Callable[[Block], tuple[int, float]]:
        index, slot = ctx.index, ctx.slot

        def priority(b: Block) -> tuple[int, float]:
            return self._order(index, b, slot)

        return priority

    def leaf_priority(self, ctx: EvictionContext) -> Callable[[Block], tuple[int, float]] | None:
        if self._leaves.sorted_view(ctx) is not None:
            return None
        self._refresh(ctx.slot, ctx)  # the trimming the scores read, as rank brings it up to date
        return self._priority(ctx)

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return run_steps(self.rank_steps(ctx, count, pinned, None))

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        t = self._refresh(ctx.slot, ctx)
        # the tail as of the ranking's start: a copy's trimming runs are split by it
        return self._leaves.rank_steps(ctx, count, pinned, step, self._priority(ctx),
                                       lambda order: _reach.trimmed_first(order, t.tail))
