"""The gRPC runtime a kvrouterd server process asks for, before ``grpc`` is imported.

gRPC reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is imported; a choice made after that has
no effect. ``kvrouterd``'s command line (``cli.main``) applies ``SERVER_EXPERIMENTS`` first
thing, and the benchmark's server processes get the same in their environment, so what
``kvrouterd bench`` measures is the transport the daemon serves with.

``-event_engine_listener``: connections accepted by gRPC's older listener are polled by the
thread that polls the server's completion queue (grpc.aio's poller), where EventEngine's
listener (grpcio 1.85's default) reads them on its own thread pool and hands every read on to
that poller: a thread switch per read, which two busy processes on two cores pay for in
context switches. Measured with ``kvrouterd bench --only grpc --rounds 3`` (median server CPU
per Route + Complete, 64 workers, 10^6 blocks, 4,000-token prompts): the daemon's streamed
load 66.2 -> 63.1 us, its unary load at 64 in flight 518 -> 499 us, one message per call
303 -> 259 us; the trivial server's streamed load 23.4 -> 21.5 us, unary 412 -> 327 us. See
docs/operations/performance.md.

An operator's own ``GRPC_EXPERIMENTS`` is kept: ours are added only for experiments it does not
name, so ``GRPC_EXPERIMENTS=event_engine_listener`` restores gRPC's default listener.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["ENV", "SERVER_EXPERIMENTS", "prefer_server_experiments", "server_experiments", "status"]

#: the variable gRPC reads its experiments from (comma-separated names, ``-name`` turns one off)
ENV = "GRPC_EXPERIMENTS"

#: the experiments a kvrouterd server process runs with unless the operator names them
SERVER_EXPERIMENTS = ("-event_engine_listener",)

#: the experiments gRPC runs with as far as this module knows, for the "serving" log line
status = "not set by kvrouterd"


def _name(entry: str) -> str:
    return entry.strip().lstrip("-+")


def server_experiments(current: str) -> str:
    """``GRPC_EXPERIMENTS`` for a server process: ``current`` (the operator's) with each of
    ``SERVER_EXPERIMENTS`` added that it does not name, either way."""
    entries = [e.strip() for e in current.split(",") if e.strip()]
    named = {_name(e) for e in entries}
    return ",".join(entries + [e for e in SERVER_EXPERIMENTS if _name(e) not in named])


def prefer_server_experiments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Put ``server_experiments`` into ``environ`` (this process's environment by default) if
    gRPC has not read it yet; False, changing nothing, when ``grpc`` is already imported."""
    global status
    if environ is None:
        environ = os.environ
    if "grpc" in sys.modules:
        ours = ",".join(SERVER_EXPERIMENTS)
        status = f"{environ.get(ENV, '')!r}: grpc was imported before kvrouterd could add {ours}"
        return False
    value = server_experiments(environ.get(ENV, ""))
    environ[ENV] = value
    status = value
    return True
