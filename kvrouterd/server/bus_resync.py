"""Ask bus publishers to resync the workers whose view lost events.

Over gRPC the ``PublishEvents`` answer tells a publisher that the router needs its worker's full
state (``WorkerSequence.resync_needed``). A publisher on the event bus never hears from a router,
so a replica whose view of a bus-fed worker lost events (a hole in the stream, a first batch it
never saw the start of, a snapshot taken while the worker was degraded) asks the publisher on
core NATS (``events.nats_bus.resync_subject``): at once, then every ``interval_s`` while the view
stays incomplete, since a request nobody heard is simply gone. The publisher answers with
``Cleared`` plus its engine's snapshot on the stream, which heals every replica at once; asks
from several replicas (or repeated ones) that its resync already answers are ignored there.
"""

from __future__ import annotations

import asyncio
import logging

from ..events.nats_bus import BusEventSource
from ..protocols import BatchOutcome, EventBatch
from ..router import Router
from .convert import pb

__all__ = ["BusResyncAsker"]

log = logging.getLogger("kvrouterd.events.nats")

#: seconds between two asks for the same worker while its view stays incomplete
ASK_INTERVAL_S = 2.0
#: how often the asker looks for newly incomplete workers
CHECK_INTERVAL_S = 0.25


class BusResyncAsker:
    def __init__(self, router: Router, bus: BusEventSource, interval_s: float = ASK_INTERVAL_S) -> None:
        self.router = router
        self.bus = bus
        self.interval_s = interval_s
        #: bus-fed workers whose view lost events -> loop time of the last ask (None = not asked yet)
        self._stale: dict[str, float | None] = {}

    def applied(self, batch: EventBatch, outcome: BatchOutcome) -> None:
        """After each bus batch: remember its worker if its view is now incomplete."""
        worker = self.router.workers.find(batch.worker_id)
        if worker is not None and worker.resync_needed and batch.worker_id not in self._stale:
            self._stale[batch.worker_id] = None

    def watch_all(self) -> None:
        """Every worker currently flagged (after restoring a snapshot)."""
        for worker in self.router.workers:
            if worker.resync_needed:
                self._stale.setdefault(worker.id, None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for worker_id, asked in list(self._stale.items()):
                worker = self.router.workers.find(worker_id)
                if worker is None or not worker.resync_needed:
                    del self._stale[worker_id]
                    continue
                if asked is not None and now - asked < self.interval_s:
                    continue
                request = pb.WorkerSequence(worker_id=worker_id, last_sequence=worker.last_sequence, resync_needed=True)
                try:
                    await self.bus.request_resync(worker_id, request.SerializeToString())
                except Exception as exc:  # NATS errors of any kind: the next round asks again
                    log.warning("asking for a resync failed: %s", exc, extra={"worker_id": worker_id})
                    continue
                self._stale[worker_id] = now
                # the first ask is news; repeats (nobody answering: the worker's events come through
                # `kvrouterd bridge`, or its publisher is down) would flood the log every interval
                log.log(logging.INFO if asked is None else logging.DEBUG, "asked the publisher for a resync",
                        extra={"worker_id": worker_id, "last_sequence": worker.last_sequence})
            await asyncio.sleep(CHECK_INTERVAL_S)
