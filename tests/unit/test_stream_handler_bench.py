"""``kvrouterd bench``'s in-process RouteStream figure drives the daemon's real handler as the
streamed load does: every Route it sends is answered by a prefix-match decision and completed,
so the fleet it measures stays as loaded as the live load leaves it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvrouterd.benchmarks import stream_inprocess
from kvrouterd.benchmarks.workload import build_router


@pytest.mark.parametrize("mode", ["daemon", "observed"])
def test_every_streamed_route_is_decided_by_its_prefix_and_completed(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    stop = stream_inprocess.Daemon.stop

    async def stop_and_look(self: Any, grace: float = 5.0) -> None:
        seen["hits"] = dict(self.router.prefix_hits)
        seen["in_flight"] = sum(w.inflight_requests for w in self.router.workers)
        seen["in_flight_bytes"] = self.router.inflight_bytes
        await stop(self, grace)

    monkeypatch.setattr(stream_inprocess.Daemon, "stop", stop_and_look)
    _, prompt = build_router(1, 1000)
    messages = 4
    cost = stream_inprocess.stream_handler_cost(mode, 8, 2_000, prompt, messages)

    assert 0 < cost["us_min"] <= cost["us_median"] and math.isfinite(cost["us_median"])
    hits = seen["hits"]["cache_aware"]
    # a warm-up run and RUNS measured runs, each stream sending PER_STREAM Routes per message
    routed = (stream_inprocess.RUNS + 1) * stream_inprocess.STREAMS * stream_inprocess.PER_STREAM * messages
    assert (hits.best, hits.worse, hits.no_prefix) == (routed, 0, 0)
    assert seen["in_flight"] == 0 and seen["in_flight_bytes"] == 0
