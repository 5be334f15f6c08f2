"""DualMap's request-prefix hotness tree and adaptive hash-key length (DualMap section 3.2).

A request's hash key is its prefix up to some block: the chained block key at that block
identifies the whole prefix (see ``index.keys``), so it *is* the tree node. The key starts at
``base_blocks`` (the paper's 2 segments of 512 tokens) and, while the node reached is marked
*extended*, grows by one segment (``segment_blocks``) at a time, as far as the prompt goes.

Hotness is the traffic share rho of a node: the fraction of requests in a sliding window
whose key path passed through it. After a request is recorded, a leaf node with
rho > 2/n (n = workers) becomes extended, so the next requests sharing it hash on one more
segment and spread over more candidate pairs. An extended node whose rho falls below 1/n
is shrunk back (with any extended descendants), gathering its requests on one pair again.
A node is judged only once the window holds ``min_requests`` requests, so a cold start
(one request = 100% share) does not mark everything hot.

The window is ``window_s`` seconds in ``buckets`` equal buckets; whole buckets expire.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

__all__ = ["PrefixHotness", "key_path"]


def key_path(keys: Sequence[int], base_blocks: int, segment_blocks: int, extended: dict[int, int | None],
             max_blocks: int) -> list[tuple[int, int]]:
    """The (block count, node key) path of a request's hash key, shortest first.

    The last element is the hash key. Empty when the prompt has no full block.
    """
    if not keys:
        return []
    blocks = min(len(keys), base_blocks, max_blocks)
    path = [(blocks, keys[blocks - 1])]
    limit = min(len(keys), max_blocks)
    while keys[blocks - 1] in extended:
        nxt = min(blocks + segment_blocks, limit)
        if nxt <= blocks:
            break
        blocks = nxt
        path.append((blocks, keys[blocks - 1]))
    return path


class PrefixHotness:
    """Sliding-window traffic shares of hash-key prefixes and the set of extended ones."""

    def __init__(self, window_s: float, buckets: int, min_requests: int) -> None:
        self.window_s = window_s
        self.bucket_s = window_s / buckets
        self.buckets = buckets
        self.min_requests = min_requests
        #: extended node key -> the extended node it hangs from (None for a base node)
        self.extended: dict[int, int | None] = {}
        self._window: deque[tuple[int, Counter[int], int]] = deque()  # (bucket index, counts, requests)
        self._counts: Counter[int] = Counter()
        self._total = 0

    @property
    def total(self) -> int:
        """Requests in the window."""
        return self._total

    def count(self, node: int) -> int:
        """Requests in the window whose key path passed through ``node``."""
        return self._counts.get(node, 0)

    def share(self, node: int) -> float:
        return self._counts.get(node, 0) / self._total if self._total else 0.0

    def _expire(self, now: float) -> None:
        oldest = int(now // self.bucket_s) - self.buckets + 1
        while self._window and self._window[0][0] < oldest:
            _, counts, requests = self._window.popleft()
            self._counts.subtract(counts)
            self._total -= requests
            for node, c in counts.items():
                if self._counts[node] <= 0:
                    del self._counts[node]

    def record(self, path: Sequence[tuple[int, int]], now: float, workers: int, can_extend: bool) -> bool:
        """Count one dispatched request along its key ``path``; True if its leaf became hot.

        ``can_extend`` says whether the prompt is long enough for the leaf to grow.
        """
        if not path:
            return False
        self._expire(now)
        index = int(now // self.bucket_s)
        if not self._window or self._window[-1][0] != index:
            self._window.append((index, Counter(), 0))
        bucket_index, counts, requests = self._window[-1]
        for _, node in path:
            counts[node] += 1
            self._counts[node] += 1
        self._window[-1] = (bucket_index, counts, requests + 1)
        self._total += 1
        leaf = path[-1][1]
        if (can_extend and leaf not in self.extended and self._total >= self.min_requests
                and self.share(leaf) > 2.0 / max(workers, 1)):
            self.extended[leaf] = path[-2][1] if len(path) > 1 else None
            return True
        return False

    def cool(self, now: float, workers: int) -> list[int]:
        """Expire old buckets and shrink extended nodes whose share fell below 1/n."""
        self._expire(now)
        if not self.extended:
            return []
        if self._total == 0:  # no traffic at all in the window: nothing is hot
            dropped = list(self.extended)
            self.extended.clear()
            return dropped
        if self._total < self.min_requests:
            return []
        cold = [n for n in self.extended if self.share(n) < 1.0 / max(workers, 1)]
        removed: list[int] = []
        for node in cold:
            removed += self._drop(node)
        return removed

    def _drop(self, node: int) -> list[int]:
        if node not in self.extended:
            return []
        del self.extended[node]
        dropped = [node]
        for child in [c for c, parent in self.extended.items() if parent == node]:
            dropped += self._drop(child)
        return dropped

    def clear(self) -> None:
        self.extended.clear()
        self._window.clear()
        self._counts.clear()
        self._total = 0
