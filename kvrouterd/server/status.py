"""The one place that maps kvrouterd's exception tree to gRPC status codes (and, for ext_proc, HTTP)."""

from __future__ import annotations

import math
from typing import NoReturn

import grpc

from ..errors import Conflict, Forbidden, InvalidRequest, KVRouterError, NoEligibleWorker, NotFound, Overloaded, SloUnreachable

__all__ = ["MAX_STATUS_MESSAGE_BYTES", "RETRY_AFTER_METADATA", "abort", "http_status", "retry_after_ms", "status_code",
           "status_message"]

#: trailing metadata of a shed Route (``SloUnreachable``): milliseconds after which a retry
#: may be admitted, as a decimal integer
RETRY_AFTER_METADATA = "retry-after-ms"

#: longest status message sent, UTF-8 bytes. It travels percent-encoded in the grpc-message
#: trailer, and clients refuse trailers over 8 KiB (16 KiB hard): an unbounded message turns
#: the real status into RESOURCE_EXHAUSTED "Stream removed"
MAX_STATUS_MESSAGE_BYTES = 1024


def status_message(exc: BaseException | str) -> str:
    """The error's message, cut to ``MAX_STATUS_MESSAGE_BYTES`` (messages quote client input
    through ``errors.quote`` already; this is the backstop)."""
    text = str(exc)
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_STATUS_MESSAGE_BYTES:
        return text
    return data[: MAX_STATUS_MESSAGE_BYTES - 20].decode("utf-8", "ignore") + " ...(truncated)"


def status_code(exc: KVRouterError) -> grpc.StatusCode:
    """INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNAVAILABLE, FAILED_PRECONDITION, RESOURCE_EXHAUSTED."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, Forbidden):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, NoEligibleWorker):
        # retryable: workers may register or finish draining
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, Conflict):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def retry_after_ms(exc: KVRouterError) -> float | None:
    """The retry hint an error carries (deadline admission's shed), or None."""
    return exc.retry_after_ms if isinstance(exc, SloUnreachable) else None


async def abort(context: grpc.aio.ServicerContext, exc: KVRouterError) -> NoReturn:
    """End a gRPC call with ``exc``'s status and message (and ``retry-after-ms`` when it has a hint)."""
    retry_ms = retry_after_ms(exc)
    if retry_ms is None:
        await context.abort(status_code(exc), status_message(exc))
    else:
        await context.abort(status_code(exc), status_message(exc),
                            trailing_metadata=((RETRY_AFTER_METADATA, str(math.ceil(retry_ms))),))
    raise AssertionError("unreachable")  # pragma: no cover - abort raises


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
    if isinstance(exc, Forbidden):
        return 403
    return 500
