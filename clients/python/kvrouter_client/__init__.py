"""Client SDK for kvrouterd.

Gateways: ``RouterClient`` (asyncio) / ``SyncRouterClient`` — ``route()`` then ``complete()``.
Engines: ``EventPublisher`` — stream KV-cache events, ``evict_hint()``, ``report_load()``.
``kvrouter_client.keys`` computes block keys exactly as the router does.
"""

from __future__ import annotations

from . import keys
from ._channel import TLS
from ._client import DEFAULT_STREAMS, DEFAULT_TIMEOUT_S, FallbackFn, RouterClient, SyncRouterClient
from ._fanout import FanOutPublisher
from ._errors import KVRouterClientError, RouterOverloaded, RouterRejected, RouterUnavailable
from ._nats_publisher import NatsEventPublisher
from ._publisher import EventPublisher, SnapshotFn
from ._types import (
    CacheMode,
    Cleared,
    EvictAdvice,
    PublisherStats,
    Removed,
    RouteResult,
    Stored,
    TaskCategory,
    WorkerInfo,
    WorkerRole,
    WorkerState,
)

__all__ = [
    "DEFAULT_STREAMS",
    "DEFAULT_TIMEOUT_S",
    "CacheMode",
    "Cleared",
    "EventPublisher",
    "NatsEventPublisher",
    "EvictAdvice",
    "FallbackFn",
    "FanOutPublisher",
    "KVRouterClientError",
    "PublisherStats",
    "Removed",
    "RouteResult",
    "RouterClient",
    "RouterOverloaded",
    "RouterRejected",
    "RouterUnavailable",
    "SnapshotFn",
    "Stored",
    "SyncRouterClient",
    "TLS",
    "TaskCategory",
    "WorkerInfo",
    "WorkerRole",
    "WorkerState",
    "keys",
]
