"""Engine events through the NATS event bus into two replicas: throughput, divergence under
load, catch-up (docs/deploy.md, "NATS JetStream").

    python -m kvrouterd.benchmarks.bus_throughput                    # starts its own nats-server
    python -m kvrouterd.benchmarks.bus_throughput --nats-url nats://127.0.0.1:4222 --events 50000

Two feeds, each into two replicas (``Daemon`` objects in this process, on one event loop with
the publishers, so a number is a lower bound on what separate processes would do):

* ``sdk``: two ``NatsEventPublisher`` engines publish ``--events`` ``Stored`` events of
  ``--blocks-per-event`` blocks (one in ten followed by a ``Removed``), as fast as they can;
* ``bridge``: two ZMQ PUB sockets publish the same events as vLLM 0.26 encodes them (msgpack
  maps), one batch per event; ``kvrouterd bridge``'s ``BusBridge`` republishes them.

While the engines publish, every ``--sample-ms`` the two replicas' stream positions are
sampled (how many messages apart, each one's lag behind the stream), and their indexes are
compared whenever the positions differ and once a second: the blocks held by one replica and
not the other, summed over workers (one process sees both at the same instant). Both replicas
run on one event loop, so they read each message back to back; separate processes drift
further apart, by at most their lags. Then a third replica starts cold and restores the stream (no snapshot: full replay),
and a fourth restores a snapshot written at the end plus the (empty) tail: time to SERVING.
Reports a table, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack

from .harness import table_lines
from .nats_server import NatsServer

BLOCK_SIZE = 16
WORKERS = ("gpu-0", "gpu-1")


class Events:
    """The engines' events: per worker, root chains of random tokens and some evictions."""

    def __init__(self, events: int, blocks: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.per_worker: dict[str, list[tuple[str, list[int], list[int]]]] = {w: [] for w in WORKERS}
        next_hash = 1
        for i in range(events):
            w = WORKERS[i % len(WORKERS)]
            hashes = list(range(next_hash, next_hash + blocks))
            next_hash += blocks
            self.per_worker[w].append(("stored", hashes, [rng.randrange(1 << 17) for _ in range(blocks * BLOCK_SIZE)]))
            if i % 10 == 9:
                self.per_worker[w].append(("removed", [hashes[-1]], []))
        self.stored_events = events
        self.blocks = events * blocks


def _replica_config(url: str, *, stream: str, bucket: str, endpoints: dict[str, str] | None = None) -> dict[str, Any]:
    workers = [{"id": w, "address": f"{w}.local:8000", "capacity_blocks": 10_000_000, "mode": "events",
                **({"kv_events_endpoint": endpoints[w]} if endpoints else {})} for w in WORKERS]
    return {"listen": "127.0.0.1:0", "block_size": BLOCK_SIZE, "workers": workers,
            "telemetry": {"log_level": "warning"},
            # the benchmark's engines publish on loopback under named worker addresses
            "events": {"allowed_endpoints": ["127.0.0.0/8"], "bus": {"kind": "nats", "url": url, "stream": stream, "subject_prefix": f"bench.{stream}",
                               "snapshot_bucket": bucket, "snapshot_interval_s": 0,
                               "replica_sync": {"stream": f"{stream}_LOAD", "subject": f"benchload.{stream}"}}}}


async def _start_replica(config: dict[str, Any]) -> Any:
    from ..config import parse_config
    from ..server.app import Daemon

    daemon = Daemon(parse_config(config))
    await daemon.start()
    return daemon


def _divergence(a: Any, b: Any) -> int:
    """Blocks one replica holds for a worker and the other does not, summed over workers."""
    diff = 0
    for w in WORKERS:
        ka = {blk.key for blk in a.router.index.blocks_of(a.router.workers.get(w).slot)}
        kb = {blk.key for blk in b.router.index.blocks_of(b.router.workers.get(w).slot)}
        diff += len(ka ^ kb)
    return diff


async def _stream_end(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.last_seq)


async def _run_feed(name: str, url: str, events: Events, sample_s: float,
                    publish: Callable[[], Awaitable[None]], replicas: list[Any], js: Any, stream: str) -> dict[str, Any]:
    samples: list[int] = []
    lags: list[int] = []
    apart: list[int] = []
    done = asyncio.Event()

    async def sampler() -> None:
        # Comparing the indexes walks every block (tens of ms at 10^5 blocks, stealing the loop
        # from the replicas), so it runs when the replicas stand at different stream positions
        # and once a second; at equal positions two replicas hold the same index by construction
        # (same stream prefix, applied in order), which the once-a-second comparison checks.
        last_full = 0.0
        while not done.is_set():
            a, b = (r.bus.stats.last_stream_sequence for r in replicas)
            apart.append(abs(a - b))
            lags.append(max(0, max(r.bus.stats.pending for r in replicas)))
            now = time.perf_counter()
            if a != b or now - last_full >= 1.0:
                samples.append(_divergence(*replicas))
                last_full = now
            try:
                await asyncio.wait_for(done.wait(), sample_s)
            except TimeoutError:
                pass

    start = time.perf_counter()
    sampling = asyncio.create_task(sampler())
    await publish()
    published = time.perf_counter()
    end = await _stream_end(js, stream)
    while any(r.bus.stats.last_stream_sequence < end for r in replicas):
        await asyncio.sleep(0.005)
    applied = time.perf_counter()
    done.set()
    await sampling
    final = _divergence(*replicas)
    seconds = applied - start
    return {
        "feed": name, "events": events.stored_events, "blocks": events.blocks, "messages": end,
        "publish_s": round(published - start, 3), "applied_s": round(seconds, 3),
        "events_per_s": round(events.stored_events / seconds), "blocks_per_s": round(events.blocks / seconds),
        "position_samples": len(apart), "divergence_samples": len(samples), "divergence_median": statistics.median(samples) if samples else 0,
        "divergence_max": max(samples, default=0), "divergence_after": final,
        "lag_max_messages": max(lags, default=0), "apart_max_messages": max(apart, default=0),
    }


async def _sdk_feed(url: str, events: Events, sample_s: float, js: Any) -> dict[str, Any]:
    from kvrouter_client import NatsEventPublisher

    stream = "BENCH_SDK"
    replicas = [await _start_replica(_replica_config(url, stream=stream, bucket="BENCH_SDK_SNAP")) for _ in range(2)]
    try:
        async def publish() -> None:
            pubs = [NatsEventPublisher(url, w, stream=stream, subject_prefix=f"bench.{stream}", block_size=BLOCK_SIZE,
                                       max_buffered_batches=1_000_000) for w in WORKERS]
            for p in pubs:
                await p.start()
            for kind_hashes in zip(*events.per_worker.values(), strict=False):
                for pub, (kind, hashes, tokens) in zip(pubs, kind_hashes, strict=True):
                    if kind == "stored":
                        pub.stored(tokens, engine_hashes=hashes)
                    else:
                        pub.removed(hashes)
                await asyncio.sleep(0)
            for p in pubs:
                await p.flush(120)
                await p.close()

        row = await _run_feed("sdk", url, events, sample_s, publish, replicas, js, stream)
        row.update(await _catch_up(url, stream, "BENCH_SDK_SNAP", replicas[0], js))
        return row
    finally:
        for r in replicas:
            await r.stop(grace=0)


async def _bridge_feed(url: str, events: Events, sample_s: float, js: Any) -> dict[str, Any]:
    import zmq
    import zmq.asyncio

    from ..config import parse_config
    from ..server.bridge import BridgeProcess

    stream = "BENCH_BRIDGE"
    ctx = zmq.asyncio.Context()
    pubs = {}
    endpoints = {}
    for w in WORKERS:
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, 0)  # no drops: the benchmark measures the bus, not ZMQ's HWM
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        pubs[w] = sock
        endpoints[w] = f"tcp://127.0.0.1:{port}"
    config = _replica_config(url, stream=stream, bucket="BENCH_BRIDGE_SNAP", endpoints=endpoints)
    replicas = [await _start_replica(config) for _ in range(2)]
    bridge = BridgeProcess(parse_config(config))
    try:
        await bridge.start()
        for sock in pubs.values():
            await asyncio.wait_for(sock.recv(), 10)  # the bridge's subscription arrived

        async def publish() -> None:
            seqs = dict.fromkeys(WORKERS, 0)
            for kind_hashes in zip(*events.per_worker.values(), strict=False):
                for w, (kind, hashes, tokens) in zip(WORKERS, kind_hashes, strict=True):
                    if kind == "stored":  # vLLM >= 0.24: events as maps, the batch as [ts, events, rank]
                        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                              "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU"}
                    else:
                        ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
                    payload = msgpack.packb([time.time(), [ev], 0])
                    await pubs[w].send_multipart([b"", seqs[w].to_bytes(8, "big"), payload])
                    seqs[w] += 1
                await asyncio.sleep(0)
            total = sum(seqs.values())
            while bridge.bridge.stats.batches < total:
                await asyncio.sleep(0.005)
            await bridge.bridge.drained(120)

        row = await _run_feed("bridge", url, events, sample_s, publish, replicas, js, stream)
        row.update(await _catch_up(url, stream, "BENCH_BRIDGE_SNAP", replicas[0], js))
        return row
    finally:
        await bridge.stop()
        for r in replicas:
            await r.stop(grace=0)
        for sock in pubs.values():
            sock.close(0)
        ctx.term()


async def _catch_up(url: str, stream: str, bucket: str, source: Any, js: Any) -> dict[str, Any]:
    """A cold replica replaying the whole stream, then one restoring a snapshot: time to SERVING."""
    from ..server.snapshot import encode_snapshot

    t = time.perf_counter()
    cold = await _start_replica(_replica_config(url, stream=stream, bucket=f"{bucket}_NONE"))
    cold_s = time.perf_counter() - t
    same = _divergence(cold, source)
    await cold.stop(grace=0)
    await source.bus.save_snapshot(encode_snapshot(source.router, source.bus.stats.last_stream_sequence))
    t = time.perf_counter()
    warm = await _start_replica(_replica_config(url, stream=stream, bucket=bucket))
    warm_s = time.perf_counter() - t
    same += _divergence(warm, source)
    await warm.stop(grace=0)
    return {"catch_up_replay_s": round(cold_s, 3), "catch_up_snapshot_s": round(warm_s, 3),
            "catch_up_divergence": same}


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    import logging

    import nats

    logging.getLogger("kvrouterd").setLevel(logging.WARNING)
    server = None
    try:
        if not args.nats_url:
            server = NatsServer(Path(tempfile.mkdtemp(prefix="kvrouterd-bench-nats-")))
            try:
                server.start()
            except RuntimeError as exc:
                raise SystemExit(f"{exc}; or pass --nats-url") from None
        url = args.nats_url or server.url  # type: ignore[union-attr]
        events = Events(args.events, args.blocks_per_event)
        rows = []
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            for feed in args.feed.split(","):
                run = {"sdk": _sdk_feed, "bridge": _bridge_feed}[feed]
                rows.append(await run(url, events, args.sample_ms / 1000, js))
        finally:
            await nc.close()
    finally:
        if server is not None:  # started or not, its store directory goes
            server.stop()
            shutil.rmtree(server.store_dir, ignore_errors=True)
    return rows


COLUMNS = (("feed", "feed"), ("events", "events"), ("blocks", "blocks"), ("messages", "bus msgs"),
           ("applied_s", "s to both"), ("events_per_s", "events/s"), ("blocks_per_s", "blocks/s"),
           ("position_samples", "samples"), ("divergence_samples", "compared"), ("divergence_median", "diverge med"), ("divergence_max", "diverge max"),
           ("divergence_after", "diverge after"), ("lag_max_messages", "lag max"), ("apart_max_messages", "apart max"),
           ("catch_up_replay_s", "replay s"), ("catch_up_snapshot_s", "snapshot s"), ("catch_up_divergence", "c/u diff"))


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[h for _, h in COLUMNS]] + [[str(r[k]) for k, _ in COLUMNS] for r in rows]
    return "\n".join(table_lines(cells, right_from=0))


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrouterd.benchmarks.bus_throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats-url", default="", help="an existing NATS server with JetStream (default: start one)")
    parser.add_argument("--events", type=int, default=20_000, help="Stored events over both engines")
    parser.add_argument("--blocks-per-event", type=int, default=4)
    parser.add_argument("--sample-ms", type=float, default=100.0, help="divergence sampling interval during load")
    parser.add_argument("--feed", default="sdk,bridge", help="comma-separated: sdk, bridge")
    parser.add_argument("--json", action="store_true", help="one JSON object per feed instead of a table")
    args = parser.parse_args(argv)
    import uvloop

    rows = uvloop.run(main(args))
    print("\n".join(json.dumps(r) for r in rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
