"""The long fuzz run's prober, in a process of its own (``test_fuzz_grpc.py``)::

    python -m tests.integration.fuzz_probe --port 50051 --worker probe-worker --out probe.json \
        [--policies ,min_ttft,preble,dualmap,lbgr]

Routes an 8-block prompt to ``--worker`` and completes it, in a loop, until SIGTERM or SIGINT,
(it prints ``ready`` once it handles them), then writes ``{"timings": [[started, seconds], ...],
"statuses": {code: count}}`` (``time.monotonic()``, which every process on the machine shares,
so the fuzzer can tell which of its calls each Route overlapped). Its own process keeps the
fuzzer's garbage collections and GIL out of the Routes it times.

Its Routes take turns over ``--policies`` (``""`` = the default): a hostile client that poisons a
policy's online fit breaks routing for everyone on it (issue #28 item 1), so the probe, an
innocent client, counts the status of each Route, and the fuzzer expects only OK.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter

import grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

BS = 16


async def probe(port: int, worker: str, policies: list[str]) -> tuple[list[tuple[float, float]], Counter[str]]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    timings: list[tuple[float, float]] = []
    statuses: Counter[str] = Counter()
    prompt = list(range(100_000, 100_000 + 8 * BS))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.KVRouterStub(channel)
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            try:
                await stub.Route(pb.RouteRequest(token_ids=prompt, request_id=f"probe-{n}", candidate_workers=[worker],
                                                 policy=policies[n % len(policies)]), timeout=30)
            except grpc.aio.AioRpcError as exc:
                statuses[exc.code().name] += 1
                await asyncio.sleep(0.002)
                continue
            statuses["OK"] += 1
            timings.append((started, time.monotonic() - started))
            await stub.Complete(pb.CompleteRequest(request_id=f"probe-{n}"), timeout=30)
            await asyncio.sleep(0.002)
    return timings, statuses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--policies", default="", help="comma-separated routing policies to take turns over")
    args = parser.parse_args()
    timings, statuses = asyncio.run(probe(args.port, args.worker, args.policies.split(",")))
    with open(args.out, "w") as out:
        json.dump({"timings": timings, "statuses": dict(statuses)}, out)


if __name__ == "__main__":
    main()
