"""The daemon's one retry policy: how long each of its reconnect and resend loops waits between attempts.

Every loop that retries without end waits by a ``Backoff`` and retries through tenacity
(``Backoff.retrying``), so they behave alike and differ only in their bounds:

=====================================  =================  =============================================
loop                                   initial .. max     configured by
=====================================  =================  =============================================
Kubernetes discovery (list and watch)  0.5 .. 30 s        ``discovery.backoff_initial_s`` / ``_max_s``
ZMQ subscriber: a silent socket        0.1 .. 10 s        ``events.reconnect_ivl_ms`` / ``_max_ms``
ZMQ subscriber that failed, restarted  0.1 .. 10 s        the same
event-bus bridge: one publish          0.05 .. 2 s        ``events.bridge.BRIDGE_PUBLISH_BACKOFF``
=====================================  =================  =============================================

The schedule: the n-th wait of a run of failures is ``initial_s * MULTIPLIER ** (n - 1)``,
capped at ``max_s``, then shortened by a random fraction of at most ``JITTER``. The jitter
keeps replicas and subscribers that failed together (a restarted API server, a bus outage)
from retrying in lockstep; shortening rather than lengthening keeps ``max_s`` a true ceiling.
A success starts the schedule over. The SDK's event publisher waits by the same schedule
(``kvrouter_client._backoff``, which repeats these constants: the SDK does not import the
daemon; a test holds the two equal).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import tenacity

__all__ = ["JITTER", "MULTIPLIER", "Backoff"]

#: growth of the wait after each failure in a row
MULTIPLIER = 2.0
#: largest fraction a wait is shortened by at random
JITTER = 0.2


@dataclass(frozen=True, slots=True)
class Backoff:
    """A retry schedule: waits from ``initial_s`` growing by ``multiplier`` up to ``max_s``."""

    initial_s: float
    max_s: float
    multiplier: float = MULTIPLIER
    jitter: float = JITTER

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"a backoff needs 0 < initial_s <= max_s, multiplier >= 1 and 0 <= jitter < 1: {self}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``attempt``-th failure in a row (1 = the first)."""
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt - 1, 64))
        return base * (1.0 - self.jitter * (rng or random).random())

    def wait(self) -> Callable[[tenacity.RetryCallState], float]:
        """This schedule as a tenacity wait strategy."""
        return lambda state: self.delay(state.attempt_number)

    def retrying(
        self,
        retry_on: type[BaseException] | tuple[type[BaseException], ...],
        before_sleep: Callable[[tenacity.RetryCallState], Awaitable[None] | None] | None = None,
    ) -> tenacity.AsyncRetrying:
        """Retry on ``retry_on`` without end, waiting by this schedule (``async for attempt in
        ...: with attempt: ...``). ``before_sleep`` sees each failure and the wait to come
        (``state.outcome``, ``state.upcoming_sleep``); anything else raised goes through."""
        return tenacity.AsyncRetrying(
            wait=self.wait(), retry=tenacity.retry_if_exception_type(retry_on),
            before_sleep=before_sleep, reraise=True,
        )
