"""The SDK's one retry schedule: how long the event publisher waits between failed streams.

The same schedule as the daemon's (``kvrouterd.retry``; the SDK installs on its own and does
not import the daemon, so the constants are repeated here and a test holds them equal): the
n-th wait of a run of failures is ``initial_s * MULTIPLIER ** (n - 1)``, capped at ``max_s``,
then shortened by a random fraction of at most ``JITTER``, so engines that lost the router
together do not come back in lockstep. A success starts it over.

Where the SDK waits for a connection rather than a time, gRPC's own connection backoff does
the waiting (``_channel.channel_options``: from ``reconnect_initial_s`` up to
``CONNECT_BACKOFF_MAX_S``), with gRPC's multiplier (1.6) and jitter (+-20%), which a channel
does not let its caller set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``attempt``-th failure in a row (1 = the first)."""
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt - 1, 64))
        return base * (1.0 - self.jitter * (rng or random).random())
