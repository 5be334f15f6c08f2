"""``unicache``: task-aware multi-queue eviction (UniCache paper, section 5, Algorithms 1-2).

Every block a worker holds sits in one of four queues, chosen from the request that stored
or last reused it (its ``AccessInfo``: task category, session, offset, decode or prefill):

- *evict-first*: prefill blocks of single-turn untemplated tasks and decode blocks of
  single-turn tasks. Drained before anything else, deepest offset first (Algorithm 1, 5-7).
- *chat* and *agentic* session queues (multi-turn tasks, prefill and decode): score
  ``s = 1 - LogNormalCDF(now - last access)``, the chance the session's next turn has not
  yet come, with the paper's fitted parameters as defaults; optionally refitted online
  from the inter-turn gaps the router observes once ``min_fit_samples`` gaps are seen.
- *structural* (templated single-turn tasks): ``s = 1 - offset / max_offset`` with
  max_offset "the maximum offset among all blocks" (5.2): the deepest block the worker
  holds, of any queue, so structural scores share one scale with the worker's sessions.

Across queues the leaf with the lowest ``G = alpha_q * s`` goes (Algorithm 1, 9-15). The
weights follow Algorithm 2 every ``update_interval_s``: hit efficiency
``E_q = H_q / (C_q + eps)`` (hit blocks since the last update over the queue's share of the
worker's blocks), relative efficiency ``(E_q / (mean E + eps)) ** (1 / T)``, clipping bounds
``[max(0.001, mean - 2 std), min(10, mean + 2 std)]`` of those, then
``alpha_q = clamp(beta * alpha_q + (1 - beta) * E^_q)``. Queues holding no blocks keep their
weight and take no part in the update, and a window without hits changes nothing. A
block reused by a request whose own queue would be evict-first keeps its queue (it has just
proved it is reused).

Unlabelled requests: ``TaskCategory.resolve`` makes them CHAT with a session id, TEMPLATED
(structural queue) without. Ties go to the least recently used block, then the smaller key.
As in every leaf policy, only leaves are evictable and parents follow their children.

Parameters (``UniCacheParams``); the log-normal fits are the paper's (section 6.1), the
weight-update constants are not given in the paper and are ours:
    chat_mu = 4.15, chat_sigma = 0.971         chat inter-turn gap, log-seconds
    agentic_mu = 1.81, agentic_sigma = 1.092   agentic inter-turn gap, log-seconds
    fit_online = False                         refit mu/sigma from observed gaps
    min_fit_samples = 50                       gaps needed before the online fit is used
    ema_beta = 0.9                             beta, EMA smoothing of the weights
    temperature = 1.0                          T, relative-efficiency temperature
    epsilon = 1e-6                             eps, numerical constant
    update_interval_s = 10.0                   seconds between weight updates
    max_sessions = 65536                       sessions whose last turn is remembered (ours)
    max_session_bytes = 16 MiB                 bytes those entries may hold, ids included (ours)

Session ids are client-chosen, so the last-turn map is bounded by count and by bytes
(``SESSION_ENTRY_BYTES`` plus the id's length per entry); past either bound the quarter
remembered longest ago is forgotten (their next turn's gap is not sampled, nothing else).

Scores drift with the clock, but each queue's order does not (deepest offset first in
evict-first and structural, least recent first in the session queues), so the hooks keep
each worker's leaves sorted per queue and ``rank`` peeks at the head of each queue as in
Algorithm 1: O(k log L) for k blocks. A policy that has not seen every hook (built for one
``EvictHint``) scores all L leaves instead, O(L + k log L).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

from ...index.radix import Block, RadixIndex
from ...protocols import TaskCategory
from ..base import AccessInfo, EvictionContext, EvictionPolicyBase
from ._leaves import SortedLeaves, run_steps
from ._release import release_steps

__all__ = ["AGENTIC", "CHAT", "EVICT_FIRST", "STRUCTURAL", "UniCacheEviction", "UniCacheParams", "lognormal_cdf"]

EVICT_FIRST, CHAT, AGENTIC, STRUCTURAL = 0, 1, 2, 3

#: what one remembered session costs besides its id's characters: the dict entry, the str
#: object's header and the float (CPython 3.11, 64-bit)
SESSION_ENTRY_BYTES = 160
WEIGHTED = (CHAT, AGENTIC, STRUCTURAL)


def lognormal_cdf(t: float, mu: float, sigma: float) -> float:
    if t <= 0:
        return 0.0
    return 0.5 * math.erfc(-(math.log(t) - mu) / (sigma * math.sqrt(2.0)))


@dataclass(frozen=True)
class UniCacheParams:
    chat_mu: float = field(default=4.15, metadata={"help": "chat inter-turn gap log-normal mu (log seconds)"})
    chat_sigma: float = field(default=0.971, metadata={"help": "chat inter-turn gap log-normal sigma"})
    agentic_mu: float = field(default=1.81, metadata={"help": "agentic inter-turn gap log-normal mu (log seconds)"})
    agentic_sigma: float = field(default=1.092, metadata={"help": "agentic inter-turn gap log-normal sigma"})
    fit_online: bool = field(default=False, metadata={"help": "refit mu/sigma from the inter-turn gaps observed"})
    min_fit_samples: int = field(default=50, metadata={"help": "gaps needed before an online fit replaces the defaults"})
    ema_beta: float = field(default=0.9, metadata={"help": "beta: EMA smoothing of the queue weights, in (0, 1)"})
    temperature: float = field(default=1.0, metadata={"help": "T: relative hit-efficiency temperature"})
    epsilon: float = field(default=1e-6, metadata={"help": "numerical constant of Algorithm 2"})
    update_interval_s: float = field(default=10.0, metadata={"help": "seconds between queue-weight updates"})
    max_sessions: int = field(default=1 << 16, metadata={"help": "sessions whose last turn time is remembered"})
    max_session_bytes: int = field(
        default=16 << 20, metadata={"help": "bytes the remembered sessions may hold (entry overhead + id length)"}
    )

    def validate(self) -> None:
        for name in ("chat_sigma", "agentic_sigma", "temperature", "epsilon", "update_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.ema_beta < 1:
            raise ValueError(f"ema_beta must be in (0, 1), got {self.ema_beta}")
        if self.max_sessions < 1 or self.max_session_bytes < SESSION_ENTRY_BYTES:
            raise ValueError(f"max_sessions must be >= 1 and max_session_bytes >= {SESSION_ENTRY_BYTES}")
        if self.min_fit_samples < 2:
            raise ValueError(f"min_fit_samples must be >= 2, got {self.min_fit_samples}")


class _GapFit:
    """Welford mean/variance of log inter-turn gaps."""

    __slots__ = ("m2", "mean", "n")

    def __init__(self) -> None:
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, gap: float) -> None:
        x = math.log(gap)
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)


class _SlotState:
    __slots__ = ("alpha", "counts", "hits", "last_update", "max_offset", "offset", "offsets", "queue")

    def __init__(self, now: float) -> None:
        self.queue: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.counts = [0, 0, 0, 0]
        self.hits = [0, 0, 0, 0]
        self.alpha = [1.0, 1.0, 1.0, 1.0]
        self.last_update = now
        self.offsets: dict[int, int] = {}  # offset -> blocks at it, every queue (max_offset, 5.2)
        self.max_offset = 0


class UniCacheEviction(EvictionPolicyBase):
    params: UniCacheParams
    #: ask the router to pass routed requests' metadata with engine Stored events
    wants_request_info = True

    def __init__(self, params: UniCacheParams, rng: random.Random) -> None:
        super().__init__(params, rng)
        self._slots: dict[int, _SlotState] = {}
        self._fits = {CHAT: _GapFit(), AGENTIC: _GapFit()}
        self._session_seen: dict[str, float] = {}
        #: what ``_session_seen`` holds, bytes (SESSION_ENTRY_BYTES + id length per entry)
        self.session_bytes = 0
        self._leaves = SortedLeaves(self._queue_order)

    def _queue_order(self, index: RadixIndex, block: Block, slot: int) -> tuple[int, float, float]:
        """(queue, then the queue's own order): what the hooks keep sorted."""
        s = self._slots.get(slot)
        queue = s.queue.get(block.key) if s is not None else None
        last = index.recency(block, slot)
        if queue is None:
            return (STRUCTURAL, -float(block.depth() - 1), last)
        if queue in (CHAT, AGENTIC):
            return (queue, last, 0.0)
        return (queue, -float(s.offset[block.key]), last)  # type: ignore[union-attr]

    # ---- queue model ---------------------------------------------------------------------
    @staticmethod
    def queue_for(info: AccessInfo, offset: int) -> int:
        try:
            task = TaskCategory(info.task)
        except ValueError:
            task = TaskCategory.UNSPECIFIED
        task = task.resolve(bool(info.session_id))
        if task is TaskCategory.CHAT:
            return CHAT
        if task is TaskCategory.AGENTIC:
            return AGENTIC
        if task is TaskCategory.UNTEMPLATED or offset >= info.decode_from_block:
            return EVICT_FIRST
        return STRUCTURAL

    def gap_model(self, queue: int) -> tuple[float, float]:
        p = self.params
        mu, sigma = (p.chat_mu, p.chat_sigma) if queue == CHAT else (p.agentic_mu, p.agentic_sigma)
        fit = self._fits[queue]
        if p.fit_online and fit.n >= p.min_fit_samples and fit.m2 > 0:
            mu, sigma = fit.mean, math.sqrt(fit.m2 / (fit.n - 1))
        return mu, sigma

    def weights(self, slot: int) -> dict[int, float]:
        s = self._slots.get(slot)
        return {q: (s.alpha[q] if s else 1.0) for q in WEIGHTED}

    def queue_of(self, slot: int, key: int) -> int | None:
        s = self._slots.get(slot)
        return s.queue.get(key) if s else None

    # ---- bookkeeping ---------------------------------------------------------------------
    def _state(self, slot: int, now: float) -> _SlotState:
        s = self._slots.get(slot)
        if s is None:
            s = self._slots[slot] = _SlotState(now)
        return s

    def _place(self, s: _SlotState, key: int, queue: int, offset: int) -> None:
        old = s.queue.get(key)
        if old is not None:
            if old != EVICT_FIRST and queue == EVICT_FIRST:
                return
            if old == queue:
                return
            self._unplace(s, key)
        s.queue[key] = queue
        s.offset[key] = offset
        s.counts[queue] += 1
        s.offsets[offset] = s.offsets.get(offset, 0) + 1
        s.max_offset = max(s.max_offset, offset)

    def _unplace(self, s: _SlotState, key: int) -> None:
        queue = s.queue.pop(key, None)
        if queue is None:
            return
        offset = s.offset.pop(key)
        s.counts[queue] -= 1
        left = s.offsets[offset] - 1
        if left:
            s.offsets[offset] = left
        else:
            del s.offsets[offset]
            if offset == s.max_offset:
                s.max_offset = max(s.offsets, default=0)

    def _session_gap(self, info: AccessInfo, now: float) -> None:
        if not info.session_id:
            return
        seen = self._session_seen
        last = seen.get(info.session_id)
        seen[info.session_id] = now
        if last is None:
            self.session_bytes += SESSION_ENTRY_BYTES + len(info.session_id)
        queue = self.queue_for(info, 0)
        if last is not None and now > last and queue in self._fits:
            self._fits[queue].add(now - last)
        p = self.params
        if len(seen) > p.max_sessions or self.session_bytes > p.max_session_bytes:
            self._forget_oldest_sessions()

    def _forget_oldest_sessions(self) -> None:
        """Drop the first-remembered quarter of the sessions, and more until within both bounds."""
        seen = self._session_seen
        p = self.params
        drop = max(1, len(seen) // 4)
        for sid in list(seen):
            if drop <= 0 and len(seen) <= p.max_sessions and self.session_bytes <= p.max_session_bytes:
                break
            del seen[sid]
            self.session_bytes -= SESSION_ENTRY_BYTES + len(sid)
            drop -= 1

    def update_weights(self, slot: int, now: float) -> None:
        """Algorithm 2 on ``slot``'s queues; hit counts restart from zero."""
        s = self._state(slot, now)
        p = self.params
        total = sum(s.counts)
        active = [q for q in WEIGHTED if s.counts[q] > 0]
        # a window without hits says nothing about efficiency (and would clip every weight to 0)
        if total and active and any(s.hits[q] for q in active):
            eff = {q: s.hits[q] / (s.counts[q] / total + p.epsilon) for q in active}
            mean_e = sum(eff.values()) / len(eff) + p.epsilon
            rel = {q: (e / mean_e) ** (1.0 / p.temperature) for q, e in eff.items()}
            mu = sum(rel.values()) / len(rel)
            sd = math.sqrt(sum((v - mu) ** 2 for v in rel.values()) / len(rel))
            lo, hi = max(0.001, mu - 2 * sd), min(10.0, mu + 2 * sd)
            for q in active:
                raw = p.ema_beta * s.alpha[q] + (1 - p.ema_beta) * rel[q]
                s.alpha[q] = min(max(raw, lo), hi)
        s.hits = [0, 0, 0, 0]
        s.last_update = now

    def _maybe_update(self, s: _SlotState, slot: int, now: float) -> None:
        if now - s.last_update >= self.params.update_interval_s:
            self.update_weights(slot, now)

    # ---- hooks ---------------------------------------------------------------------------
    def on_stored(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        s = self._state(slot, now)
        self._maybe_update(s, slot, now)
        if info.first_offset == 0:
            self._session_gap(info, now)
        for i, b in enumerate(blocks):
            offset = info.first_offset + i
            self._place(s, b.key, self.queue_for(info, offset), offset)
        self._leaves.stored(index, slot, blocks)

    def on_accessed(self, index: RadixIndex, slot: int, blocks: Sequence[Block], info: AccessInfo, now: float) -> None:
        s = self._state(slot, now)
        self._maybe_update(s, slot, now)
        self._session_gap(info, now)
        for i, b in enumerate(blocks):
            queue = s.queue.get(b.key)
            if queue is not None:
                s.hits[queue] += 1
            offset = info.first_offset + i
            self._place(s, b.key, self.queue_for(info, offset), offset)
        self._leaves.accessed(index, slot, blocks)

    def on_removed(self, index: RadixIndex, slot: int, block: Block) -> None:
        self.on_removed_many(index, slot, (block,))

    def on_removed_many(self, index: RadixIndex, slot: int, blocks: Sequence[Block]) -> None:
        self._leaves.removed_many(index, slot, blocks)
        s = self._slots.get(slot)
        if s is not None:
            for b in blocks:
                self._unplace(s, b.key)

    def on_cleared(self, slot: int) -> None:
        self._leaves.cleared(slot)
        self._slots.pop(slot, None)

    def clear_steps(self, slot: int, step: int) -> Iterator[None]:
        s = self._slots.pop(slot, None)
        own = [] if s is None else [s.queue, s.offset, s.offsets]
        return release_steps([*self._leaves.detach(slot), *own], step)

    # ---- ranking -------------------------------------------------------------------------
    def leaf_priority(self, ctx: EvictionContext) -> Callable[[Block], tuple[int, float, float]] | None:
        return self._priority(ctx) if self._leaves.sorted_view(ctx) is None else None

    def rank(self, ctx: EvictionContext, count: int, pinned: frozenset[int]) -> list[Block]:
        return run_steps(self.rank_steps(ctx, count, pinned, None))

    def rank_steps(self, ctx: EvictionContext, count: int, pinned: frozenset[int], step: int | None,
                   ) -> Generator[None, None, list[Block]]:
        priority = self._priority(ctx)
        return self._leaves.rank_steps(ctx, count, pinned, step, priority, lambda order: self._heads(order, priority))

    def _priority(self, ctx: EvictionContext) -> Callable[[Block], tuple[int, float, float]]:
        """Algorithm 1's score of a leaf: evict-first by depth, then weighted queue scores."""
        slot, now, recency = ctx.slot, ctx.now, ctx.index.recency
        s = self._slots.get(slot) or _SlotState(now)
        models = {q: self.gap_model(q) for q in (CHAT, AGENTIC)}
        max_offset = s.max_offset

        def priority(b: Block) -> tuple[int, float, float]:
            last = recency(b, slot)
            queue = s.queue.get(b.key)
            if queue is None:  # never seen by the hooks: an unlabelled, session-less block
                queue, offset = STRUCTURAL, b.depth() - 1
            else:
                offset = s.offset[b.key]
            if queue == EVICT_FIRST:
                return (0, -float(offset), last)
            if queue == STRUCTURAL:
                score = 1.0 - (offset / max_offset if max_offset > 0 else 0.0)
            else:
                mu, sigma = models[queue]
                score = 1.0 - lognormal_cdf(now - last, mu, sigma)
            return (1, s.alpha[queue] * score, last)

        return priority

    @staticmethod
    def _heads(order, priority) -> Iterator[tuple[tuple[int, float, float], int, Block]]:  # type: ignore[no-untyped-def]
        """Algorithm 1 as a stream: all of evict-first in its order, then repeatedly the queue
        head with the lowest weighted score."""
        bounds = [order.bisect_left(((q,),)) for q in (EVICT_FIRST, CHAT, AGENTIC, STRUCTURAL)] + [len(order)]
        for i in range(bounds[0], bounds[1]):
            _, key, block = order[i]
            yield priority(block), key, block
        heap = []
        for q in (CHAT, AGENTIC, STRUCTURAL):
            start, end = bounds[q], bounds[q + 1]
            if start < end:
                _, key, block = order[start]
                heap.append((priority(block), key, start, end))
        heapq.heapify(heap)
        while heap:
            prio, key, i, end = heap[0]
            yield prio, key, order[i][2]
            if i + 1 < end:
                _, nkey, nblock = order[i + 1]
                heapq.heapreplace(heap, (priority(nblock), nkey, i + 1, end))
            else:
                heapq.heappop(heap)
