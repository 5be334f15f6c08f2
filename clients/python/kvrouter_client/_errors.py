"""The SDK's exceptions.

    KVRouterClientError
    ├── RouterUnavailable    the router could not be reached in time (UNAVAILABLE,
    │                        DEADLINE_EXCEEDED, or it has no eligible worker right now)
    └── RouterRejected       the router answered with an error (bad input, unknown
        │                    worker or request, over a limit); ``code`` says which
        └── RouterOverloaded the router shed the call (RESOURCE_EXHAUSTED): over a load
                             limit, or predicted to miss its TTFT SLO (deadline admission);
                             a gateway answers ``http_status`` (429) with ``retry_after_ms``
"""

from __future__ import annotations

import re

import grpc

__all__ = ["RETRY_AFTER_METADATA", "KVRouterClientError", "RouterOverloaded", "RouterRejected", "RouterUnavailable",
           "from_rpc_error", "from_status"]

#: trailing metadata of a shed Route: milliseconds after which a retry may be admitted
RETRY_AFTER_METADATA = "retry-after-ms"
_RETRY_IN_MESSAGE = re.compile(r"retry after ([\d,]+) ms")

#: codes after which retrying or failing open is reasonable
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


class KVRouterClientError(Exception):
    """Base of every error the SDK raises on purpose."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class RouterUnavailable(KVRouterClientError):
    """The router did not answer in time or has nothing to route to; retrying may help."""


class RouterRejected(KVRouterClientError):
    """The router refused the call; retrying the same call will fail again."""


class RouterOverloaded(RouterRejected):
    """The router shed the call to protect the fleet (RESOURCE_EXHAUSTED).

    Failing open would send the request to an engine the router judged unable to serve it in
    time, so the SDK does not: a gateway answers ``http_status`` (429 Too Many Requests, with
    ``Retry-After`` from ``retry_after_ms`` when the router gave a hint) and the client
    retries later. ``retry_after_ms`` is None when the limit was not load (a prompt over
    ``limits.max_prompt_tokens`` says so in the message)."""

    http_status = 429

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retry_after_ms: float | None = None) -> None:
        super().__init__(message, code)
        self.retry_after_ms = retry_after_ms


def from_rpc_error(exc: grpc.RpcError, what: str) -> KVRouterClientError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    retry_ms = None
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_AFTER_METADATA:
            try:
                retry_ms = float(value)
            except ValueError:
                retry_ms = None
    return from_status(code, details, what, retry_ms)


def from_status(code: grpc.StatusCode | None, details: str, what: str,
                retry_after_ms: float | None = None) -> KVRouterClientError:
    """The error for a call (or a stream message) that ended with ``code``; a stream item
    carries no metadata, so a shed one's hint is read from its message."""
    message = f"{what}: {code.name if code else 'error'}: {details}"
    if code in TRANSIENT_CODES:
        return RouterUnavailable(message, code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if retry_after_ms is None and (hint := _RETRY_IN_MESSAGE.search(details or "")):
            retry_after_ms = float(hint[1].replace(",", ""))
        return RouterOverloaded(message, code, retry_after_ms)
    return RouterRejected(message, code)

