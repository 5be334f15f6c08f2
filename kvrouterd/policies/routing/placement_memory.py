"""Where DualMap placed prompts that were cached nowhere, so their follow-ups go there too.

A prompt no worker holds any of is placed on the best worker of the whole fleet instead of
the lighter of its two hashed candidates (``dualmap``'s ``cold_placement: fleet``). That
worker is usually not in the prompt's hash pair, so without a record of the choice the
next request with the same prefix would look for its cache in the pair and miss it (in
events mode it would not even see the cache until the engine's Stored arrives). This map
keeps the record: prefix key (a block key, which names the whole prefix up to that block)
-> worker, bounded in entries, each forgotten ``ttl_s`` after it was last used and at once
when its worker leaves.

Lookup is by the longest remembered prefix of the prompt within its hash key, so a
conversation whose first turn was shorter than the key still finds where that turn went.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["PlacementMemory"]


class PlacementMemory:
    """A bounded, expiring map of prefix key -> worker id, least recently used first."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        #: 0 = entries never expire (only the bound and worker removal drop them)
        self.ttl_s = ttl_s
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Sequence[int], blocks: int, now: float,
               eligible: Callable[[str], bool]) -> tuple[int, str] | None:
        """The longest remembered prefix among the first ``blocks`` block keys whose worker is
        ``eligible`` and whose entry is fresh at ``now``: (its key, the worker). Read-only."""
        if not self._entries:
            return None
        for i in range(min(blocks, len(keys)) - 1, -1, -1):
            hit = self._entries.get(keys[i])
            if hit is None:
                continue
            worker_id, used = hit
            if (self.ttl_s <= 0 or now - used <= self.ttl_s) and eligible(worker_id):
                return keys[i], worker_id
        return None

    def remember(self, key: int, worker_id: str, now: float) -> None:
        """Record (or refresh) ``key`` -> ``worker_id`` as used at ``now``."""
        self._entries[key] = (worker_id, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def expire(self, now: float) -> None:
        """Drop entries unused for longer than ``ttl_s`` (the oldest are first in order)."""
        if self.ttl_s <= 0:
            return
        while self._entries:
            key, (_, used) = next(iter(self._entries.items()))
            if now - used <= self.ttl_s:
                break
            del self._entries[key]

    def forget_worker(self, worker_id: str) -> None:
        """Drop every placement on ``worker_id`` (it left the fleet)."""
        for key in [k for k, (w, _) in self._entries.items() if w == worker_id]:
            del self._entries[key]
