"""The fuzz swarm's state checks: what a quiet daemon's answers must agree on, seen from outside.

``fuzz_swarm.py`` pauses its clients and runs ``check_state`` every so many calls and at the
end; the daemon is ``kvrouterd serve`` in its own process, so the checks read only what it
answers (GetStats, ListWorkers, ExportIndex, Route, /metrics) and ``/proc``, not its memory
(``tests/invariants.py`` checks that, in-process).
"""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.benchmarks.serve_process import ServeProcess


@dataclass
class StateCheck:
    """What one check found broken, what it saw, and the daemon's resident memory and open
    file descriptors then."""

    violations: list[str] = field(default_factory=list)
    saw: dict[str, int] = field(default_factory=dict)
    rss_mib: float = 0.0
    fds: int = 0


async def list_all(stub: Any) -> list[pb.Worker]:
    """Every worker, paged by ListWorkers seven at a time."""
    workers: list[pb.Worker] = []
    token = ""
    while True:
        page = await stub.ListWorkers(pb.ListWorkersRequest(page_size=7, page_token=token), timeout=30)
        workers.extend(page.workers)
        token = page.next_page_token
        if not token:
            return workers


async def check_state(stub: Any, daemon: ServeProcess, *, prompt: list[int], policies: list[str],
                      approximate_capacity: int, max_rss_mib: float, max_fds: int) -> StateCheck:
    """The invariants of ``fuzz_swarm``'s docstring, on a quiet daemon (``approximate_capacity``:
    the capacity of an approximate worker registered without one; a Route of ``prompt`` is
    made with each of ``policies``)."""
    out = StateCheck()
    violate = out.violations.append
    stats = await stub.GetStats(pb.GetStatsRequest(), timeout=30)
    workers = await list_all(stub)
    ids = [w.id for w in workers]
    if ids != sorted(set(ids)) or len(ids) != stats.worker_count:
        violate(f"ListWorkers paged {len(ids)} ids (sorted, distinct: {ids == sorted(set(ids))}), "
                      f"GetStats.worker_count {stats.worker_count}")
    held: dict[str, list[int]] = {w.id: [] for w in workers}
    cached = {w.id: w.cached_blocks for w in workers}
    chunks_of: dict[str, list[pb.IndexChunk]] = {}
    async for chunk in stub.ExportIndex(pb.ExportIndexRequest(max_blocks_per_chunk=1000), timeout=60):
        chunks_of.setdefault(chunk.worker.id, []).append(chunk)
        held.setdefault(chunk.worker.id, []).extend(chunk.keys)
    everyone = {k for keys in held.values() for k in keys}
    for wid, chunks in chunks_of.items():
        seen: set[int] = set()
        for chunk in chunks:
            if not len(chunk.keys) == len(chunk.parent_keys) == len(chunk.roots):
                violate(f"ExportIndex chunk of {wid!r}: keys, parent_keys, roots of unequal length")
                continue
            for key, parent, root in zip(chunk.unheld_keys, chunk.unheld_parent_keys, chunk.unheld_roots, strict=False):
                if not root and parent not in seen and parent not in everyone:
                    violate(f"unheld block {key:#x} of {wid!r} names parent {parent:#x}, listed nowhere")
                seen.add(key)
            for key, parent, root in zip(chunk.keys, chunk.parent_keys, chunk.roots, strict=True):
                if root and parent:
                    violate(f"root block {key:#x} of {wid!r} has parent {parent:#x}")
                elif not root and parent not in seen and parent not in everyone:
                    violate(f"block {key:#x} of {wid!r} names parent {parent:#x}, held by none, not unheld")
                seen.add(key)
    for wid, keys in held.items():
        if wid in cached and len(keys) != cached[wid]:
            violate(f"ExportIndex lists {len(keys)} blocks of {wid!r}, ListWorkers cached_blocks {cached[wid]}")
    out.saw = {"workers": len(workers), "indexed_blocks": stats.indexed_blocks,
               "exported_blocks": sum(len(keys) for keys in held.values())}
    if len(everyone) != stats.indexed_blocks:
        violate(f"{len(everyone)} distinct blocks held, GetStats.indexed_blocks {stats.indexed_blocks}")
    for w in workers:
        capacity = w.capacity_blocks or approximate_capacity
        if w.mode == pb.CACHE_STATE_MODE_APPROXIMATE and w.cached_blocks > capacity:
            violate(f"approximate worker {w.id!r} holds {w.cached_blocks} blocks > capacity {capacity}")
    eligible = {w.id for w in workers if w.state != pb.WORKER_STATE_DRAINING}
    for policy in policies:
        try:
            reply = await stub.Route(pb.RouteRequest(token_ids=prompt, policy=policy), timeout=30)
        except grpc.aio.AioRpcError as exc:
            violate(f"a plain Route of policy {policy!r} answered {exc.code().name} {exc.details()}")
            continue
        if reply.worker_id not in eligible:
            violate(f"Route of policy {policy!r} named {reply.worker_id!r}, not a registered eligible worker")
        await stub.Complete(pb.CompleteRequest(request_id=reply.request_id, success=True), timeout=30)
    internal = internal_errors(daemon.metrics_port)
    if internal:
        violate(f"the daemon counted internal errors {internal}")
    if daemon.proc is None or daemon.proc.poll() is not None:
        violate("the daemon exited")
        return out
    out.rss_mib = rss = rss_mib(daemon.pid)
    # every ZMQ socket (a subscriber's, its monitor's) holds one: a leak shows here before
    # libzmq refuses sockets ("Too many open files") and an engine's events stop
    out.fds = fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    if fds > max_fds:
        violate(f"the daemon holds {fds} open file descriptors > {max_fds}")
    if rss > max_rss_mib:
        violate(f"the daemon's resident memory {rss:.0f} MiB > {max_rss_mib:.0f} MiB")
    return out


def internal_errors(metrics_port: int) -> dict[str, float]:
    """``kvrouter_internal_errors_total`` by RPC, from the daemon's /metrics (non-zero ones)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for m in re.finditer(r'^kvrouter_internal_errors_total\{rpc="([^"]*)"\} (\S+)$', text, re.M):
        if float(m.group(2)):
            out[m.group(1)] = float(m.group(2))
    return out


def rss_mib(pid: int) -> float:
    """``pid``'s resident memory, MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
