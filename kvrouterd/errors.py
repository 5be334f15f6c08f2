"""The one exception tree of kvrouterd. ``server/status.py`` maps it to gRPC codes.

    KVRouterError
    ├── ConfigError              bad configuration or policy parameters (start-up)
    │   └── BusUnavailable       the configured event bus cannot be reached (start-up)
    ├── InvalidRequest           malformed input            -> INVALID_ARGUMENT
    │   ├── UnknownPolicy        names a policy not built   -> INVALID_ARGUMENT
    │   └── RejectedEvent        one cache event the router cannot apply (``reason``)
    ├── NotFound                 unknown worker / request   -> NOT_FOUND
    ├── Conflict                 state forbids the call     -> FAILED_PRECONDITION
    │   └── NoEligibleWorker     nothing can serve it now   -> UNAVAILABLE
    └── Overloaded               over a configured limit    -> RESOURCE_EXHAUSTED

Every operation that raises one of these has changed no state.
"""

from __future__ import annotations

__all__ = [
    "BusUnavailable",
    "ConfigError",
    "Conflict",
    "InvalidRequest",
    "KVRouterError",
    "NoEligibleWorker",
    "NotFound",
    "Overloaded",
    "RejectedEvent",
    "UnknownPolicy",
]


class KVRouterError(Exception):
    """Base of every error kvrouterd raises on purpose."""


class ConfigError(KVRouterError):
    """A configuration value is wrong; the message names the field."""


class BusUnavailable(ConfigError):
    """The configured event bus (events.bus) cannot be reached or set up at start-up."""


class InvalidRequest(KVRouterError):
    """The caller sent something malformed."""


class UnknownPolicy(InvalidRequest):
    """A policy name that is not registered or not configured."""


class RejectedEvent(InvalidRequest):
    """One cache event that cannot be applied; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotFound(KVRouterError):
    """A worker or request id the router does not know."""


class Conflict(KVRouterError):
    """The call is well-formed but the current state does not allow it."""


class NoEligibleWorker(Conflict):
    """No worker is able to take the request (none registered, all draining, empty subset)."""


class Overloaded(KVRouterError):
    """A configured limit would be exceeded."""
