"""The bus benchmark (kvrouterd/benchmarks/bus_throughput.py) runs end to end on a real
nats-server, so a broken benchmark fails the suite rather than the next measurement. It
checks what the numbers rest on (every event arrives, the replicas agree), never speed."""

from __future__ import annotations

import argparse

from kvrouterd.benchmarks.bus_throughput import main, table


async def test_the_bus_benchmark_feeds_two_replicas_that_end_identical() -> None:
    args = argparse.Namespace(nats_url="", events=200, blocks_per_event=2, sample_ms=20.0, feed="sdk,bridge")
    rows = await main(args)
    assert [r["feed"] for r in rows] == ["sdk", "bridge"]
    for r in rows:
        assert r["events"] == 200 and r["blocks"] == 400
        assert r["divergence_after"] == 0 and r["catch_up_divergence"] == 0
        assert r["divergence_samples"] >= 1 and r["events_per_s"] > 0
    assert rows[1]["messages"] >= 2  # the bridge's messages: at least one per worker
    assert "events/s" in table(rows).splitlines()[0]
