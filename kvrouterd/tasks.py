"""Stopping the daemon's background tasks: cancelled again until they have ended, within a bound.

Python 3.11's ``asyncio.wait_for`` can lose a cancellation that arrives as its inner await
completes (CPython gh-86296): it returns the result and the task carries on as if never
cancelled. The daemon's loops wait that way (a ZMQ subscriber receives with a silence timeout,
the bus reads snapshots with one), so one ``task.cancel()`` may not end them: code that then
awaits the task once hangs, and code that drops it leaks the loop and its sockets (a 10^6-call
fuzz run met "Too many open files"). Every task the daemon stops goes through ``stop_task`` (or, from
code that cannot await, ``Stopping``): cancelled, then cancelled again every ``RECANCEL_S`` while
it runs, for at most ``STOP_TIMEOUT_S`` in all, and logged at ERROR if it still refuses to end.

The SDK's event publisher stops its loops the same way (``kvrouter_client._publisher``); the
SDK does not import the daemon, so each package keeps its own few lines.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["RECANCEL_S", "STOP_TIMEOUT_S", "Stopping", "stop_task"]

log = logging.getLogger("kvrouterd.tasks")

#: longest wait for a cancelled task to end, in all, seconds
STOP_TIMEOUT_S = 10.0
#: a task still running this long after a cancel is cancelled again, seconds: long enough that
#: a task's own clean-up (closing a socket or an HTTP session) is rarely cut short by the next
#: cancel, short enough that a lost one costs little
RECANCEL_S = 0.5


async def stop_task(task: asyncio.Task[Any] | None, timeout: float = STOP_TIMEOUT_S) -> bool:
    """Cancel ``task`` until it has ended, waiting at most ``timeout`` seconds in all; True
    if it ended (or was None). A task that ended by an exception other than its cancellation
    raises it here, as awaiting the task would; one that outlives ``timeout`` is logged and
    left running (False), so a stuck task cannot hang the daemon's shutdown for good."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    cancels = 0
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            log.error("task %s did not end within %.1fs of being cancelled %d times; left running",
                      task.get_name(), timeout, cancels)
            return False
        if cancels:
            log.warning("task %s still running %.1fs after it was cancelled; cancelling it again",
                        task.get_name(), RECANCEL_S)
        if cancels or not task.cancelling():  # the caller's own cancel counts as the first
            task.cancel()
        cancels += 1
        await asyncio.wait({task}, timeout=min(RECANCEL_S, left))  # never cancels the task itself
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc
    return True


class Stopping:
    """Tasks stopped in the background for code that cannot await (a membership change, a
    replaced subscriber): each is cancelled at once and then as ``stop_task`` does; ``wait``
    returns once every one has ended or been given up on."""

    def __init__(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._stoppers: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Tasks still being stopped."""
        return len(self._stoppers)

    def add(self, task: asyncio.Task[Any]) -> None:
        """Stop ``task``; a failure it ended with is logged, as no caller awaits it."""
        task.cancel()  # now, so a task that honours it ends on its next turn of the loop
        stopper = asyncio.get_running_loop().create_task(self._stop(task), name=f"stop {task.get_name()}")
        self._stoppers.add(stopper)
        stopper.add_done_callback(self._stoppers.discard)

    async def _stop(self, task: asyncio.Task[Any]) -> None:
        try:
            await stop_task(task, self.timeout)
        except Exception:
            log.exception("task %s had failed before it was stopped", task.get_name())

    async def wait(self) -> None:
        """Until every task given to ``add`` so far has ended or been given up on."""
        while self._stoppers:
            await asyncio.wait(set(self._stoppers))
