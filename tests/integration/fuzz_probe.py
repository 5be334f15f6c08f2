"""The long fuzz run's prober, in a process of its own (``test_fuzz_grpc.py``)::

    python -m tests.integration.fuzz_probe --port 50051 --worker probe-worker --out probe.json

Routes an 8-block prompt to ``--worker`` and completes it, in a loop, until SIGTERM or SIGINT,
(it prints ``ready`` once it handles them), then writes ``[[started, seconds], ...]`` (``time.monotonic()``, which every process on the
machine shares, so the fuzzer can tell which of its calls each Route overlapped). Its own
process keeps the fuzzer's garbage collections and GIL out of the Routes it times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time

import grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

BS = 16


async def probe(port: int, worker: str) -> list[tuple[float, float]]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    timings: list[tuple[float, float]] = []
    prompt = list(range(100_000, 100_000 + 8 * BS))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.KVRouterStub(channel)
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            await stub.Route(pb.RouteRequest(token_ids=prompt, request_id=f"probe-{n}", candidate_workers=[worker]),
                             timeout=30)
            timings.append((started, time.monotonic() - started))
            await stub.Complete(pb.CompleteRequest(request_id=f"probe-{n}"), timeout=30)
            await asyncio.sleep(0.002)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    timings = asyncio.run(probe(args.port, args.worker))
    with open(args.out, "w") as out:
        json.dump(timings, out)


if __name__ == "__main__":
    main()
