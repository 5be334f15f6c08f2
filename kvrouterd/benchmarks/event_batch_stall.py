"""How long one PublishEvents message holds the routing loop, and what Routes see meanwhile
(issue #16 item 1: ``limits.max_event_batch_bytes``, ``limits.max_batch_blocks``).

    python -m kvrouterd.benchmarks.event_batch_stall hold [--runs 5]
    python -m kvrouterd.benchmarks.event_batch_stall probe [--blocks 219000] [--probes 300]

``hold`` (in process): for the worst encodings a publisher may legally send at the limits (as
large as both allow), the time of what the daemon runs on its loop for one message: the
request deserializer (``convert.event_batch_message``: the native reader, or upb for anything
it leaves to the reference), the reference conversion, ``Router.apply``. Also the refusals:
a message over the byte limit, and one over the block limit (which the reference parses, then
refuses). Medians of ``--runs``; run it with KVROUTERD_PURE_PYTHON=1 for the pure path.

``probe`` (over gRPC, ``kvrouterd serve`` in its own process with its default limits): a probe
client sends a small Route every ``--interval-ms`` and times its round trip, first alone, then
while an SDK ``EventPublisher`` pushes one Stored chain of ``--blocks`` blocks (cut by the SDK
into batches under the limits), again and again (each round a fresh worker). A probe's round
trip also holds whatever else the shared machine did, so two figures from inside the daemon
follow: the stalls its watchdog logged (``loop_stall_warn_ms: 10``; ``cpu_ms``: how much of a
stall the loop thread was on a CPU, the rest was other processes), and the loop thread's CPU
per batch while one more chain is published alone. Prints tables; reports, never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

from ..clock import ManualClock
from ..config import LimitsConfig
from ..errors import KVRouterError
from ..index import native
from ..index.workers import WorkerSpec
from ..protocols import CacheMode, EventBatch
from ..router import Router, RouterSettings
from ..server import convert
from ..server.wire import length_delimited
from ..server.wire import varint as _varint
from . import harness
from .stats import latency_summary

BLOCK_SIZE = 16


def _batch(sequence: int, *events: bytes) -> bytes:
    """An EventBatch for worker "w": worker_id (1), sequence (2), events (3) as given (CacheEvent bytes)."""
    return length_delimited(1, b"w") + b"\x10" + _varint(sequence) + b"".join(length_delimited(3, e) for e in events)


def _stored(tokens: bytes, hashes: list[int], unpacked_ids: list[int] | None = None, tail: bytes = b"") -> bytes:
    """A CacheEvent.stored: engine_hashes packed (2), the tokens as token_ids_le32 (8) or one
    ``token_ids`` field (3) per id, block_size (4) 16, and ``tail`` (e.g. an unknown field)."""
    body = length_delimited(2, b"".join(_varint(h) for h in hashes))
    if unpacked_ids is None:
        body += length_delimited(8, tokens)
    else:
        body += b"".join(b"\x18" + _varint(t) for t in unpacked_ids)
    return length_delimited(1, body + b"\x20" + _varint(BLOCK_SIZE) + tail)


def worst_messages(limits: LimitsConfig, seed: int = 0) -> dict[str, bytes]:
    """The largest message of each encoding both limits let through, plus the two refusals.
    Sequence 1 throughout: each is applied to a fresh worker after batch 0."""
    rng = random.Random(seed)
    blocks = limits.max_batch_blocks
    events = blocks // convert.EVENT_BLOCKS  # the most events a batch may carry: each counts at least that
    per = convert.EVENT_BLOCKS
    tokens = blocks * BLOCK_SIZE
    ids = [rng.getrandbits(17) for _ in range(tokens)]  # 17 bits: a 3-byte varint, 4 bytes a field
    hashes = [rng.getrandbits(63) | 1 << 62 for _ in range(blocks)]  # 9-byte varints
    le32 = b"".join(t.to_bytes(4, "little") for t in ids)
    out = {
        "stored, token_ids_le32 (native)": _batch(1, _stored(le32, hashes)),
        "stored, unpacked token_ids (upb)": _batch(1, _stored(b"", hashes, ids)),
        "stored + unknown field (upb)": _batch(1, _stored(le32, hashes, tail=b"\xf8\x01\x01")),
        "removed, 1-byte hashes": _batch(1, length_delimited(2, length_delimited(1, bytes(range(1, 128)) * (blocks // 127)
                                                                                + b"\x01" * (blocks % 127)))),
        f"{events} cleared events": _batch(1, *[length_delimited(3, b"")] * events),
        f"{events} removed events, 1 hash each": _batch(1, *[length_delimited(2, length_delimited(1, b"\x05"))] * events),
        f"{events} stored events, 1 block each": _batch(1, *[_stored(le32[i * 64:(i + 1) * 64], hashes[i:i + 1])
                                                             for i in range(events)]),
        f"{events} stored events, {per} blocks each": _batch(1, *[
            _stored(le32[i * 64 * per:(i + 1) * 64 * per], hashes[i * per:(i + 1) * per]) for i in range(events)]),
    }
    # refused: one block over (parsed by the reference, then refused), and the most bytes an
    # event of tiny hashes packs under the byte limit (refused unread only if over it)
    out["refused: one block over"] = _batch(1, length_delimited(2, length_delimited(1, b"\x01" * (blocks + 1))))
    out[f"refused: {blocks} one-block stored events"] = _batch(1, *[
        _stored(le32[i * 64:(i + 1) * 64], hashes[i:i + 1]) for i in range(blocks)])
    out["refused: over the byte limit"] = _batch(1, length_delimited(8, bytes(limits.max_event_batch_bytes)))
    return out


def _fresh_router() -> Router:
    router = Router(RouterSettings(block_size=BLOCK_SIZE), ManualClock())
    router.add_worker(WorkerSpec("w", "h:1", mode=CacheMode.EVENTS))
    router.apply(EventBatch("w", 0, ()))
    return router


def handle(data: bytes, limits: convert.BatchLimits, router: Router) -> str:
    """What PublishEvents runs on the loop for one message: its outcome."""
    msg = convert.event_batch_message(data, limits)
    if type(msg) is convert.BatchTooLarge:
        return "RESOURCE_EXHAUSTED (unread)"
    try:
        batch = msg if isinstance(msg, EventBatch) else convert.event_batch(msg, limits)  # type: ignore[arg-type]
        outcome = router.apply(batch)
    except KVRouterError as exc:
        return f"refused: {type(exc).__name__}"
    return f"applied {outcome.blocks_stored + outcome.blocks_removed} blocks"


def hold(runs: int) -> list[dict[str, Any]]:
    cfg = LimitsConfig()
    limits = convert.BatchLimits(cfg.max_batch_events, cfg.max_id_length, cfg.max_event_batch_bytes,
                                 cfg.max_batch_blocks, BLOCK_SIZE)
    rows = []
    for name, data in worst_messages(cfg).items():
        times, outcome = [], ""
        for _ in range(runs):
            router = _fresh_router()
            started = time.perf_counter()
            outcome = handle(data, limits, router)
            times.append(time.perf_counter() - started)
        rows.append({"message": name, "KiB": round(len(data) / 1024, 1), "outcome": outcome,
                     "hold_ms_median": round(statistics.median(times) * 1e3, 2),
                     "hold_ms_max": round(max(times) * 1e3, 2)})
    return rows


async def _probe_run(port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from kvrouter_client import EventPublisher

    channel = harness.channel(port)
    route, complete = harness.route_calls(channel)
    await harness.register_worker(channel, "probe-target", "127.0.0.1:9000", capacity_blocks=1 << 22)
    probe_msg = harness.packed_route(args.probe_tokens, 1).SerializeToString()
    rng = random.Random(2)
    chain = [rng.getrandbits(17) for _ in range(args.blocks * BLOCK_SIZE)]
    hashes = list(range(1, args.blocks + 1))
    rounds: list[float] = []
    batches: list[int] = []

    async def probes(n: int) -> list[float]:
        return await harness.probe_routes(route, complete, probe_msg, n, args.interval_ms)

    n = 0

    async def publish_chain() -> float:
        """Publish the chain as a fresh worker, then deregister it; the daemon loop's CPU seconds
        from the first event recorded to the last batch acknowledged."""
        nonlocal n
        n += 1
        started = time.perf_counter()
        async with EventPublisher(f"127.0.0.1:{port}", f"gpu-{n}", block_size=BLOCK_SIZE, timeout=30.0,
                                  probe_interval_s=0, options=[("grpc.max_send_message_length", 64 << 20)]) as pub:
            await pub.register(f"127.0.0.1:{8000 + n}", capacity_blocks=1 << 22)
            cpu = harness.loop_cpu_s(pid)
            pub.stored(chain, engine_hashes=hashes)
            if not await pub.flush(timeout=120):
                raise RuntimeError(f"the chain was not acknowledged: {pub.stats}")
            cpu = harness.loop_cpu_s(pid) - cpu
            batches.append(pub.stats.batches_sealed)
            await pub.deregister()
        rounds.append(time.perf_counter() - started)
        return cpu

    async def publisher(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await publish_chain()

    try:
        quiet, loaded = await harness.quiet_then_loaded(probes, publisher, 1, args.probes)
    except grpc.aio.AioRpcError as exc:
        raise RuntimeError(f"probe failed: {exc.code().name} {exc.details()}") from None
    # the loop's CPU for one chain, nothing else running (its deregistration's drain apart)
    loop_s = await publish_chain()
    await channel.close()
    return {"quiet": latency_summary(quiet), "loaded": latency_summary(loaded),
            "chains": len(rounds), "batches_per_chain": batches[0] if batches else 0,
            "chain_s_median": round(statistics.median(rounds), 2) if rounds else 0.0,
            "loop_ms_per_batch": round(loop_s * 1e3 / max(batches[-1], 1), 2)}


def probe(args: argparse.Namespace) -> dict[str, Any]:
    config = "listen: 127.0.0.1:0\nlimits: {max_message_bytes: 33554432}\ntelemetry: {loop_stall_warn_ms: 10}\n"
    with harness.daemon(config, "event-batch-stall") as daemon:
        result = asyncio.run(_probe_run(daemon.port, daemon.pid, args))
    stalls = harness.watchdog_stalls(daemon.warnings)
    result["stalls"] = [{"blocked_ms": s["blocked_ms"], "cpu_ms": s.get("cpu_ms", 0.0),
                         "running": s.get("msg", "")[:160]} for s in stalls]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    h = sub.add_parser("hold", help="one message's loop hold, in process")
    h.add_argument("--runs", type=int, default=5)
    p = sub.add_parser("probe", help="Route stalls while the SDK publishes a long chain")
    p.add_argument("--blocks", type=int, default=219_000)
    harness.add_probe_arguments(p)
    args = parser.parse_args(argv)
    path = "native" if native.module is not None else "pure Python"
    if args.what == "hold":
        harness.print_table(hold(args.runs), f"one PublishEvents message at the default limits ({path}; medians of "
                                             f"{args.runs}; load {os.getloadavg()[0]:.2f})")
        return
    result = probe(args)
    rows = [{"phase": phase, **result[phase]} for phase in ("quiet", "loaded")]
    harness.print_table(rows, f"small Routes, alone then while the SDK publishes {args.blocks}-block chains "
                              f"({result['chains']} chains of {result['batches_per_chain']} batches, "
                              f"{result['chain_s_median']} s each; load {os.getloadavg()[0]:.2f})")
    print(f"daemon loop's CPU per batch (receive, read, apply), one chain alone: {result['loop_ms_per_batch']} ms")
    if result["stalls"]:
        harness.print_table(result["stalls"],
                            "stalls the daemon's watchdog logged (>= 10 ms; cpu_ms: the loop thread on a CPU)")
    else:
        print("stalls the daemon's watchdog logged (>= 10 ms): none")


if __name__ == "__main__":
    main()
