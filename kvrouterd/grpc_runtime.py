"""The gRPC runtime a kvrouterd server process asks for, before ``grpc`` is imported.

gRPC reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is imported; a choice made after that has
no effect. ``kvrouterd``'s command line (``cli.main``) applies ``SERVER_EXPERIMENTS`` first
thing, and the benchmark's server processes get the same in their environment, so what
``kvrouterd bench`` measures is the transport the daemon serves with.

``-event_engine_listener``: EventEngine's listener (grpcio 1.85's default) reads accepted
connections on its own thread pool and hands every read on to grpc.aio's poller thread; the
older listener's connections are read by that poller thread itself. Under the bench's streamed
load the four ``event_engine`` threads took ~14% of the daemon's CPU, much of it in context
switches, and ~0.3% with the older listener. Server CPU per Route + Complete (``kvrouterd bench
--only grpc --rounds 3``, medians; 64 workers, 10^6 blocks, 4,000-token prompts): the daemon's
streamed load 66.2 -> 61.4 us, unary at 64 in flight 518 -> 459, through the SDK 84.3 -> 72.9;
the trivial server's streamed load 23.4 -> 19.8, unary 412 -> 308 (docs/operations/performance.md).

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
