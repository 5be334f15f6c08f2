"""The one place that maps kvrouterd's exception tree to gRPC status codes."""

from __future__ import annotations

import grpc

from ..errors import Conflict, InvalidRequest, KVRouterError, NoEligibleWorker, NotFound, Overloaded

__all__ = ["status_code"]


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
