"""The one place that maps kvrouterd's exception tree to gRPC status codes (and, for ext_proc, HTTP)."""

from __future__ import annotations

import grpc

from ..errors import Conflict, InvalidRequest, KVRouterError, NoEligibleWorker, NotFound, Overloaded

__all__ = ["http_status", "status_code"]


def status_code(exc: KVRouterError) -> grpc.StatusCode:
    """INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, FAILED_PRECONDITION, RESOURCE_EXHAUSTED."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, NoEligibleWorker):
        # retryable: workers may register or finish draining
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, Conflict):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def http_status(exc: KVRouterError) -> int:
    """The HTTP status an endpoint picker answers with (Envoy ext_proc ImmediateResponse).

    400 malformed body, 503 no eligible endpoint (the endpoint-picker protocol's "no ready
    endpoints"), 429 shed (its "request should be dropped"), 404 unknown worker, 500 else.
    """
    if isinstance(exc, InvalidRequest):
        return 400
    if isinstance(exc, NoEligibleWorker):
        return 503
    if isinstance(exc, Overloaded):
        return 429
    if isinstance(exc, NotFound):
        return 404
    return 500
