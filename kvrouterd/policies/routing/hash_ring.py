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

A ring's points are kept sorted as workers come and go (a ``SortedList``: a worker's
``virtual_nodes`` points in or out in O(log n) each), and lookups bisect a flat copy made again
after a change. Sorting every point again on each change made a fleet's registration
quadratic: 1,024 workers took 100 s of the event loop, and one removal among them 0.2 s. The
points are plain ints, each point's owners in a dict: the copy is then the SortedList's own
lists chained in C (~2.5 ms for 1,024 workers' 131k points), where a copy of (point, owner)
pairs took ~50 ms a ring, on the first Route after every membership change.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable

import xxhash
from sortedcontainers import SortedList

__all__ = ["RING_SEEDS", "DualHashRing"]

#: Seeds of f1 and f2 ("dualmap1", "dualmap2" read as big-endian integers).
RING_SEEDS = (0x6475616C6D617031, 0x6475616C6D617032)

_xxh3 = xxhash.xxh3_64_intdigest


def key_bytes(key: int) -> bytes:
    return (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")


class _Ring:
    __slots__ = ("_members", "_owners_at", "_points", "_sorted", "_stale", "seed", "virtual_nodes")

    def __init__(self, seed: int, virtual_nodes: int) -> None:
        self.seed = seed
        self.virtual_nodes = virtual_nodes
        #: every worker's points in ring order, a point twice where two workers' collide
        self._sorted: SortedList = SortedList()
        #: point -> the workers there, by id: ties between two workers' points are broken by
        #: id, so every replica agrees (nearly always one)
        self._owners_at: dict[int, list[str]] = {}
        #: the flat copy lookups bisect, made again after a change (``_flat``)
        self._points: list[int] = []
        self._stale = False
        self._members: set[str] = set()

    def positions(self, worker_id: str) -> list[int]:
        encoded = worker_id.encode()
        return [_xxh3(encoded + b"#" + str(v).encode(), self.seed) for v in range(self.virtual_nodes)]

    def add(self, worker_id: str) -> None:
        if worker_id in self._members:
            return
        self._members.add(worker_id)
        points = self.positions(worker_id)
        owners_at = self._owners_at
        for p in points:
            owners = owners_at.get(p)
            if owners is None:
                owners_at[p] = [worker_id]
            else:
                insort(owners, worker_id)
        self._sorted.update(points)
        self._stale = True

    def remove(self, worker_id: str) -> None:
        if worker_id not in self._members:
            return
        self._members.discard(worker_id)
        owners_at = self._owners_at
        for p in self.positions(worker_id):
            owners = owners_at[p]
            owners.remove(worker_id)
            if not owners:
                del owners_at[p]
            self._sorted.remove(p)
        self._stale = True

    def _flat(self) -> None:
        if self._stale:
            self._points = list(self._sorted)
            self._stale = False

    def walk(self, position: int) -> Iterable[str]:
        """Owners clockwise from ``position`` (first point >= position), once around."""
        self._flat()
        points, owners_at = self._points, self._owners_at
        n = len(points)
        step = start = bisect_left(points, position)
        end = start + n
        while step < end:
            # a point's owners stand on it as a run of equal points, the run's first reached
            # first (bisect_left finds it; runs do not wrap): all of them, then past the run
            owners = owners_at[points[step % n]]
            yield from owners
            step += len(owners)

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
