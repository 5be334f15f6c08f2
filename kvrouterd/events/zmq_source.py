"""The daemon's ZMQ subscriptions to vLLM / SGLang KV-event publishers: sockets kept alive.

One ``EndpointSubscriber`` per engine endpoint and data-parallel rank (rank r publishes on the
configured port + r, as vLLM does), all owned by a ``ZmqEventSource``, which starts, replaces,
stops and, when one dies, restarts them. A subscriber's SUB socket feeds the sequencing it
inherits (``events.sequencing``: order, replay, hand-off to the router). A removed or replaced
subscriber is cancelled until its task has ended (``tasks.Stopping``: one cancel can be lost in
its ``wait_for``), and its sockets close, linger 0, as it ends.

Connections: ZMQ reconnects on its own with exponential backoff (``reconnect_ivl_ms`` up to
``reconnect_ivl_max_ms``). An endpoint that delivers nothing for ``silence_s`` is shown as
silent (idle engines are silent too, so this is a status, not an error) and its socket is
recreated, with backoff, to get past half-open TCP connections. A disconnect is noted, so the
next batch is checked against the engine's replay for a restart the sequence hides. Both that
backoff and a failed subscriber's restart wait by the daemon's ``retry.Backoff`` between
``reconnect_ivl_ms`` and ``reconnect_ivl_max_ms``, the bounds ZMQ's own reconnects use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Protocol

import tenacity
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from ..clock import Clock, SystemClock
from ..errors import ConfigError, KVRouterError
from ..protocols import CacheMode
from ..retry import Backoff
from ..tasks import Stopping, stop_task
from .endpoints import ZmqEndpoint
from .parts import DEFAULT_BLOCK_SIZE, MAX_PART_BLOCKS
from .sequencing import ApplyFn, EndpointSequencer, RejectedFn, ResetFn, SubscriberStats
from .zmq_config import ZmqEventsConfig

__all__ = ["EndpointSubscriber", "ZmqEventSource"]

log = logging.getLogger("kvrouterd.events.zmq")


class _Silent(Exception):
    """A socket recreated after delivering nothing: the next is made after a backoff."""


def reconnect_backoff(config: ZmqEventsConfig) -> Backoff:
    """The wait between a subscriber's sockets, and before restarting a failed one."""
    return Backoff(config.reconnect_ivl_ms / 1000, config.reconnect_ivl_max_ms / 1000)


class EndpointSubscriber(EndpointSequencer):
    """The SUB socket of one engine endpoint (one DP rank), feeding its sequencing."""

    async def run(self) -> None:
        """Receive until cancelled; recreate the socket after each silent interval."""
        self._start_session()
        backoff = reconnect_backoff(self.config)
        while True:  # a socket that delivered starts the backoff over
            async for attempt in backoff.retrying(_Silent):
                with attempt:
                    await self._socket_session()

    async def _socket_session(self) -> None:
        """Receive on one socket until it falls silent; raises ``_Silent`` if it delivered nothing."""
        sock = self._subscribe()
        watcher = asyncio.create_task(self._watch_disconnects(sock), name=f"kv-events-monitor-{self.worker_id}")
        try:
            delivered = await self._receive(sock)
        finally:
            # close the socket first: libzmq then stops its monitor by itself (calling
            # disable_monitor() after the monitor's reader closed can block forever)
            sock.close(linger=0)
            await stop_task(watcher)
        self._verify_pending = self._expected is not None  # a new socket: messages may be missing
        self.stats.reconnects += 1
        if not delivered:
            raise _Silent

    async def _watch_disconnects(self, sock: zmq.asyncio.Socket) -> None:
        """ZMQ reconnects by itself; while it was away the engine may have restarted and
        published exactly as many batches as we expect, which the sequence cannot show.
        Note each disconnect, so the next batch is checked against the engine's replay."""
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                event = await recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED and self._expected is not None:
                    self._verify_pending = True
                    log.info("KV-event publisher disconnected; the run is checked on reconnect",
                             extra={"worker_id": self.worker_id})
        finally:
            monitor.close(linger=0)

    def _subscribe(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, self.config.reconnect_ivl_ms)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.config.reconnect_ivl_max_ms)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
            sock.connect(self.endpoint.pub_address)
        except BaseException:
            sock.close(linger=0)  # else each restart of a subscriber whose connect fails leaks one
            raise
        return sock

    async def _receive(self, sock: zmq.asyncio.Socket) -> bool:
        """Handle messages until a silent interval passes; True if any arrived."""
        delivered = False
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), self.config.silence_s)
            except TimeoutError:
                if not self.stats.silent:
                    self.stats.silent = True
                    log.warning(
                        "no KV events for %.1fs; reconnecting", self.config.silence_s,
                        extra={"worker_id": self.worker_id, "endpoint": self.endpoint.pub_address},
                    )
                return delivered
            delivered = True
            if self.stats.silent:
                self.stats.silent = False
                log.info("KV events resumed", extra={"worker_id": self.worker_id})
            await self.handle_frames(frames)


class _WorkerLike(Protocol):
    """What ``sync`` reads of a worker: ``index.workers.WorkerSpec`` fits."""

    @property
    def id(self) -> str: ...
    @property
    def mode(self) -> CacheMode: ...
    @property
    def kv_events_endpoint(self) -> str: ...


class ZmqEventSource:
    """All ZMQ subscribers of one daemon: add/remove endpoints, run them under a TaskGroup.

    ``apply(batch)``, ``reset(worker_id, lost)`` and ``rejected(worker_id, counts, lost_removal)``
    are supplied by the host; the daemon passes ``Router.apply`` (per event, wrapped for
    telemetry), ``Router.reset_events`` and ``Router.note_rejected_events``. An engine batch of
    more than ``max_part_blocks`` blocks reaches ``apply`` as consecutive parts (``events.parts``:
    ``block_size`` is the router's, where chains of other-sized pages may be cut).
    """

    def __init__(
        self,
        config: ZmqEventsConfig,
        apply: ApplyFn,
        reset: ResetFn,
        clock: Clock | None = None,
        ctx: zmq.asyncio.Context | None = None,
        rejected: RejectedFn | None = None,
        *,
        max_part_blocks: int = MAX_PART_BLOCKS,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        config.validate()
        if max_part_blocks < 1 or block_size < 1:
            raise ConfigError(f"max_part_blocks and block_size must be >= 1, got {max_part_blocks}, {block_size}")
        self.config = config
        self.max_part_blocks = max_part_blocks
        self.block_size = block_size
        self._apply = apply
        self._reset = reset
        self._rejected = rejected
        self._clock = clock or SystemClock()
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.asyncio.Context()
        self.subscribers: dict[str, EndpointSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: removed and replaced subscribers' tasks, until they have ended
        self._stopping = Stopping()
        #: worker id -> (its kv_events_endpoint and model as last synced, what they parsed to):
        #: the daemon syncs the whole fleet on every membership change, and parsing every
        #: endpoint again (~7 us each) made registering 1,024 workers quadratic, seconds of the loop
        self._parsed: dict[str, tuple[str, str, ZmqEndpoint | ConfigError]] = {}

    def add(self, endpoint: ZmqEndpoint) -> EndpointSubscriber:
        """Start subscribing (replaces an existing subscriber for the same worker)."""
        self.remove(endpoint.worker_id)
        sub = self._new_subscriber(endpoint)
        self._tasks[endpoint.worker_id] = asyncio.create_task(self._supervise(sub), name=f"kv-events-{endpoint.worker_id}")
        log.info("subscribed to KV events", extra={"worker_id": endpoint.worker_id, "endpoint": endpoint.pub_address})
        return sub

    def _new_subscriber(self, endpoint: ZmqEndpoint) -> EndpointSubscriber:
        sub = EndpointSubscriber(endpoint, self.config, self._apply, self._reset, self._ctx, self._clock, self._rejected,
                                 max_part_blocks=self.max_part_blocks, block_size=self.block_size)
        self.subscribers[endpoint.worker_id] = sub
        return sub

    async def _supervise(self, sub: EndpointSubscriber) -> None:
        """Run a subscriber; if it dies, whatever killed it, the worker's view is cleared and
        DEGRADED (events were lost) and a fresh subscriber starts after a backoff, joining
        the engine again by replay from 0. Never lets a worker look healthy on a dead feed."""

        def failed(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.error("KV-event subscriber failed (%s: %s); worker degraded, restarting in %.1fs",
                      type(exc).__name__, exc, state.upcoming_sleep, extra={"worker_id": sub.worker_id}, exc_info=exc)
            with contextlib.suppress(KVRouterError):
                self._reset(sub.worker_id, True)

        # any Exception: a bug, an unusable endpoint, the router (cancellation goes through)
        async for attempt in reconnect_backoff(self.config).retrying(Exception, before_sleep=failed):
            with attempt:
                if attempt.retry_state.attempt_number > 1:  # sub failed; the backoff has passed
                    if self.subscribers.get(sub.worker_id) is not sub:
                        return  # removed or replaced meanwhile
                    stats = sub.stats
                    stats.subscriber_restarts += 1
                    sub = self._new_subscriber(sub.endpoint)
                    sub.stats = stats
                await sub.run()

    def remove(self, worker_id: str) -> None:
        """Stop the worker's subscriber, if any (its router state is left to the caller): its
        task is cancelled until it has ended, in the background, and its sockets close as it ends."""
        self.subscribers.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            self._stopping.add(task)

    async def close(self) -> None:
        """Stop every subscriber and wait until each has ended (or, stuck, been given up on)."""
        for wid in list(self._tasks):
            self.remove(wid)
        await self._stopping.wait()
        if self._own_ctx:
            # destroy, not term: term would block the loop for good on a socket a stuck task holds
            self._ctx.destroy(linger=0)

    def sync(self, workers: Iterable[_WorkerLike], model: str = "") -> None:
        """Subscribe to every EVENTS-mode worker that declares a ``kv_events_endpoint`` and
        stop the rest; a subscriber whose endpoint did not change is left running. The daemon
        calls ``sync(w.spec for w in router.workers)`` after each membership change."""
        wanted: dict[str, ZmqEndpoint] = {}
        parsed, kept = self._parsed, {}
        for w in workers:
            if w.mode is CacheMode.EVENTS and w.kv_events_endpoint:
                wid, text = w.id, w.kv_events_endpoint
                known = parsed.get(wid)
                if known is None or known[0] != text or known[1] != model:
                    try:
                        known = (text, model, ZmqEndpoint.parse(wid, text, model))
                    except ConfigError as exc:
                        known = (text, model, exc)
                kept[wid] = known
                if isinstance(known[2], ConfigError):
                    log.error("cannot subscribe: %s", known[2], extra={"worker_id": wid})
                else:
                    wanted[wid] = known[2]
        self._parsed = kept
        for wid in [wid for wid in self.subscribers if wid not in wanted]:
            self.remove(wid)
        for wid, endpoint in wanted.items():
            current = self.subscribers.get(wid)
            if current is None or (current.endpoint is not endpoint and current.endpoint != endpoint):
                self.add(endpoint)

    def stats(self) -> dict[str, SubscriberStats]:
        return {wid: sub.stats for wid, sub in self.subscribers.items()}
