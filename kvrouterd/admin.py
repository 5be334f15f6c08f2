"""``kvrouterd status``: what a running daemon holds: workers, their modes and states, index size.

    kvrouterd status                          # the daemon on 127.0.0.1:50051
    kvrouterd status --target 10.0.0.7:50051
    kvrouterd status --target router:50051 --json
    kvrouterd status --target router:50051 --ca-file ca.crt [--cert-file c.crt --key-file c.key]

It calls the daemon's ``GetStats`` RPC, and, when that lists only the first of many workers
(their descriptions can pass gRPC's 4 MiB default reply limit), ``ListWorkers`` a page at a
time for all of them. Exit status 0 on success, 1 when the daemon cannot be reached or refuses
a call (the gRPC status is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from ._generated.kvrouter.v1 import router_pb2 as pb
from ._generated.kvrouter.v1 import router_pb2_grpc
from .decimals import number_arg

__all__ = ["add_arguments", "fetch_stats", "format_stats", "list_workers", "run"]

#: serve's default listen address
DEFAULT_TARGET = "127.0.0.1:50051"

_MODE = {pb.CACHE_STATE_MODE_EVENTS: "events", pb.CACHE_STATE_MODE_APPROXIMATE: "approximate"}
_STATE = {pb.WORKER_STATE_READY: "ready", pb.WORKER_STATE_DEGRADED: "degraded", pb.WORKER_STATE_DRAINING: "draining"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, metavar="HOST:PORT",
        help=f"the daemon's gRPC address (default {DEFAULT_TARGET}, where serve listens)",
    )
    parser.add_argument("--json", action="store_true", help="print the GetStats response as JSON")
    parser.add_argument("--timeout", type=number_arg, default=5.0, help="seconds to wait for the answer (default 5)")
    parser.add_argument("--ca-file", metavar="FILE", help="connect with TLS, trusting this CA bundle")
    parser.add_argument("--cert-file", metavar="FILE", help="client certificate for mutual TLS")
    parser.add_argument("--key-file", metavar="FILE", help="client private key for mutual TLS")
    parser.add_argument("--token-file", metavar="FILE", help="send the bearer token in this file (if GetStats is protected)")


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.ca_file:
        return grpc.insecure_channel(args.target)
    key = Path(args.key_file).read_bytes() if args.key_file else None
    cert = Path(args.cert_file).read_bytes() if args.cert_file else None
    return grpc.secure_channel(args.target, grpc.ssl_channel_credentials(Path(args.ca_file).read_bytes(), key, cert))


def fetch_stats(args: argparse.Namespace) -> pb.GetStatsResponse:
    metadata = None
    if args.token_file:
        token = Path(args.token_file).read_text().splitlines()[0].strip()
        metadata = [("authorization", f"Bearer {token}")]
    with _channel(args) as channel:
        stub = router_pb2_grpc.KVRouterStub(channel)
        stats: pb.GetStatsResponse = stub.GetStats(pb.GetStatsRequest(), timeout=args.timeout, metadata=metadata)
        if stats.worker_count > len(stats.workers):  # a summary of a large fleet: the rest comes in pages
            workers = list_workers(stub, args.timeout, metadata)
            del stats.workers[:]
            stats.workers.extend(workers)
        return stats


def list_workers(
    stub: router_pb2_grpc.KVRouterStub, timeout: float, metadata: list[tuple[str, str]] | None = None
) -> list[pb.Worker]:
    """Every worker, a ``ListWorkers`` page at a time (a page answers in well under 4 MiB)."""
    workers: list[pb.Worker] = []
    token = ""
    while True:
        page = stub.ListWorkers(pb.ListWorkersRequest(page_token=token), timeout=timeout, metadata=metadata)
        workers.extend(page.workers)
        # a daemon from before pages answers everything with no token; a repeated one would loop
        if not page.next_page_token or page.next_page_token == token:
            return workers
        token = page.next_page_token


def format_stats(stats: pb.GetStatsResponse, target: str = "") -> str:
    lines = [
        f"kvrouterd {target}".rstrip(),
        f"  routing policy   {stats.default_routing_policy}",
        f"  eviction policy  {stats.default_eviction_policy}",
        f"  indexed blocks   {stats.indexed_blocks:,}",
        f"  event batches    {stats.event_batches_applied:,} applied, {stats.event_gaps:,} gaps",
    ]
    if stats.decisions_by_policy:
        decided = ", ".join(f"{k}={v:,}" for k, v in sorted(stats.decisions_by_policy.items()))
        lines.append(f"  decisions        {decided}")
    by_mode: dict[str, int] = {}
    for w in stats.workers:
        key = f"{_MODE.get(w.mode, '?')}/{_STATE.get(w.state, '?')}"
        by_mode[key] = by_mode.get(key, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(by_mode.items())) or "none"
    lines.append(f"  workers          {len(stats.workers)} ({summary})")
    if stats.workers:
        header = ("WORKER", "ADDRESS", "MODE", "STATE", "CACHED", "CAPACITY", "INFLIGHT", "PENDING_TOKENS")
        rows = [header] + [
            (
                w.id, w.address, _MODE.get(w.mode, "?"), _STATE.get(w.state, "?"), f"{w.cached_blocks:,}",
                f"{w.capacity_blocks:,}" if w.capacity_blocks else "-", str(w.inflight_requests),
                f"{w.pending_prefill_tokens:,}",
            )
            for w in sorted(stats.workers, key=lambda w: w.id)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines.append("")
        lines.extend("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        stats = fetch_stats(args)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "ERROR"  # type: ignore[attr-defined]
        details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
        print(f"kvrouterd status: {args.target}: {code}: {details}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvrouterd status: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    if args.json:
        doc = MessageToDict(
            stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
            unquote_int64_if_possible=True,
        )
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(format_stats(stats, args.target))
    return 0
