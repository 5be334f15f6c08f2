"""The ledger of calls the daemon refused or failed: counted in metrics, logged sampled.

Every handler is wrapped at registration (``decoding.wrap_handler``), and the wrapper reports
here how each call that did not succeed ended; RouteStream and ext_proc report their items
(answered on the stream, not as the call's status) themselves. Two kinds:

* a **rejection** (a status a client's request earned: INVALID_ARGUMENT, NOT_FOUND, ...) is
  counted in ``kvrouter_rpc_rejected_total{rpc,code}`` and logged at INFO, at most
  ``LOG_BURST`` lines per RPC and code every ``LOG_INTERVAL_S``, then one line "suppressed K"
  (one client used to write 1 MB/s of log lines, issue #28 item 9). A call the token check
  refuses never reaches a handler: ``security.TokenAuthInterceptor`` reports it here itself,
  as UNAUTHENTICATED at WARNING;
* an **internal error** (an exception no handler expected: a bug) is counted in
  ``kvrouter_internal_errors_total{rpc}``, logged at ERROR once with its traceback (at most
  ``LOG_BURST`` per RPC every ``LOG_INTERVAL_S``), and answered INTERNAL with a short message
  naming the exception's type, never grpc's bare UNKNOWN (issue #28 item 5).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..telemetry.metrics import Metrics
from .logs import SampledLog
from .status import status_message

__all__ = ["LOG_BURST", "LOG_INTERVAL_S", "CallErrors"]

log = logging.getLogger("kvrouterd.server")

#: lines of one kind (RPC and code, or RPC for internal errors) logged per interval
LOG_BURST = 5
#: the interval, seconds
LOG_INTERVAL_S = 10.0


class CallErrors:
    """Counts and sampled logs of refused and failed calls, by RPC (its method's short name)."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self._rejections = SampledLog(log, LOG_BURST, LOG_INTERVAL_S, clock)
        self._internal = SampledLog(log, LOG_BURST, LOG_INTERVAL_S, clock)

    def rejected(self, rpc: str, code: str, message: str, request: object = None, *, level: int = logging.INFO) -> None:
        """A call (or stream item) of ``rpc`` refused with status ``code`` (its name) and
        ``message``; the line names ``request``'s request_id or worker_id where it has one.
        ``level`` raises the line for refusals an operator should see (a caller without a token)."""
        self.metrics.rejected_calls.count(rpc, code)
        extra = {"rpc": rpc, "code": code}
        for field in ("request_id", "worker_id"):
            value = getattr(request, field, None)
            if value and isinstance(value, str):
                extra[field] = value  # the formatters cut a long one (logs.MAX_FIELD_CHARS)
        self._rejections.log((rpc, code), level, "%s rejected (%s): %s", rpc, code, message,
                             what="rejections", extra=extra)

    def served(self, rpc: str) -> None:
        """``rpc`` is served: its internal-error count is exported at zero from now on, so an
        alert's ``increase()`` sees the first error (a counter first seen at 1 hides it)."""
        self.metrics.internal_errors.count(rpc, 0)

    def internal(self, rpc: str, exc: BaseException) -> str:
        """An unexpected exception in ``rpc``'s handler: counted, logged; returns the INTERNAL message."""
        self.metrics.internal_errors.count(rpc)
        self._internal.log(rpc, logging.ERROR, "%s failed: unexpected %s: %s", rpc, type(exc).__name__,
                           status_message(exc)[:200], what="internal errors", exc_info=exc, extra={"rpc": rpc})
        return f"internal error in {rpc} ({type(exc).__name__}); the router logged it"

    def flush(self, now: float | None = None) -> None:
        """Log the "suppressed K" line of every interval that has ended."""
        self._rejections.flush(now)
        self._internal.flush(now)

    def rejected_count(self, rpc: str, code: str) -> int:
        return self.metrics.rejected_calls.counts.get((rpc, code), 0)

    def internal_count(self, rpc: str) -> int:
        return self.metrics.internal_errors.counts.get(rpc, 0)
