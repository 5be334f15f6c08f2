"""The SDK's retry schedule is the daemon's: one policy, written twice because the SDK installs alone."""

from __future__ import annotations

import random

import kvrouter_client._backoff as sdk
import kvrouterd.retry as daemon


def test_the_sdk_waits_by_the_daemons_schedule():
    assert (sdk.MULTIPLIER, sdk.JITTER) == (daemon.MULTIPLIER, daemon.JITTER)
    for initial, cap in ((0.05, 5.0), (0.5, 30.0), (0.1, 0.1)):
        a, b = random.Random(3), random.Random(3)
        ours, theirs = sdk.Backoff(initial, cap), daemon.Backoff(initial, cap)
        assert [ours.delay(n, a) for n in range(1, 40)] == [theirs.delay(n, b) for n in range(1, 40)]

