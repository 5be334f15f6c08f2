"""What every part of the router reads and none owns alone: settings, clock, index, workers, policies, counters.

The parts (``events``, ``ledger``, ``membership``, ``slots``, ``advice``, ``selector``) each own
their own state and hold this one object for the rest. They read its fields at each call and
keep none of them, so what the host swaps through the ``Router`` facade (``index``,
``eviction``, ``settings``) every part sees at its next call.
"""

from __future__ import annotations

import logging
import random

from ..clock import Clock
from ..index.radix import RadixIndex
from ..index.workers import WorkerRegistry
from .policy_table import PolicyTable
from .settings import RouterSettings

__all__ = ["Shared", "log"]

#: one logger for every part, as before the router was split: operators' filters name it
log = logging.getLogger("kvrouterd.router")


class Shared:
    """The references the router's parts share (see the module docstring)."""

    __slots__ = ("block_size", "clock", "counters", "index", "policies", "rng", "settings", "workers")

    def __init__(self, settings: RouterSettings, clock: Clock, rng: random.Random, index: RadixIndex,
                 workers: WorkerRegistry, policies: PolicyTable) -> None:
        self.settings = settings
        self.clock = clock
        self.rng = rng
        #: the router's block size, fixed for its life (``settings.block_size`` at start)
        self.block_size = settings.block_size
        self.index = index
        self.workers = workers
        self.policies = policies
        #: what GetStats and the metrics report; each part counts its own events here
        self.counters: dict[str, int] = {
            "decisions": 0, "batches_applied": 0, "batches_duplicate": 0, "gaps": 0,
            "restarts": 0, "blocks_stored": 0, "blocks_removed": 0, "orphan_blocks": 0,
            "unknown_removals": 0, "inflight_expired": 0, "approx_evicted": 0, "events_rejected": 0,
            "remote_dispatches": 0, "remote_completions": 0, "remote_late_dispatches": 0,
            "remote_unknown_workers": 0, "remote_prefill_releases": 0,
        }
