"""Instructions per streamed Route + Complete in the daemon's RouteStream handler, counted by
callgrind: a figure a busy machine does not move, to compare commits by.

``grpc_stream_route_server_cpu_us`` and even the in-process ``grpc_stream_handler_cpu_us_in_process``
(``stream_inprocess``) swing 10-20% between runs of one tree on a shared 2-core machine, more than
most single changes to the handler save. Callgrind counts the instructions the process runs,
whatever else the machine does. This runs ``stream_inprocess``'s streamed load (its warm-up run
alone) in a child under ``valgrind --tool=callgrind`` twice, with ``SHORT`` and ``LONG`` messages
per stream, and divides the difference in instructions by the difference in Routes: start-up,
imports and the index's population cancel out. ``client`` is the same load against an in-process
handler that answers every item with a constant (``grpc_bench.TrivialService``): the bench's own
side of the loop (cutting messages, reading answers) and the deserializing and serialising any
handler pays, so ``daemon - client`` is what the daemon's code costs. ``floor`` is the load
against ``grpc_bench.FloorService``, the floor of any Python router (hash, walk, pick, answer),
so ``daemon - floor`` is what validation, deadline admission, the ledger, the eviction model and
metrics cost.

Only the main thread is counted (callgrind's ``--separate-threads``): it runs the load and
every handler. The daemon's other threads (the event loop's watchdog, metric readers) work by
the clock, not by the Route, and under callgrind, where the clock runs ~50x slower, their
instructions made most of the difference between two runs of one tree (at b98c82d, per Route
+ Complete: 285.6k and 283.6k over every thread, 284.2k and 284.0k over the main thread).

Callgrind counts instructions, not time: a cache miss counts as one instruction, and a copy
``rep movsb`` makes counts one per byte, so glibc's ``memcpy`` is told to use its vector loop at
every size (``GLIBC_TUNABLES``), where a 16 kB prompt's copy would otherwise read as 16k
instructions. What drains with time (deadline admission's backlog, recency) is still read at
other values from run to run.

    python -m kvrouterd.benchmarks.instructions                # daemon, deadline_off, floor, client
    python -m kvrouterd.benchmarks.instructions --modes daemon --json

Needs valgrind on PATH (``apt-get install valgrind``); without it says so and exits 2. Each mode
takes ~1.5 minutes (two runs under callgrind, ~50x slower than native).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from typing import Any

#: messages per stream in the two runs whose difference is counted
SHORT, LONG = 20, 60
#: the fleet the load routes over (``stream_inprocess``; a smaller index than the timed figure's
#: 10^6 blocks, which would take callgrind minutes to populate: a Route's walk reads 250 blocks
#: either way)
WORKERS, BLOCKS = 64, 10_000
MODES = ("daemon", "deadline_off", "floor", "client")
#: glibc's memcpy without ``rep movsb``, which callgrind counts byte by byte
_NO_REP_MOVSB = "glibc.cpu.x86_rep_movsb_threshold=4294967295"


async def _drive_service(service_class: type, prompt: list[int], messages: int, *args: Any) -> None:
    """The streamed load against ``service_class(*args)``, a ``grpc_bench`` servicer, given what
    ``_one_stream`` reads of the daemon's service: the batch size it advertises and its deserializer."""
    import asyncio

    from .._generated.kvrouter.v1 import router_pb2 as pb
    from .grpc_bench import stream_items
    from .stream_inprocess import STREAMS, _one_stream

    class InProcess(service_class):  # type: ignore[valid-type, misc]
        stream_batch_bytes = 64 << 20  # what grpc_bench's servicers advertise
        route_stream_message = staticmethod(pb.RouteStreamRequest.FromString)

    service = InProcess(*args)
    route_item, complete_item = stream_items(pb.RouteRequest(token_ids_le32=array("I", prompt).tobytes()))
    await asyncio.gather(*(_one_stream(service, route_item, complete_item, messages, [0.0]) for _ in range(STREAMS)))


def drive(mode: str, messages: int) -> int:
    """Run the streamed load once in this process (``mode``: one of ``MODES``); returns the
    Routes it sent."""
    import uvloop

    from ..config import parse_config
    from ..server.app import Daemon
    from .grpc_bench import FloorService, TrivialService, daemon_settings
    from .stream_inprocess import PER_STREAM, STREAMS, _measure
    from .workload import build_router, populate

    _, prompt = build_router(1, 1000)
    if mode == "client":
        uvloop.run(_drive_service(TrivialService, prompt, messages))
    elif mode == "floor":  # over a daemon's index populated as for "daemon", as grpc_bench serves it
        router = Daemon(parse_config(daemon_settings(mode))).router
        populate(router, WORKERS, BLOCKS)
        uvloop.run(_drive_service(FloorService, prompt, messages, router))
    else:
        uvloop.run(_measure(mode, WORKERS, BLOCKS, prompt, messages, timed_runs=0))
    return STREAMS * PER_STREAM * messages


def _counted(mode: str, messages: int, valgrind: str, workdir: str) -> tuple[int, int]:
    """(instructions of the main thread, Routes) of one run of ``drive`` under callgrind."""
    out = os.path.join(workdir, f"callgrind.{mode}.{messages}")
    env = {**os.environ, "PYTHONHASHSEED": "0", "GLIBC_TUNABLES": _NO_REP_MOVSB}
    run = subprocess.run([valgrind, "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
                          sys.executable, "-m", "kvrouterd.benchmarks.instructions", "--drive", mode, str(messages)],
                         env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"callgrind run of {mode} ({messages} messages) failed:\n{run.stderr[-2000:]}")
    routes = int(run.stdout.split()[-1])
    main_thread = f"{out}-01"  # callgrind numbers a process's threads from 1, in the order they started
    with open(main_thread) as f:
        totals = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.MULTILINE)
    if totals is None:
        raise RuntimeError(f"no totals in {main_thread}")
    return int(totals.group(1)), routes


def instructions_per_route(mode: str, valgrind: str) -> float:
    """Instructions per streamed Route + Complete under ``mode``: the difference of a ``LONG``
    and a ``SHORT`` run, over the difference of their Routes."""
    with tempfile.TemporaryDirectory(prefix="kvrouterd-callgrind-") as workdir:
        short, short_routes = _counted(mode, SHORT, valgrind, workdir)
        long, long_routes = _counted(mode, LONG, valgrind, workdir)
    return (long - short) / (long_routes - short_routes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--drive", nargs=2, metavar=("MODE", "MESSAGES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:  # the child callgrind runs
        print(drive(args.drive[0], int(args.drive[1])))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s): {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not on PATH: install it (apt-get install valgrind) to count instructions", file=sys.stderr)
        return 2
    result: dict[str, Any] = {}
    for mode in modes:
        print(f"[instructions {time.strftime('%H:%M:%S')}] {mode}: two runs under callgrind "
              f"({SHORT} and {LONG} messages per stream)", file=sys.stderr, flush=True)
        result[f"handler_instructions_per_route_{mode}"] = instructions_per_route(mode, valgrind)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'instructions per streamed Route + Complete':<44} {'count':>10}")
    for key, value in result.items():
        print(f"{key.removeprefix('handler_instructions_per_route_'):<44} {value:>10,.0f}")
    for other, label in (("client", "daemon - client: the daemon's code"),
                         ("floor", "daemon - floor: what it does past the floor")):
        if "daemon" in modes and other in modes:
            gap = result["handler_instructions_per_route_daemon"] - result[f"handler_instructions_per_route_{other}"]
            print(f"{label:<44} {gap:>10,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
