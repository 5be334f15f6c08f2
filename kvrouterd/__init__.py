"""kvrouterd: a KV-cache-aware router for LLM serving.

The pure core (``index``, ``policies``, ``router``) is synchronous and does no I/O; the
daemon (``server``) and the simulator (``sim``) host the same ``Router`` with different
edges.
"""

from .clock import Clock, ManualClock, SystemClock
from .config import Config, load_config, parse_config
from .errors import (
    ConfigError,
    Conflict,
    InvalidRequest,
    KVRouterError,
    NoEligibleWorker,
    NotFound,
    Overloaded,
    UnknownPolicy,
)
from .index.workers import WorkerSpec
from .protocols import (
    CacheMode,
    Cleared,
    Completion,
    Decision,
    EventBatch,
    EvictRequest,
    Removed,
    RouteRequest,
    Stored,
    TaskCategory,
    WorkerState,
)
from .router import Router, RouterSettings

__version__ = "0.1.0"

__all__ = [
    "CacheMode",
    "Cleared",
    "Clock",
    "Completion",
    "Config",
    "ConfigError",
    "Conflict",
    "Decision",
    "EventBatch",
    "EvictRequest",
    "InvalidRequest",
    "KVRouterError",
    "ManualClock",
    "NoEligibleWorker",
    "NotFound",
    "Overloaded",
    "Removed",
    "RouteRequest",
    "Router",
    "RouterSettings",
    "Stored",
    "SystemClock",
    "TaskCategory",
    "UnknownPolicy",
    "WorkerSpec",
    "WorkerState",
    "__version__",
    "load_config",
    "parse_config",
]
