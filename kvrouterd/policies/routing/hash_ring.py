"""DualMap's dual consistent-hash ring (DualMap sections 3.2 and 3.4, appendix A.1.3).

Two rings span the 64-bit space. Each worker is placed on each ring at ``virtual_nodes``
positions ``xxh3_64("<worker id>#<v>", seed_r)``; a key is hashed onto ring ``r`` with the
same seed and takes the nearest worker clockwise (the first position >= the key's, wrapping).
The two seeds make the two hash functions ``f1``, ``f2`` independent.

If both rings give the same worker, the second candidate becomes the next *distinct* worker
clockwise on ring 2 from the key's position: Eq. 5 (``id2 = (id1 + 1) mod n``) restated for a
ring, so that it too moves only locally when membership changes.

The pair depends only on the key and the set of worker ids, never on arrival order or on
state, so independent router replicas with the same workers compute the same pair without
sharing anything. Adding or removing one of ``n`` workers changes a ring's mapping only for
keys falling in that worker's arcs: about ``1/n`` of keys per ring.

Candidate filtering (draining workers, a request's ``candidate_workers``) walks on past
workers that are not allowed, which is exactly the mapping of a ring built without them.

A ring is two flat lists in ring order, points and their workers, which lookups bisect. A
worker's points are hashed when it comes; the workers that came or went since the last lookup go
into the lists at the next one. A few are merged in one pass, each changed point found by
bisection and the runs between them copied as slices (~3-8 ms for one change at 1,024 workers on
a slow machine); many (a fleet registered at once) are sorted in with every point, as ints by
their place (~110 ms a ring at 1,024 workers). Sorting every point again on each change made a
fleet's registration quadratic: 1,024 workers took 100 s of the event loop, and one removal
among them 0.2 s. A ``SortedList`` of (point, worker) pairs after that made the flat copy again
after every change, reading all 131k pairs: ~45 ms a ring at 1,024 workers on the first Route
after each change, 54-71 s of the loop for a fleet registering one by one while it routes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from itertools import repeat

import xxhash

__all__ = ["RING_SEEDS", "DualHashRing"]

#: Seeds of f1 and f2 ("dualmap1", "dualmap2" read as big-endian integers).
RING_SEEDS = (0x6475616C6D617031, 0x6475616C6D617032)

_xxh3 = xxhash.xxh3_64_intdigest

#: changed points per point kept past which a ring's lists are sorted whole rather than merged:
#: a merge's bisection and appends per changed point cost ~8 of a whole sort's per point
_WHOLE_SORT = 8


def key_bytes(key: int) -> bytes:
    return (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")


class _Ring:
    __slots__ = ("_adding", "_dropping", "_members", "_owners", "_placed", "_points", "seed", "virtual_nodes")

    def __init__(self, seed: int, virtual_nodes: int) -> None:
        self.seed = seed
        self.virtual_nodes = virtual_nodes
        #: every worker's points in ring order, and the worker at each: ties between two
        #: workers' points are broken by id, so every replica agrees
        self._points: list[int] = []
        self._owners: list[str] = []
        #: the points of each worker in the lists
        self._placed: dict[str, list[int]] = {}
        #: workers added (with their points, hashed at the change) and removed since the lists
        #: were last brought up to date (``_merge``)
        self._adding: dict[str, list[int]] = {}
        self._dropping: set[str] = set()
        self._members: set[str] = set()

    def positions(self, worker_id: str) -> list[int]:
        encoded = worker_id.encode()
        return [_xxh3(encoded + b"#" + str(v).encode(), self.seed) for v in range(self.virtual_nodes)]

    def add(self, worker_id: str) -> None:
        if worker_id in self._members:
            return
        self._members.add(worker_id)
        if worker_id in self._dropping:  # its points are still in the lists
            self._dropping.discard(worker_id)
        else:
            self._adding[worker_id] = self.positions(worker_id)

    def remove(self, worker_id: str) -> None:
        if worker_id not in self._members:
            return
        self._members.discard(worker_id)
        if worker_id in self._adding:  # its points never went in
            del self._adding[worker_id]
        else:
            self._dropping.add(worker_id)

    def _merge(self) -> None:
        """The changes since the last lookup, applied in one pass: each changed point found by
        bisection, the runs between them copied as slices; many changes, a sort of every point."""
        adding, dropping, placed = self._adding, self._dropping, self._placed
        if not adding and not dropping:
            return
        points, owners = self._points, self._owners
        if (len(adding) + len(dropping)) * self.virtual_nodes * _WHOLE_SORT > len(points):
            # many changes (a fleet registering at once): every point sorted whole, as ints by
            # their place (the sort is stable: a shared point's workers stay in the id order
            # they are listed in), where sorting (point, worker) pairs took ~4x as long
            for w in dropping:
                del placed[w]
            placed.update(adding)
            every: list[int] = []
            by: list[str] = []
            for w in sorted(placed):
                every += placed[w]
                by += repeat(w, len(placed[w]))
            order = sorted(range(len(every)), key=every.__getitem__)
            self._points, self._owners = list(map(every.__getitem__, order)), list(map(by.__getitem__, order))
            adding.clear()
            dropping.clear()
            return
        # (point, worker, whether it goes in), in the lists' order: a worker is never both
        edits = sorted([(p, w, True) for w, added in adding.items() for p in added]
                       + [(p, w, False) for w in dropping for p in placed.pop(w)])
        kept_points: list[int] = []
        kept_owners: list[str] = []
        done = 0
        for p, worker_id, goes_in in edits:
            at = bisect_left(points, p, done)
            if goes_in:
                while at < len(points) and points[at] == p and owners[at] < worker_id:
                    at += 1  # a shared point: after the workers whose ids sort first
            else:
                while owners[at] != worker_id:  # a shared point: the worker's own is further on
                    at += 1
            kept_points += points[done:at]
            kept_owners += owners[done:at]
            if goes_in:
                kept_points.append(p)
                kept_owners.append(worker_id)
                done = at
            else:
                done = at + 1
        kept_points += points[done:]
        kept_owners += owners[done:]
        self._points, self._owners = kept_points, kept_owners
        placed.update(adding)
        adding.clear()
        dropping.clear()

    def walk(self, position: int) -> Iterable[str]:
        """Owners clockwise from ``position`` (first point >= position), once around."""
        self._merge()
        n = len(self._points)
        start = bisect_left(self._points, position)
        for step in range(n):
            yield self._owners[(start + step) % n]

    def lookup(self, key: int, allowed: Callable[[str], bool]) -> tuple[int, str | None]:
        position = _xxh3(key_bytes(key), self.seed)
        for owner in self.walk(position):
            if allowed(owner):
                return position, owner
        return position, None


class DualHashRing:
    """Two consistent-hash rings over the same worker ids."""

    def __init__(self, virtual_nodes: int = 128, seeds: tuple[int, int] = RING_SEEDS) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self._rings = (_Ring(seeds[0], virtual_nodes), _Ring(seeds[1], virtual_nodes))
        self._members: set[str] = set()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._members

    def add(self, worker_id: str) -> None:
        for ring in self._rings:
            ring.add(worker_id)
        self._members.add(worker_id)

    def remove(self, worker_id: str) -> None:
        for ring in self._rings:
            ring.remove(worker_id)
        self._members.discard(worker_id)

    def first(self, key: int, ring: int, allowed: Callable[[str], bool] | None = None) -> str | None:
        """The nearest allowed worker clockwise from ``key`` on ring 0 or 1 (no Eq. 5)."""
        return self._rings[ring].lookup(key, allowed or (lambda _: True))[1]

    def pair(self, key: int, allowed: Callable[[str], bool] | None = None) -> tuple[str, str | None]:
        """The candidate pair of ``key``: (f1's worker, f2's worker, made distinct by Eq. 5).

        The second is None only when a single allowed worker exists. Raises LookupError when
        no allowed worker is on the rings.
        """
        ok = allowed or (lambda _: True)
        _, first = self._rings[0].lookup(key, ok)
        if first is None:
            raise LookupError("no allowed worker on the hash ring")
        position, second = self._rings[1].lookup(key, ok)
        if second == first:
            second = next((o for o in self._rings[1].walk(position) if o != first and ok(o)), None)
        return first, second
