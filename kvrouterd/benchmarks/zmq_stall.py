"""How long one huge vLLM BlockStored holds the event loop (issue #16 item 1).

    python -m kvrouterd.benchmarks.zmq_stall --tokens 1048576 3500000 --runs 3

A publisher on a real ZMQ socket (127.0.0.1, vLLM's wire: ``[topic, seq, payload]``, the
payload a msgpack batch with one map-encoded ``BlockStored`` of ``--tokens`` tokens in 16-token
blocks) feeds a ``ZmqEventSource`` wired as the daemon wires it (``Router.apply`` per event) in
this process. A probe coroutine on the same loop sleeps ``--probe-ms`` at a time and records how
late it wakes: the worst lateness while the batch is received, decoded and applied is the
longest time the loop was held (the turn that decodes the payload, which stays one call, and
applies the first part); ``loop_max_after_first_part_ms`` is the worst after that turn (one part
each). Also reported: the longest single ``apply`` call (one part), how many apply calls the batch
took, and ``decode_payload``'s time for the payload alone. Medians of ``--runs`` runs as JSON; reports, never asserts (the machine is
shared). ``KVROUTERD_PURE_PYTHON=1`` measures the pure-Python index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from ..clock import ManualClock
from ..events import ZmqEndpoint, ZmqEventsConfig, ZmqEventSource
from ..events.engine_format import decode_payload
from ..index import native
from ..index.workers import WorkerSpec
from ..protocols import BatchOutcome, CacheMode, EventBatch
from ..router import Router, RouterSettings
from .harness import medians

BS = 16
TOPIC = b"kv"


def payload(tokens: int, seed: int) -> bytes:
    """One vLLM batch (map-encoded events, as vLLM >= 0.24) storing ``tokens`` tokens from the root,
    with the fields current vLLM sends: ``extra_keys`` one entry per block (None for plain text),
    the KV cache group and its kind."""
    rng = random.Random(seed)
    blocks = tokens // BS
    ids = [rng.randrange(150_000) for _ in range(blocks * BS)]
    base = rng.getrandbits(62)
    event = {"type": "BlockStored", "block_hashes": list(range(base, base + blocks)), "parent_block_hash": None,
             "token_ids": ids, "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None] * blocks, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    return msgpack.packb([time.time(), [event], 0])


async def one_run(data: bytes, blocks: int, probe_ms: float, part_blocks: int | None) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = Router(RouterSettings(block_size=BS), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS, capacity_blocks=1 << 22))
    calls: list[float] = []
    first_done: list[float] = []

    def apply(batch: EventBatch) -> BatchOutcome:
        t0 = time.perf_counter()
        outcome = router.apply(batch, per_event=True)
        calls.append(time.perf_counter() - t0)
        if not first_done:
            first_done.append(asyncio.get_running_loop().time())
        return outcome

    kw = {} if part_blocks is None else {"max_part_blocks": part_blocks}
    source = ZmqEventSource(ZmqEventsConfig(replay_on_join=False), apply,
                            lambda wid, lost: router.reset_events(wid, lost=lost), ctx=ctx, **kw)
    source.add(ZmqEndpoint("w", f"tcp://127.0.0.1:{port}"))
    while (await pub.recv())[:1] != b"\x01":  # the subscription arrived: nothing is lost
        pass
    late: list[tuple[float, float]] = []  # (went to sleep at, lateness)
    done = asyncio.Event()

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(probe_ms / 1000)
            late.append((t, loop.time() - t - probe_ms / 1000))

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    late.clear()
    calls.clear()
    worker = router.workers.get("w")
    await pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), data])
    while router.index.count(worker.slot) < blocks:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)
    done.set()
    await prober
    await source.close()
    pub.close(0)
    ctx.term()
    # the first turn decodes the payload and applies the first part; the later turns one part each
    after = [lateness for t, lateness in late if t >= first_done[0]]
    return {"loop_max_ms": max(lateness for _, lateness in late) * 1000, "apply_calls": len(calls),
            "longest_apply_ms": max(calls) * 1000,
            "median_apply_ms": statistics.median(calls) * 1000, "loop_max_after_first_part_ms": max(after, default=0.0) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1 << 20, 3_500_000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--probe-ms", type=float, default=0.5)
    ap.add_argument("--part-blocks", type=int, default=None, help="max_part_blocks (default: the module's)")
    args = ap.parse_args()
    out: dict[str, Any] = {"native": native.module is not None, "runs": args.runs}
    for tokens in args.tokens:
        data = payload(tokens, seed=tokens)
        decode = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            decode_payload(data)
            decode.append((time.perf_counter() - t0) * 1000)
        runs = [asyncio.run(one_run(data, tokens // BS, args.probe_ms, args.part_blocks)) for _ in range(args.runs)]
        out[str(tokens)] = {
            "payload_mb": round(len(data) / 1e6, 1),
            "decode_ms": round(statistics.median(decode), 1),
            **medians(runs),
            "loop_max_ms_each": [round(r["loop_max_ms"], 1) for r in runs],
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
