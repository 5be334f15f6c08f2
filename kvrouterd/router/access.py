"""Who routed which prompt blocks, remembered until the engine reports storing them, for metadata-aware eviction.

A request routed to an event-mode worker leaves its ``AccessInfo`` (session, task, prompt
size) on each of its block keys (``LoadLedger.commit``, only when the eviction policy
``wants_request_info``); the engine's later Stored event for those blocks picks it up
(``EventApplier``), so policies such as T-LRU and UniCache see which conversation a block
belongs to. Bounded by ``RECENT_ACCESS_KEYS``, oldest first out.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from ..policies.base import AccessInfo
from ..protocols import RouteRequest

__all__ = ["NO_ACCESS_INFO", "RECENT_ACCESS_KEYS", "RecentAccess"]

#: How many recently routed prompt blocks remember their request's AccessInfo, so that an
#: engine's later Stored event for them reaches metadata-aware eviction policies (~150 B each).
RECENT_ACCESS_KEYS = 1 << 17

#: the AccessInfo of blocks no routed request explains; frozen, so one instance serves every event
#: (building one per stored event cost 8,700 instructions by callgrind, ~270 a block of a 32-block event)
NO_ACCESS_INFO = AccessInfo()


class RecentAccess:
    """Block key -> (AccessInfo of the request that routed it, block offset)."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        #: insertion-ordered, oldest dropped first; empty unless the eviction policy reads
        #: metadata (the Stored handler tests it before calling ``stored_info``, once per event)
        self.entries: dict[int, tuple[AccessInfo, int]] = {}

    def remember(self, req: RouteRequest) -> None:
        """Remember who routed these blocks until the engine reports storing them."""
        info = AccessInfo(session_id=req.session_id, task=int(req.task), prompt_tokens=req.prompt_tokens,
                          decode_from_block=req.prompt_tokens // self._block_size)
        recent = self.entries
        for offset, key in enumerate(req.keys):
            recent.pop(key, None)  # re-insert: the newest request owns a shared prefix
            recent[key] = (info, offset)
        self._trim()

    def _trim(self) -> None:
        recent = self.entries
        if len(recent) > RECENT_ACCESS_KEYS:
            for key in list(itertools.islice(recent, len(recent) - RECENT_ACCESS_KEYS)):
                del recent[key]

    def stored_info(self, parent_key: int | None, keys: Sequence[int]) -> AccessInfo:
        """The AccessInfo for an engine's Stored chain: that of the routed request whose prompt
        it starts in, or continues (generated blocks). Blocks no routed request explains are
        unlabelled: ``AccessInfo()``, which policies resolve with ``TaskCategory.resolve``
        (no session: TEMPLATED)."""
        recent = self.entries
        found = recent.get(keys[0]) if keys else None
        if found is not None:
            info, first = found
        elif parent_key is not None and (found := recent.get(parent_key)) is not None:
            info, first = found[0], found[1] + 1
        else:
            return NO_ACCESS_INFO
        for offset, key in enumerate(keys, first):
            if key not in recent:  # generated blocks: later chains hang under them
                recent[key] = (info, offset)
        self._trim()
        return replace(info, first_offset=first)
