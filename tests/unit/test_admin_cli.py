"""`kvrouterd status`: the table and JSON it prints, against a real daemon, and its failures."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.admin import format_stats
from kvrouterd.cli import main
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon

STATS = pb.GetStatsResponse(
    indexed_blocks=123456,
    default_routing_policy="cache_aware",
    default_eviction_policy="lru",
    decisions_by_policy={"cache_aware": 1500, "round_robin": 2},
    event_batches_applied=77,
    event_gaps=1,
    workers=[
        pb.Worker(id="gpu-1", address="10.0.0.2:8000", mode=pb.CACHE_STATE_MODE_APPROXIMATE,
                  state=pb.WORKER_STATE_READY, cached_blocks=10, capacity_blocks=20000),
        pb.Worker(id="gpu-0", address="10.0.0.1:8000", mode=pb.CACHE_STATE_MODE_EVENTS,
                  state=pb.WORKER_STATE_DEGRADED, cached_blocks=123446, inflight_requests=3,
                  pending_prefill_tokens=4096),
    ],
)


def test_table_shows_policies_index_and_each_worker_with_mode_and_state():
    text = format_stats(STATS, "router:50051")
    assert text.splitlines()[0] == "kvrouterd router:50051"
    assert "indexed blocks   123,456" in text
    assert "77 applied, 1 gaps" in text
    assert "cache_aware=1,500, round_robin=2" in text
    assert "2 (1 approximate/ready, 1 events/degraded)" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("gpu-")]
    assert rows == [
        ["gpu-0", "10.0.0.1:8000", "events", "degraded", "123,446", "-", "3", "4,096"],
        ["gpu-1", "10.0.0.2:8000", "approximate", "ready", "10", "20,000", "0", "0"],
    ]


def test_no_workers_is_said_plainly():
    assert "workers          0 (none)" in format_stats(pb.GetStatsResponse(default_routing_policy="random"))


async def _with_daemon(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "workers": [
        {"id": "w0", "address": "10.1.1.1:8000", "mode": "events", "capacity_blocks": 500},
        {"id": "w1", "address": "10.1.1.2:8000"},
    ]}))
    port = await daemon.start()
    try:
        # the CLI blocks on a synchronous channel: run it beside the daemon's loop
        code = await asyncio.to_thread(main, ["status", "--target", f"127.0.0.1:{port}", *argv])
    finally:
        await daemon.stop(grace=0.1)
    out, err = capsys.readouterr()
    return code, out, err


async def test_status_against_a_running_daemon(capsys):
    code, out, _ = await _with_daemon([], capsys)
    assert code == 0
    assert "routing policy   cache_aware" in out
    assert "2 (1 approximate/ready, 1 events/ready)" in out
    assert any(line.split()[:4] == ["w0", "10.1.1.1:8000", "events", "ready"] for line in out.splitlines())


async def test_status_json(capsys):
    code, out, _ = await _with_daemon(["--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["indexed_blocks"] == 0 and doc["default_routing_policy"] == "cache_aware"
    workers = {w["id"]: w for w in doc["workers"]}
    assert workers["w0"]["mode"] == "CACHE_STATE_MODE_EVENTS" and workers["w0"]["capacity_blocks"] == 500
    assert workers["w1"]["mode"] == "CACHE_STATE_MODE_APPROXIMATE"


def test_unreachable_daemon_exits_1_with_the_grpc_status(capsys):
    code = main(["status", "--target", "127.0.0.1:1", "--timeout", "2"])
    _, err = capsys.readouterr()
    assert code == 1 and "127.0.0.1:1: UNAVAILABLE" in err


def test_missing_ca_file_exits_2(capsys, tmp_path):
    code = main(["status", "--target", "127.0.0.1:1", "--ca-file", str(tmp_path / "nope.crt")])
    _, err = capsys.readouterr()
    assert code == 2 and "nope.crt" in err


async def test_status_lists_a_fleet_past_4_mib_of_descriptions(capsys):
    """300 workers with legal 16,000-character labels: GetStats alone passed the CLI channel's
    default 4 MiB receive limit and status failed RESOURCE_EXHAUSTED (issue #28 item 8)."""
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "workers": [
        {"id": f"w{i:03}", "address": f"10.1.{i // 250}.{i % 250}:8000", "labels": {"note": "x" * 16_000}}
        for i in range(300)
    ]}))
    port = await daemon.start()
    try:
        code = await asyncio.to_thread(main, ["status", "--target", f"127.0.0.1:{port}"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "workers          300 (300 approximate/ready)" in out
        assert sum(line.startswith("w") for line in out.splitlines()) == 300
        code = await asyncio.to_thread(main, ["status", "--target", f"127.0.0.1:{port}", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        doc = json.loads(out)
        assert doc["worker_count"] == 300 and [w["id"] for w in doc["workers"]] == [f"w{i:03}" for i in range(300)]
    finally:
        await daemon.stop(grace=0.1)
