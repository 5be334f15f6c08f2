"""The one exception tree of kvrouterd. ``server/status.py`` maps it to gRPC codes.

    KVRouterError
    ├── ConfigError              bad configuration or policy parameters (start-up)
    │   └── BusUnavailable       the configured event bus cannot be reached (start-up)
    ├── InvalidRequest           malformed input            -> INVALID_ARGUMENT
    │   ├── UnknownPolicy        names a policy not built   -> INVALID_ARGUMENT
    │   └── RejectedEvent        one cache event the router cannot apply (``reason``)
    ├── NotFound                 unknown worker / request   -> NOT_FOUND
    │   └── UnknownModel         a model (or LoRA adapter) no registered worker serves
    ├── Forbidden                well-formed, refused by policy (an event
    │                            endpoint outside events.allowed_endpoints) -> PERMISSION_DENIED
    ├── Conflict                 state forbids the call     -> FAILED_PRECONDITION
    │   └── NoEligibleWorker     nothing can serve it now   -> UNAVAILABLE
    └── Overloaded               over a configured limit    -> RESOURCE_EXHAUSTED
        └── SloUnreachable       predicted to miss its TTFT SLO on every eligible
                                 worker (deadline admission): shed, with a retry hint

Every operation that raises one of these has changed no state. Messages quote client input
through ``quote`` so a megabyte id never becomes a megabyte status message or log line.
"""

from __future__ import annotations

__all__ = [
    "BusUnavailable",
    "ConfigError",
    "Conflict",
    "Forbidden",
    "InvalidRequest",
    "KVRouterError",
    "NoEligibleWorker",
    "NotFound",
    "Overloaded",
    "RejectedEvent",
    "SloUnreachable",
    "UnknownModel",
    "UnknownPolicy",
    "quote",
]

#: characters of a client-supplied value an error message or log line shows
QUOTE_LIMIT = 64


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` of at most about ``limit`` characters, saying how long the original was."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[:limit] + "..."


class KVRouterError(Exception):
    """Base of every error kvrouterd raises on purpose."""


class ConfigError(KVRouterError):
    """A configuration value is wrong; the message names the field.

    Several may be raised at once (``ConfigError(*problems)``, one line each): config loading
    reports every wrong field, not the first, and ``problems`` holds them one per entry.
    """

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems: list[str] = list(problems)


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


class UnknownModel(NotFound):
    """A Route names a model (or adapter) that no registered worker serves, draining or not.

    NOT_FOUND rather than FAILED_PRECONDITION: the name is what is wrong, as an OpenAI server
    answers 404 "model does not exist"; retrying will not help until a worker serving it
    registers. Known workers that serve it but are all draining are ``NoEligibleWorker``."""


class Forbidden(KVRouterError):
    """Well-formed, but the daemon's configuration does not let a caller ask for it."""


class Conflict(KVRouterError):
    """The call is well-formed but the current state does not allow it."""


class NoEligibleWorker(Conflict):
    """No worker is able to take the request (none registered, all draining, empty subset)."""


class Overloaded(KVRouterError):
    """A configured limit would be exceeded."""


class SloUnreachable(Overloaded):
    """Deadline admission shed a request: its predicted TTFT exceeds its SLO wherever it may go.

    ``retry_after_ms`` is how long the predicted backlog takes to drain far enough for the
    request to make its SLO; the daemon sends it as the ``retry-after-ms`` trailer (and as
    Envoy's ``retry-after`` header, in seconds), so a gateway can answer 429 with a hint.
    """

    def __init__(self, message: str, predicted_ms: float, slo_ms: float, retry_after_ms: float) -> None:
        super().__init__(message)
        self.predicted_ms = predicted_ms
        self.slo_ms = slo_ms
        self.retry_after_ms = retry_after_ms
