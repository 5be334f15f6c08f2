"""T-LRU's trimming state: which blocks lie beyond every owning conversation's TEL-safe
budget, kept so that moving every budget at once costs nothing (``tlru`` module docstring).

Plain synchronous Python, as the rest of ``policies/``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from sortedcontainers import SortedList

from ...index.radix import Block

__all__ = ["NEVER", "Trim", "move", "path_keys", "trimmed_first"]

#: the reach of a key a path holds L or more blocks above its tip (a conversation whose L, from
#: the request, disagrees with its walked path): inside the budget whatever the shift
NEVER = 1 << 62


class Reaches:
    """The reaches of one key held by several paths: how many paths give each, and a max-heap
    of them (lazy: a reach no path gives any more is dropped when it reaches the top)."""

    __slots__ = ("count", "heap")

    def __init__(self, a: int, b: int) -> None:
        self.count: dict[int, int] = {a: 1, b: 1} if a != b else {a: 2}
        self.heap: list[int] = [-max(a, b), -min(a, b)] if a != b else [-a]

    def add(self, reach: int) -> None:
        n = self.count.get(reach, 0)
        self.count[reach] = n + 1
        if not n:
            heapq.heappush(self.heap, -reach)

    def remove(self, reach: int) -> None:
        n = self.count[reach] - 1
        if n:
            self.count[reach] = n
            return
        del self.count[reach]
        heap, count = self.heap, self.count
        while -heap[0] not in count:
            heapq.heappop(heap)
        if len(heap) > 2 * len(count) + 8:  # stale entries below the top: rebuild, amortized O(1)
            self.heap = [-r for r in count]
            heapq.heapify(self.heap)

    def top(self) -> int:
        return -self.heap[0]

    def single(self) -> int | None:
        """The reach if only one path holds the key now."""
        if len(self.count) == 1:
            reach, n = next(iter(self.count.items()))
            if n == 1:
                return reach
        return None


class Trim:
    """Per worker: each key's *reach*, which no budget shift changes.

    Section 4 marks the blocks beyond a conversation's TEL-safe budget ``L + P - xi/alpha``
    "infinitely old". Count a path's blocks from its tip: the one i above it is at depth
    L - i. With ``shift = floor(P - xi/alpha)`` and ``tail = max(0, -shift)`` (footnote 2's
    single parameter, "how many blocks at the end of the conversation history are considered
    safe to evict"), that block is beyond the budget iff i < min(L, tail): for a live
    conversation with L + shift >= 0, L - i > L + shift iff i < -shift; with L + shift < 0 the
    budget is 0, so iff i < L, and L < -shift. An ended conversation's budget is 0: iff i < L.
    So a path gives each of its keys a reach, i (live) or -1 (ended) for i < L and NEVER
    above, and the block is beyond the budget iff reach < tail. A key is trimmed iff some path
    holds it and every path puts it beyond its budget: iff its greatest reach is below
    ``tail``. A shift changes ``tail`` only; no conversation or key is visited."""

    __slots__ = ("contrib", "dirty", "reach", "shared", "tail")

    def __init__(self) -> None:
        #: key -> the greatest reach any remembered path gives it (held by a path iff present)
        self.reach: dict[int, int] = {}
        #: keys held by two or more paths -> all their reaches
        self.shared: dict[int, Reaches] = {}
        #: session -> (its path's keys, tip first; its L; live = not ended) as last counted
        self.contrib: dict[str, tuple[list[int], int, bool]] = {}
        self.dirty: set[str] = set()
        self.tail = 0


def path_keys(tip: Block | None) -> list[int]:
    keys: list[int] = []
    node = tip
    while node is not None:
        keys.append(node.key)
        node = node.parent
    return keys


def move(t: Trim, old: tuple[list[int], int, bool] | None, new: tuple[list[int], int, bool] | None,
          changed: set[int]) -> None:
    """Replace a path's reaches ``old`` by ``new`` (either may be None), adding each key whose
    greatest reach may have changed to ``changed``. O(len(old) + len(new)): O(1) per key one
    path holds, O(log paths) amortized per key several hold (``Reaches``)."""
    ok, ol, olive = old if old is not None else ([], 0, True)
    nk, nl, nlive = new if new is not None else ([], 0, True)
    # the keys at the same distance from the root in both: usually all of the shorter path (a
    # turn extends a path; an eviction moves a tip to its parent). Compared key by key, as
    # the tree may have changed since ``old`` was walked (a block dropped and stored again
    # under another parent)
    common = min(len(ok), len(nk))
    if ok[len(ok) - common:] != nk[len(nk) - common:]:
        j = 0
        while j < common and ok[-1 - j] == nk[-1 - j]:
            j += 1
        common = j
    fresh, gone = len(nk) - common, len(ok) - common
    reach, shared = t.reach, t.shared
    if fresh:  # keys new to this path
        keys = nk[:fresh]
        changed.update(keys)
        for k, r in zip(keys, _reaches(0, fresh, nl, nlive)):
            have = reach.get(k)
            if have is None:
                reach[k] = r
            else:  # held by another path too
                _add_shared(reach, shared, k, have, r)
    if common and (fresh != gone or nl != ol or nlive != olive):  # kept keys: their reach moves
        keys = nk[fresh:]
        changed.update(keys)
        for k, rn, ro in zip(keys, _reaches(fresh, len(nk), nl, nlive), _reaches(gone, len(ok), ol, olive)):
            many = shared.get(k)
            if many is None:
                reach[k] = rn
            elif rn != ro:
                many.add(rn)
                many.remove(ro)
                _settle(reach, shared, k, many)
    if gone:  # keys this path no longer holds
        keys = ok[:gone]
        changed.update(keys)
        for k, r in zip(keys, _reaches(0, gone, ol, olive)):
            many = shared.get(k)
            if many is None:
                del reach[k]
            else:
                many.remove(r)
                _settle(reach, shared, k, many)


def _reaches(start: int, stop: int, length: int, live: bool) -> Iterator[int]:
    """The reaches a path of a conversation with L = ``length`` gives its keys ``start`` to
    ``stop - 1`` above its tip: i if live (-1 if ended) below L, NEVER from L on."""
    cut = min(max(start, length), stop)
    return itertools.chain(range(start, cut) if live else itertools.repeat(-1, cut - start),
                           itertools.repeat(NEVER, stop - cut))


def _add_shared(reach: dict[int, int], shared: dict[int, Reaches], k: int, have: int, r: int) -> None:
    """Another path holds ``k`` too: its greatest reach was ``have``, this path's is ``r``."""
    many = shared.get(k)
    if many is None:
        shared[k] = Reaches(have, r)
    else:
        many.add(r)
    if r > have:
        reach[k] = r


def _settle(reach: dict[int, int], shared: dict[int, Reaches], k: int, many: Reaches) -> None:
    reach[k] = many.top()
    if many.single() is not None:  # one path left: a plain entry again
        del shared[k]


def trimmed_first(order: SortedList, tail: int) -> Iterator[tuple[tuple[int, float], int, Block]]:
    """The leaves ``order``ed by (reach, recency) as ``(trimmed, recency)`` entries, in that
    order. Each run of one reach is in recency order already, so the runs are merged: a few
    (reach -1: ended conversations' tips; 0: live tips; NEVER: no conversation; 1, 2, ...
    only for a leaf whose conversation continues below an uncached block), O(runs x log n)
    to start, O(log runs) per leaf taken."""
    runs: list[Iterator[tuple[tuple[int, float], int, Block]]] = []
    i, n = 0, len(order)
    while i < n:
        reach = order[i][0][0]
        j = order.bisect_left(((reach + 1,),))
        runs.append(_as_trimmed(order.islice(i, j), 0 if reach < tail else 1))
        i = j
    return runs[0] if len(runs) == 1 else heapq.merge(*runs)


def _as_trimmed(run: Iterator[tuple[tuple[int, float], int, Block]], trimmed: int,
                ) -> Iterator[tuple[tuple[int, float], int, Block]]:
    for (_, recency), key, block in run:
        yield (trimmed, recency), key, block
