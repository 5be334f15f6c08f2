"""The daemon's one retry schedule (``kvrouterd.retry``), and that every retrying loop waits by it."""

from __future__ import annotations

import random

import pytest

from kvrouterd.events.bridge import BRIDGE_PUBLISH_BACKOFF
from kvrouterd.events.zmq_config import ZmqEventsConfig
from kvrouterd.events.zmq_source import reconnect_backoff
from kvrouterd.retry import JITTER, MULTIPLIER, Backoff


class Fixed(random.Random):
    """A random source that always draws ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def test_the_schedule_doubles_from_initial_to_max_and_jitter_only_shortens():
    policy = Backoff(0.5, 30.0)
    assert (policy.multiplier, policy.jitter) == (MULTIPLIER, JITTER) == (2.0, 0.2)
    longest = [policy.delay(n, Fixed(0.0)) for n in range(1, 10)]
    assert longest == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    shortest = [policy.delay(n, Fixed(1.0)) for n in range(1, 10)]
    assert shortest == pytest.approx([0.8 * d for d in longest])
    rng = random.Random(7)
    for n in range(1, 200):  # max_s stays a true ceiling, however long the run of failures
        assert 0.8 * longest[min(n, 9) - 1] <= policy.delay(n, rng) <= longest[min(n, 9) - 1]


@pytest.mark.parametrize("bad", [(0.0, 1.0), (2.0, 1.0), (0.1, 1.0, 0.5), (0.1, 1.0, 2.0, 1.0)])
def test_a_schedule_that_cannot_work_is_refused(bad):
    with pytest.raises(ValueError, match="backoff"):
        Backoff(*bad)


async def test_retrying_waits_by_the_schedule_and_lets_other_errors_through():
    retrying = Backoff(0.1, 0.4, jitter=0.0).retrying(OSError)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    retrying.sleep = sleep
    calls = 0
    async for attempt in retrying:
        with attempt:
            calls += 1
            if calls <= 5:
                raise OSError("down")
    assert calls == 6 and slept == pytest.approx([0.1, 0.2, 0.4, 0.4, 0.4])

    with pytest.raises(KeyError):
        async for attempt in Backoff(0.1, 0.4).retrying(OSError):
            with attempt:
                raise KeyError("not retried")


def test_each_loop_takes_its_bounds_from_its_config():
    assert reconnect_backoff(ZmqEventsConfig(reconnect_ivl_ms=200, reconnect_ivl_max_ms=3000)) == Backoff(0.2, 3.0)
    assert reconnect_backoff(ZmqEventsConfig()) == Backoff(0.1, 10.0)
    assert BRIDGE_PUBLISH_BACKOFF == Backoff(0.05, 2.0)
