"""Engines' side of the NATS event bus: publish KV-cache events into a JetStream stream that
every kvrouterd replica follows (kvrouterd ``events.bus``; docs/deploy.md, "NATS").

    async with NatsEventPublisher("nats://nats:4222", "gpu-0", block_size=16) as pub:
        pub.stored(tokens, engine_hashes=hashes, parent_engine_hash=parent)   # never blocks
        pub.removed(evicted_hashes)

The recording, batching, numbering, overflow and resync rules are ``EventPublisher``'s; only
delivery differs. Each batch is one ``kvrouter.v1.EventBatch`` message on the subject
``<subject_prefix>.<worker token>``, published in order and kept until JetStream acknowledges
it (stored on disk). After a failure (NATS down or restarting) the client reconnects and the
unacknowledged batches are sent again, each with the same ``Nats-Msg-Id``
(``<worker>.<run>.<sequence>``), so the stream's de-duplication window drops a batch it already
stored: no batch is lost or stored twice, and every replica applies each one once.

Resync. A router replica whose view of this worker lost events (a hole in the stream, a
snapshot taken while the worker was degraded) cannot answer a publisher on the bus, so it asks:
on the core NATS subject ``<subject_prefix>-resync.<worker token>``, again every few seconds
while its view stays incomplete. The publisher then sends ``Cleared`` plus ``snapshot()`` on the
stream, which heals every replica at once; asks about a batch before its latest resync (other
replicas, repeats) are ignored, since that resync is already on its way to them.

``target`` (a router's host:port) is optional here and only serves ``register``, ``report_load``
and ``evict_hint``. Needs the ``nats`` extra (``pip install 'kvrouter-client[nats]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from typing import Any

from google.protobuf.message import DecodeError

from ._generated.kvrouter.v1 import router_pb2 as pb
from ._publisher import EventPublisher

__all__ = ["NatsEventPublisher", "resync_subject", "worker_subject"]

_TOKEN_SAFE = re.compile(r"[A-Za-z0-9_\-]")
#: seconds JetStream remembers a message id; longer than any reconnect we retry through
DUPLICATE_WINDOW_S = 120.0


def worker_subject(prefix: str, worker_id: str) -> str:
    """The subject of one worker's events, as kvrouterd's ``events.nats_bus`` spells it:
    anything outside [A-Za-z0-9_-] (NATS reads '.', '*', '>' as syntax) is written %XX."""
    token = "".join(c if _TOKEN_SAFE.match(c) else "".join(f"%{b:02X}" for b in c.encode()) for c in worker_id)
    return f"{prefix}.{token}"


def resync_subject(prefix: str, worker_id: str) -> str:
    """Where router replicas ask this worker's publisher for a resync (kvrouterd's spelling)."""
    return worker_subject(f"{prefix}-resync", worker_id)


class NatsEventPublisher(EventPublisher):
    """Publishes one worker's cache events into the shared JetStream stream."""

    _events_need_router = False

    def __init__(
        self,
        nats_url: str,
        worker_id: str,
        *,
        stream: str = "KVROUTER_EVENTS",
        subject_prefix: str = "kvrouter.events",
        target: str = "",
        **options: Any,
    ) -> None:
        super().__init__(target, worker_id, **options)
        self.nats_url = nats_url
        self.stream = stream
        self.subject = worker_subject(subject_prefix, worker_id)
        self.subject_prefix = subject_prefix
        #: distinguishes this publisher's message ids from an earlier run's (which also start at 0)
        self.run_id = uuid.uuid4().hex[:12]
        self._nc: Any = None
        self._js: Any = None

    async def _connect(self) -> Any:
        if self._js is not None and self._nc.is_connected:
            return self._js
        if self._nc is None:
            import nats

            self._nc = await nats.connect(
                [u.strip() for u in self.nats_url.split(",")], connect_timeout=self.timeout,
                allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=self.reconnect_initial_s,
            )
            self._js = self._nc.jetstream()
            await self._ensure_stream()
            # the client subscribes again by itself after a reconnect
            await self._nc.subscribe(resync_subject(self.subject_prefix, self.worker_id), cb=self._on_resync_request)
        return self._js

    async def _on_resync_request(self, msg: Any) -> None:
        try:
            request = pb.WorkerSequence.FromString(msg.data)
        except DecodeError:
            return
        if request.worker_id != self.worker_id or not request.resync_needed:
            return
        if request.last_sequence < self._last_resync_seq:
            return  # the replica has not reached our latest resync yet: it is on the stream
        self._resync_asked = f"a router replica says its view is incomplete after batch {request.last_sequence}"
        self._wake.set()

    async def _ensure_stream(self) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        try:
            await self._js.stream_info(self.stream)
        except NotFoundError:
            # kvrouterd creates it too; whichever starts first does, with the same subjects
            await self._js.add_stream(StreamConfig(
                name=self.stream, subjects=[f"{self.subject_prefix}.>"], storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
            ))

    async def _stream(self) -> None:
        """Publish what is buffered, oldest first, dropping each batch once JetStream acks it;
        then wait for more (or a flush). Raising hands the retry to ``EventPublisher._run``."""
        js = await self._connect()
        self.stats.streams += 1
        while True:
            if self._resync_asked:
                why, self._resync_asked = self._resync_asked, ""
                self._resync_for_router(why)
            if self._needs_resync:
                self._resync()
            self._seal()
            while self._buffer:
                seq, msg = self._buffer[0]
                # never reused once tried: JetStream may have stored it, and drops a repeated message id
                self._written_seq = max(self._written_seq, seq)
                await js.publish(self.subject, msg.SerializeToString(), timeout=self.timeout,
                                 headers={"Nats-Msg-Id": f"{self.worker_id}.{self.run_id}.{seq}"})
                self._buffer.popleft()
                self.stats.batches_written += 1
                self.stats.batches_acked += 1
            self._flush_now = False
            self._acked.set()
            self._wake.clear()
            if not self._pending and not self._needs_resync and not self._resync_asked:
                await self._wake.wait()
            if self._pending and self.linger_s and not self._flush_now:
                await asyncio.sleep(self.linger_s)

    async def close(self, timeout: float = 5.0) -> None:
        await super().close(timeout)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None
            self._js = None
