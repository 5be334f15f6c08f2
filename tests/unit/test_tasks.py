"""kvrouterd.tasks: a cancelled task is cancelled again until it has ended, within a bound."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import pytest

from kvrouterd.tasks import Stopping, stop_task


def stubborn(swallowed: list[bool]) -> asyncio.Task[None]:
    """A task that loses its first cancellation, as one inside Python 3.11's wait_for may."""

    async def run() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    return asyncio.create_task(run(), name="stubborn")


async def test_a_task_that_lost_a_cancellation_is_cancelled_again_until_it_ends():
    swallowed: list[bool] = []
    task = stubborn(swallowed)
    await asyncio.sleep(0)
    assert await asyncio.wait_for(stop_task(task), 5)
    assert swallowed and task.cancelled()


async def test_the_wait_for_race_of_gh_86296_is_survived():
    # the inner future completes and the task is cancelled in the same turn of the loop: on
    # Python 3.11 wait_for returns the result and the cancellation is gone
    results: list[int] = []
    futures: list[asyncio.Future[int]] = []

    async def receive() -> None:
        while True:
            fut = asyncio.get_running_loop().create_future()
            futures.append(fut)
            results.append(await asyncio.wait_for(fut, 3600))

    task = asyncio.create_task(receive())
    await asyncio.sleep(0)
    futures[0].set_result(1)
    assert await asyncio.wait_for(stop_task(task), 5)
    assert task.cancelled()
    # the first cancel was lost where wait_for still has the race (fixed in 3.12)
    assert results == [1] and len(futures) == 2 or sys.version_info >= (3, 12)


async def test_a_task_that_refuses_to_end_is_given_up_on_and_logged(caplog):
    release = asyncio.Event()

    async def refuses() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = asyncio.create_task(refuses(), name="refuses")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="kvrouterd.tasks"):
        started = asyncio.get_running_loop().time()
        assert not await stop_task(task, timeout=1.2)
        assert asyncio.get_running_loop().time() - started < 3
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "refuses" in errors[0].getMessage() and "left running" in errors[0].getMessage()
    assert not task.done()
    release.set()
    await task


async def test_a_task_that_failed_raises_as_awaiting_it_would():
    async def fails() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ValueError("broken clean-up") from None

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken clean-up"):
        await stop_task(task)
    assert await stop_task(None)


async def test_stopping_in_the_background_ends_every_task():
    swallowed: list[list[bool]] = [[] for _ in range(5)]
    tasks = [stubborn(s) for s in swallowed]
    await asyncio.sleep(0)
    stopping = Stopping()
    for task in tasks:
        stopping.add(task)  # from code that cannot await, as a membership change
    assert len(stopping) == 5
    await asyncio.wait_for(stopping.wait(), 5)
    assert len(stopping) == 0 and all(t.cancelled() for t in tasks) and all(swallowed)


async def test_stopping_logs_what_a_task_failed_with_instead_of_raising_it(caplog):
    async def fails() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ValueError("broken clean-up") from None

    task = asyncio.create_task(fails(), name="fails")
    await asyncio.sleep(0)
    stopping = Stopping()
    with caplog.at_level(logging.ERROR, logger="kvrouterd.tasks"):
        stopping.add(task)
        await asyncio.wait_for(stopping.wait(), 5)
    assert [r.getMessage() for r in caplog.records] == ["task fails had failed before it was stopped"]
    assert caplog.records[0].exc_info is not None
