"""One engine's cache events to every kvrouterd replica.

Replicas each keep their own index, fed by their own event streams. ``FanOutPublisher``
holds one ``EventPublisher`` per replica (each with its own numbering, buffer, reconnects and
acknowledgements, so a slow or dead replica never holds the others back) and forwards every
call to all of them::

    async with FanOutPublisher(["kvrouter-0:50051", "kvrouter-1:50051"], "gpu-0") as pub: ...
    async with FanOutPublisher("kvrouter-headless.llm.svc:50051", "gpu-0", snapshot=snapshot) as pub: ...

A list names the replicas. A single ``host:port`` is resolved to every address it has (a
Kubernetes headless Service has one per ready pod) and resolved again every
``resolve_interval_s``: a new replica gets its own publisher, this worker's registration
(as last given to ``register()``) and ``Cleared`` plus ``snapshot()`` (so its view starts
whole, not from the next event); a vanished one is closed. With TLS, the certificate is
checked against the resolved name (``TLS.server_name`` defaults to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from ._channel import TLS
from ._decimals import parse_decimal
from ._publisher import EventPublisher
from ._types import CacheMode, EvictAdvice, PublisherStats, WorkerInfo, WorkerRole

__all__ = ["FanOutPublisher", "resolve_all"]

log = logging.getLogger("kvrouter_client.publisher")

#: how often a DNS target is resolved again
DEFAULT_RESOLVE_INTERVAL_S = 30.0


def resolve_all(target: str) -> list[str]:
    """Every ``ip:port`` a ``host:port`` resolves to (IPv6 in brackets), sorted, without duplicates."""
    host, sep, digits = target.rpartition(":")
    port = parse_decimal(digits)
    if not sep or not host or port is None:
        raise ValueError(f"expected host:port, got {target!r}")
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, address in infos:
        ip = address[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


class FanOutPublisher:
    """``EventPublisher``'s API, sent to several router replicas. Keyword arguments other than
    those below go to each replica's ``EventPublisher`` unchanged (block_size, snapshot, tls,
    token, linger_s, ...). ``resolve`` (tests) replaces DNS resolution."""

    def __init__(
        self,
        targets: Sequence[str] | str,
        worker_id: str,
        *,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        resolve: Callable[[str], list[str]] = resolve_all,
        **publisher_options: Any,
    ) -> None:
        if "channel" in publisher_options:
            raise ValueError("FanOutPublisher opens one channel per replica: pass targets, not a channel")
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        if resolve_interval_s <= 0:
            raise ValueError("resolve_interval_s must be > 0")
        self.worker_id = worker_id
        self.dns_name = targets if isinstance(targets, str) else ""
        self._fixed = [] if isinstance(targets, str) else list(dict.fromkeys(targets))
        if not self.dns_name and not self._fixed:
            raise ValueError("pass at least one target")
        self.resolve_interval_s = resolve_interval_s
        self._resolve = resolve
        self._options = publisher_options
        tls: TLS | None = publisher_options.get("tls")
        if tls is not None and self.dns_name and not tls.server_name:
            # resolved addresses are IPs; the certificate names the service
            self._options = {**publisher_options,
                             "tls": dataclasses.replace(tls, server_name=self.dns_name.rpartition(":")[0])}
        #: replica address -> its publisher
        self.publishers: dict[str, EventPublisher] = {}
        self._registration: dict[str, Any] | None = None
        self._watch: asyncio.Task[None] | None = None

    # ---- membership ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._sync(self._fixed or await asyncio.to_thread(self._resolve, self.dns_name))
        if self.dns_name and self._watch is None:
            self._watch = asyncio.create_task(self._rewatch(), name=f"kvrouter-fanout-{self.worker_id}")

    async def _rewatch(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            try:
                addresses = await asyncio.to_thread(self._resolve, self.dns_name)
            except OSError as exc:  # DNS hiccup: keep the replicas we have
                log.warning("cannot resolve %s: %s; keeping %d replicas", self.dns_name, exc, len(self.publishers))
                continue
            if addresses:
                await self._sync(addresses)

    async def _sync(self, addresses: Sequence[str]) -> None:
        """Open publishers for new replicas (registered and snapshotted), close vanished ones."""
        for gone in [a for a in self.publishers if a not in addresses]:
            log.info("router replica gone", extra={"worker_id": self.worker_id, "replica": gone})
            await self.publishers.pop(gone).close(timeout=0)
        for address in addresses:
            if address in self.publishers:
                continue
            pub = EventPublisher(address, self.worker_id, **self._options)
            self.publishers[address] = pub
            await pub.start()
            if self._registration is not None:  # a replica that joined later: catch it up
                log.info("router replica joined", extra={"worker_id": self.worker_id, "replica": address})
                pub._resync()
                with contextlib.suppress(Exception):  # unreachable now: the next register() retries it
                    await pub.register(**self._registration)

    # ---- events: recorded on every replica's publisher ------------------------------------------
    def stored(self, token_ids: Sequence[int], **kwargs: Any) -> None:
        for pub in self.publishers.values():
            pub.stored(token_ids, **kwargs)

    def removed(self, engine_hashes: Sequence[int]) -> None:
        for pub in self.publishers.values():
            pub.removed(engine_hashes)

    def cleared(self) -> None:
        for pub in self.publishers.values():
            pub.cleared()

    async def flush(self, timeout: float | None = None) -> bool:
        """True once every replica acknowledged everything recorded so far."""
        results = await asyncio.gather(*(pub.flush(timeout) for pub in self.publishers.values()))
        return all(results)

    @property
    def stats(self) -> dict[str, PublisherStats]:
        return {address: pub.stats for address, pub in self.publishers.items()}

    async def close(self, timeout: float = 5.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        await asyncio.gather(*(pub.close(timeout) for pub in self.publishers.values()))
        self.publishers.clear()

    async def __aenter__(self) -> FanOutPublisher:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # ---- unary calls: every replica (evict_hint: the first that answers) --------------------------
    async def _all(self, call: Callable[[EventPublisher], Any]) -> dict[str, Any]:
        """Call every replica; raise the first error once all have been tried."""
        addresses = list(self.publishers)
        results = await asyncio.gather(*(call(self.publishers[a]) for a in addresses), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(addresses, results))

    async def register(
        self,
        address: str,
        *,
        capacity_blocks: int = 0,
        labels: Mapping[str, str] | None = None,
        mode: CacheMode = CacheMode.EVENTS,
        kv_events_endpoint: str = "",
        models: Sequence[str] = (),
        loras: Sequence[str] = (),
        max_loras: int = 0,
        role: WorkerRole = WorkerRole.BOTH,
        timeout: float | None = None,
    ) -> dict[str, WorkerInfo]:
        """Register on every replica (remembered for replicas that join later); by replica."""
        self._registration = {"address": address, "capacity_blocks": capacity_blocks, "labels": labels,
                              "mode": mode, "kv_events_endpoint": kv_events_endpoint, "models": models, "loras": loras,
                              "max_loras": max_loras, "role": role, "timeout": timeout}
        return await self._all(lambda pub: pub.register(**self._registration))  # type: ignore[arg-type]

    async def deregister(self, timeout: float | None = None) -> None:
        self._registration = None
        await self._all(lambda pub: pub.deregister(timeout))

    async def report_load(self, queued: int, running: int, kv_utilization: float, timeout: float | None = None,
                          loaded_loras: Sequence[str] | None = None) -> None:
        await self._all(lambda pub: pub.report_load(queued, running, kv_utilization, timeout, loaded_loras))

    async def evict_hint(self, **kwargs: Any) -> EvictAdvice:
        """Replicas hold the same events, so one answer serves: the first replica that gives one."""
        error: BaseException | None = None
        for pub in self.publishers.values():
            try:
                return await pub.evict_hint(**kwargs)
            except ValueError:
                raise
            except Exception as exc:  # this replica is down: ask the next
                error = exc
        raise error if error is not None else RuntimeError("no router replica")
