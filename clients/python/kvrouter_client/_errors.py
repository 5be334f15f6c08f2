"""The SDK's exceptions.

    KVRouterClientError
    ├── RouterUnavailable    the router could not be reached in time (UNAVAILABLE,
    │                        DEADLINE_EXCEEDED, or it has no eligible worker right now)
    └── RouterRejected       the router answered with an error (bad input, unknown
                             worker or request, over a limit); ``code`` says which
"""

from __future__ import annotations

import grpc

__all__ = ["KVRouterClientError", "RouterRejected", "RouterUnavailable", "from_rpc_error", "from_status"]

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


def from_rpc_error(exc: grpc.RpcError, what: str) -> KVRouterClientError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return from_status(code, details, what)


def from_status(code: grpc.StatusCode | None, details: str, what: str) -> KVRouterClientError:
    """The error for a call (or a stream message) that ended with ``code``."""
    message = f"{what}: {code.name if code else 'error'}: {details}"
    if code in TRANSIENT_CODES:
        return RouterUnavailable(message, code)
    return RouterRejected(message, code)

