"""Faults on the event bus with real processes: ``kvrouterd serve`` replicas as subprocesses
against a real nats-server, killed with SIGKILL, paused with SIGSTOP, or started without a bus."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import nats
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvrouter_client import NatsEventPublisher

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.benchmarks.nats_server import NatsServer, free_port
from kvrouterd.events.nats_bus import LAG_WARN_MESSAGES, worker_subject
from tests.integration.test_nats_bus import BS, WORKERS, Engine, stream_last_seq


class Replica:
    """One ``kvrouterd serve`` process with JSON logs in a file."""

    def __init__(self, tmp: Path, url: str, name: str, **bus: Any) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.config = tmp / f"{name}.yaml"
        self.config.write_text(yaml.safe_dump({
            "listen": f"127.0.0.1:{self.port}",
            "block_size": BS,
            "metrics": {"listen": f"127.0.0.1:{self.metrics_port}"},
            "workers": [{"id": w, "address": f"{w}.local:8000", "capacity_blocks": 100_000, "mode": "events"}
                        for w in WORKERS],
            "events": {"bus": {"kind": "nats", "url": url, "connect_timeout_s": 2, **bus}},
        }))
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self) -> None:
        self.runs += 1
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvrouterd", "serve", "--config", str(self.config), "--log-format", "json"],
                stdout=log, stderr=log,
            )

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "replica not SERVING in time"
                time.sleep(0.05)

    def channel(self) -> grpc.Channel:
        """A channel to the replica, held (``with``) for its calls and closed after, as
        ``wait_serving``'s is: the stubs were made over channels nobody held or closed."""
        return grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def engine_hashes(self) -> dict[str, list[int]]:
        """Per worker, the engine hash of every block the replica holds (ExportIndex), unsorted."""
        out: dict[str, list[int]] = {w: [] for w in WORKERS}
        with self.channel() as ch:
            for chunk in router_pb2_grpc.KVRouterStub(ch).ExportIndex(pb.ExportIndexRequest(), timeout=10):
                out[chunk.worker.id] += list(chunk.engine_hashes)
        return out

    def stats(self) -> pb.GetStatsResponse:
        with self.channel() as ch:
            return router_pb2_grpc.KVRouterStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)

    def logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def metric(self, name: str) -> float:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def replicas(tmp_path: Path, nats_server: NatsServer) -> Iterator[list[Replica]]:
    made: list[Replica] = []
    yield made
    for r in made:
        r.stop()


async def until(cond: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, f"{what} not reached in time"
        await asyncio.sleep(0.05)


async def snapshot_sequence(url: str) -> int:
    """The stream sequence the bus's current snapshot was taken at (0: none yet)."""
    from nats.js.errors import BucketNotFoundError, ObjectNotFoundError

    nc = await nats.connect(url)
    try:
        store = await nc.jetstream().object_store("KVROUTER_SNAPSHOTS")
        # the replica replaces the object every 0.3 s; a read racing that never ends (nats-py)
        data = (await asyncio.wait_for(store.get("KVROUTER_EVENTS"), 5)).data
    except (BucketNotFoundError, ObjectNotFoundError, TimeoutError):
        return 0
    finally:
        await nc.close()
    (n,) = struct.unpack_from(">I", data, 8)
    return int(json.loads(data[12:12 + n])["stream_sequence"])


def batches_applied(replica: Replica) -> int:
    return replica.stats().event_batches_applied


async def test_a_replica_killed_with_sigkill_restarts_warm_from_snapshot_and_tail_with_nothing_lost_or_doubled(
    tmp_path: Path, nats_server: NatsServer, replicas: list[Replica]
) -> None:
    victim = Replica(tmp_path, nats_server.url, "victim", snapshot_interval_s=0.3)
    replicas.append(victim)
    victim.start()
    await asyncio.to_thread(victim.wait_serving)
    rng = random.Random(21)
    async with (NatsEventPublisher(nats_server.url, WORKERS[0], block_size=BS, linger_s=0) as p0,
                NatsEventPublisher(nats_server.url, WORKERS[1], block_size=BS, linger_s=0) as p1):
        engines = [Engine(p0, rng, 1_000), Engine(p1, rng, 1 << 40)]
        for step in range(60):
            engines[step % 2].store_chain(rng.randint(1, 5))
            if step % 4 == 3:
                engines[step % 2].evict_some()
        assert await p0.flush(10) and await p1.flush(10)
        first_phase = await stream_last_seq(nats_server.url)
        # a snapshot that covers the first phase, then the process dies with no chance to clean up
        await until(lambda: asyncio.run(snapshot_sequence(nats_server.url)) >= first_phase, what="snapshot")
        victim.kill(signal.SIGKILL)
        for step in range(30):  # the stream goes on while the replica is dead: the tail
            engines[step % 2].store_chain(rng.randint(1, 3))
            engines[step % 2].evict_some()
        assert await p0.flush(10) and await p1.flush(10)
    stream_end = await stream_last_seq(nats_server.url)
    snapshot_at = await snapshot_sequence(nats_server.url)
    assert first_phase <= snapshot_at < stream_end

    victim.start()
    await asyncio.to_thread(victim.wait_serving)  # SERVING only once the tail is applied
    held = await asyncio.to_thread(victim.engine_hashes)
    for i, w in enumerate(WORKERS):
        assert len(held[w]) == len(set(held[w])), f"{w}: a block is listed twice"
        assert set(held[w]) == set(engines[i].held), f"{w}: blocks lost or kept after eviction"
    stats = await asyncio.to_thread(victim.stats)
    assert stats.event_gaps == 0 and all(w.state == pb.WORKER_STATE_READY for w in stats.workers)
    # it restored the snapshot and read only the stream after it
    second_run = victim.logs()
    restored = [e for e in second_run if e["msg"] == "index restored from the bus snapshot"]
    assert restored and restored[-1]["stream_sequence"] == snapshot_at and restored[-1]["blocks"] > 0
    follow = [e for e in second_run if e["msg"] == "following the event bus"][-1]
    assert follow["from"] == snapshot_at + 1 and follow["backlog"] == stream_end - snapshot_at
    assert await asyncio.to_thread(victim.metric, "kvrouter_bus_messages_total") == stream_end - snapshot_at


async def test_a_paused_replica_catches_up_and_says_it_was_behind(
    tmp_path: Path, nats_server: NatsServer, replicas: list[Replica]
) -> None:
    """SIGSTOP stands for a replica whose event loop stalls (a long GC, a snapshot encode, a
    starved CPU) while the stream advances by more than LAG_WARN_MESSAGES."""
    slow, steady = (Replica(tmp_path, nats_server.url, n, snapshot_interval_s=0) for n in ("slow", "steady"))
    replicas += [slow, steady]
    for r in (slow, steady):
        r.start()
    for r in (slow, steady):
        await asyncio.to_thread(r.wait_serving)
    nc = await nats.connect(nats_server.url)
    subject = worker_subject("kvrouter.events", WORKERS[0])
    # a backlog the resumed replica cannot apply between two reads of its socket, so the lag
    # check overdue at SIGCONT sees it behind (3x once sufficed, before ingest got faster)
    n = LAG_WARN_MESSAGES * 10
    try:
        slow.kill(signal.SIGSTOP)
        for seq in range(n):  # one block per batch, the chain growing from the last
            stored = pb.StoredBlocks(token_ids=[seq] * BS, block_size=BS, engine_hashes=[seq + 1])
            if seq:
                stored.parent_engine_hash = seq
            await nc.publish(subject, pb.EventBatch(worker_id=WORKERS[0], sequence=seq,
                                                    events=[pb.CacheEvent(stored=stored)]).SerializeToString())
        await nc.flush()
        await until(lambda: batches_applied(steady) == n, what="the steady replica applies the stream")
        await asyncio.sleep(0.5)  # the stream is ahead of the paused replica by all of it
        slow.kill(signal.SIGCONT)
        await until(lambda: batches_applied(slow) == n, what="the paused replica catches up")
    finally:
        await nc.close()
    assert await stream_last_seq(nats_server.url) == n
    for r in (slow, steady):
        held = await asyncio.to_thread(r.engine_hashes)
        assert sorted(held[WORKERS[0]]) == list(range(1, n + 1))
        stats = await asyncio.to_thread(r.stats)
        assert stats.event_gaps == 0
    # the lag was seen and reported: a warning, "caught up" after it (within a lag check), metrics
    await until(lambda: any(e["msg"].startswith("caught up with the event stream") for e in slow.logs()),
                timeout=10, what="'caught up' logged")
    msgs = [e["msg"] for e in slow.logs()]
    behind = [m for m in msgs if m.startswith("replica is ") and m.endswith("behind the event stream")]
    assert behind and any(m.startswith("caught up with the event stream") for m in msgs[msgs.index(behind[0]):])
    assert await asyncio.to_thread(slow.metric, "kvrouter_bus_lag_episodes_total") == 1
    assert await asyncio.to_thread(slow.metric, "kvrouter_bus_pending_messages") == 0
    assert await asyncio.to_thread(slow.metric, "kvrouter_bus_stream_skips_total") == 0


def test_kvrouterd_serve_exits_2_naming_the_url_when_the_bus_is_unreachable(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    config = tmp_path / "kvrouterd.yaml"
    config.write_text(yaml.safe_dump({"listen": "127.0.0.1:0",
                                      "events": {"bus": {"kind": "nats", "url": url, "connect_timeout_s": 0.5}}}))
    done = subprocess.run([sys.executable, "-m", "kvrouterd", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"events.bus: cannot reach NATS at {url}" in done.stdout



async def test_a_replica_is_not_serving_while_it_waits_for_the_bus(nats_server: NatsServer) -> None:
    """grpc's health servicer answers SERVING for "" until told otherwise; the probes ask "",
    so a replica still restoring or catching up must say NOT_SERVING there."""
    from kvrouterd.config import parse_config
    from kvrouterd.server.app import Daemon
    from tests.integration.test_nats_bus import replica_config

    assert nats_server.proc is not None
    nats_server.proc.send_signal(signal.SIGSTOP)  # the bus answers nothing for now
    daemon = Daemon(parse_config(replica_config(nats_server.url, connect_timeout_s=5)))
    starting = asyncio.create_task(daemon.start())
    try:
        while not daemon.port:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            for _ in range(3):
                status = (await check(health_pb2.HealthCheckRequest(service=""), timeout=2)).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                await asyncio.sleep(0.1)
            # as docs/deploy.md says: not ready, but alive (a liveness probe must not kill it)
            ready = (await check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)).status
            alive = (await check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)).status
            assert (ready, alive) == (health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as unlisted:
                await check(health_pb2.HealthCheckRequest(service="kvrouter.v1.KVRouter"), timeout=2)
            assert unlisted.value.code() == grpc.StatusCode.NOT_FOUND
            nats_server.proc.send_signal(signal.SIGCONT)
            await starting
            status = (await check(health_pb2.HealthCheckRequest(service=""), timeout=2)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        nats_server.proc.send_signal(signal.SIGCONT)
        if not starting.done():
            starting.cancel()
        await daemon.stop(grace=0)
