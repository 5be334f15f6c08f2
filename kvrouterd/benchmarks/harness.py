"""The stall benchmarks' shared driver: everything around a scenario.

A stall benchmark's module declares its scenario (the daemon's config, what the hostile client
sends, which figures it reports); from here it takes ``daemon`` (``kvrouterd serve`` in a
process of its own for a ``with`` block), clients on connections of their own and the fleet
they register, the probes (alone, then while the hostile clients run), the daemon's own view of
its event loop (``loop_cpu_s``, ``watchdog_stalls``), ``medians`` over repeated runs and the
printed table. The figures themselves (percentiles, a probe run's summary) are ``stats``'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from .._generated.kvrouter.v1 import router_pb2 as pb
from .serve_process import ServeProcess

ROUTE = "/kvrouter.v1.KVRouter/Route"
ROUTE_STREAM = "/kvrouter.v1.KVRouter/RouteStream"
COMPLETE = "/kvrouter.v1.KVRouter/Complete"
REGISTER = "/kvrouter.v1.KVRouter/RegisterWorker"


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser, described by its docstring's first paragraph."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_probe_arguments(parser: argparse.ArgumentParser, *, probe_tokens: bool = True) -> None:
    """``--probes`` (300), ``--interval-ms`` (5) between them and, for Route probes, their
    ``--probe-tokens`` (4,000)."""
    parser.add_argument("--probes", type=int, default=300)
    if probe_tokens:
        parser.add_argument("--probe-tokens", type=int, default=4000)
    parser.add_argument("--interval-ms", type=float, default=5.0)


@contextmanager
def daemon(config_yaml: str, name: str) -> Iterator[ServeProcess]:
    """``kvrouterd serve`` on ``config_yaml`` (written to ``<name>.yaml`` in a directory of its
    own), serving for the block's length, then stopped with SIGTERM."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / f"{name}.yaml"
        config.write_text(config_yaml)
        process = ServeProcess(config)
        process.start()
        try:
            yield process
        finally:
            process.stop()


def channel(port: int, max_message_bytes: int = 64 << 20) -> grpc.aio.Channel:
    """A client on a connection of its own to the daemon on ``port``."""
    # no shared subchannel: a probe must not queue behind the hostile client's bytes on one
    # HTTP/2 connection, which would measure the client's socket, not the daemon
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes)])


def route_calls(channel: grpc.aio.Channel) -> tuple[Any, Any]:
    """Route (its request already serialized) and Complete on ``channel``."""
    route = channel.unary_unary(ROUTE, request_serializer=None, response_deserializer=pb.RouteResponse.FromString)
    complete = channel.unary_unary(COMPLETE, request_serializer=pb.CompleteRequest.SerializeToString,
                                   response_deserializer=pb.CompleteResponse.FromString)
    return route, complete


def complete_message(request_id: str) -> pb.CompleteRequest:
    """What the SDK's ``RouterClient.complete(result)`` sends with its defaults."""
    return pb.CompleteRequest(request_id=request_id, cached_tokens=-1, success=True)


def packed_route(tokens: int, seed: int) -> pb.RouteRequest:
    """A Route of ``tokens`` random token ids packed in ``token_ids_le32``, as the SDK sends them."""
    return pb.RouteRequest(token_ids_le32=random.Random(seed).randbytes(tokens * 4))


async def register_worker(channel: grpc.aio.Channel, worker_id: str, address: str, *,
                          mode: pb.CacheStateMode = pb.CACHE_STATE_MODE_EVENTS, capacity_blocks: int = 0) -> None:
    """RegisterWorker ``worker_id`` at ``address`` (event-driven unless ``mode`` says otherwise)."""
    register = channel.unary_unary(REGISTER, request_serializer=pb.RegisterWorkerRequest.SerializeToString,
                                   response_deserializer=pb.RegisterWorkerResponse.FromString)
    await register(pb.RegisterWorkerRequest(worker=pb.Worker(
        id=worker_id, address=address, mode=mode, capacity_blocks=capacity_blocks)))


async def register_workers(channel: grpc.aio.Channel, count: int, *,
                           mode: pb.CacheStateMode = pb.CACHE_STATE_MODE_EVENTS, capacity_blocks: int = 0) -> None:
    """Workers ``gpu-0`` .. ``gpu-<count - 1>`` at ``127.0.0.1:8000`` and up."""
    for w in range(count):
        await register_worker(channel, f"gpu-{w}", f"127.0.0.1:{8000 + w}", mode=mode, capacity_blocks=capacity_blocks)


async def probe_loop(one: Callable[[], Awaitable[float]], n: int, interval_ms: float) -> list[float]:
    """``n`` probes one after another, ``interval_ms`` apart: what each ``one()`` timed, seconds."""
    out = []
    for _ in range(n):
        out.append(await one())
        await asyncio.sleep(interval_ms / 1000)
    return out


async def probe_routes(route: Any, complete: Any, probe_msg: bytes, n: int, interval_ms: float) -> list[float]:
    """``n`` small Routes (each completed) one after another, ``interval_ms`` apart: their round
    trips, seconds."""
    async def one() -> float:
        started = time.perf_counter()
        reply = await route(probe_msg)
        took = time.perf_counter() - started
        await complete(complete_message(reply.request_id))
        return took

    return await probe_loop(one, n, interval_ms)


async def quiet_then_loaded(
    probes: Callable[[int], Awaitable[list[float]]], hog: Callable[[asyncio.Event], Awaitable[None]],
    hogs: int, n: int,
) -> tuple[list[float], list[float]]:
    """``n`` probes alone, then ``n`` more while ``hogs`` copies of ``hog`` run until told to stop
    (after 20 warm-up probes, and 0.2 s for the hogs to get going)."""
    await probes(20)  # warm up connections and caches
    quiet = await probes(n)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(hog(stop)) for _ in range(hogs)]
    await asyncio.sleep(0.2)
    loaded = await probes(n)
    stop.set()
    await asyncio.gather(*tasks)
    return quiet, loaded


def loop_cpu_s(pid: int) -> float:
    """CPU time of ``pid``'s main thread, the daemon's event loop (schedstat: nanoseconds on CPU)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def watchdog_stalls(log_lines: Sequence[str]) -> list[dict[str, Any]]:
    """The stalls the daemon's watchdog logged (json records carrying ``blocked_ms``)."""
    out = []
    for line in log_lines:
        if '"blocked_ms"' not in line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short as the daemon stopped
            continue
    return out


def medians(runs: Sequence[Mapping[str, float]], digits: int = 2) -> dict[str, float]:
    """Each figure's median over ``runs`` (the keys of the first run, in its order), rounded."""
    return {key: round(statistics.median(run[key] for run in runs), digits) for key in runs[0]}


def table_lines(rows: Sequence[Sequence[str]], *, right_from: int | None = None, rule: bool = False) -> list[str]:
    """``rows`` (the first the heading) as columns two spaces apart, aligned left, or right from
    column ``right_from`` on; ``rule``: a line of dashes under the heading."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(width) if right_from is not None and i >= right_from else cell.ljust(width)
                               for i, (cell, width) in enumerate(zip(row, widths, strict=True))))
        if rule and n == 0:
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    return lines


def print_table(records: Sequence[Mapping[str, Any]], title: str) -> None:
    """``title``, then ``records`` as a table whose heading is the first record's keys."""
    print(title)
    columns = list(records[0])
    for line in table_lines([columns, *([str(r[c]) for c in columns] for r in records)]):
        print(line)
