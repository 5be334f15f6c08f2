"""Warm a new replica's index from a peer: the ExportIndex RPC and the client that reads it.

A replica started with ``warm_from: HOST:PORT`` reports NOT_SERVING, streams the peer's
index (``ExportIndex``: per worker, its block-key chains parents first, with the engine
hashes the peer learned), registers the workers it does not know yet with the peer's
descriptions, stores the blocks, and only then starts its event sources and reports
SERVING. Each worker's blocks are exported in one synchronous step, so a worker's chains
are consistent; different workers may be exported a few event batches apart, and events
published between the export and this replica's own subscription are missing until the
engines' next events (or a ZMQ replay, which rebuilds the worker) correct them. A peer that
cannot be reached within ``warm_timeout_s`` is logged and the replica starts cold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from .._generated.kvrouter.v1 import router_pb2_grpc
from ..config import Config
from ..errors import KVRouterError
from ..router import Router
from . import convert
from .convert import pb

__all__ = ["DEFAULT_CHUNK_BLOCKS", "WarmResult", "export_chunks", "warm_from_peer"]

log = logging.getLogger("kvrouterd.server")

DEFAULT_CHUNK_BLOCKS = 65536


def export_chunks(router: Router, worker_ids: Sequence[str] = (), max_blocks: int = 0) -> Iterator[pb.IndexChunk]:
    """IndexChunks for the given workers (all when empty). Raises NotFound for an unknown id."""
    size = max_blocks or DEFAULT_CHUNK_BLOCKS
    workers = [router.workers.get(w) for w in worker_ids] if worker_ids else list(router.workers)
    for worker in workers:
        if worker.id not in router.workers:
            continue  # removed while earlier chunks were being sent
        blocks = router.export_blocks(worker.id)
        message = convert.worker_message(worker, router.index.count(worker.slot), router.block_size)
        for start in range(0, max(1, len(blocks)), size):
            part = blocks[start : start + size]
            yield pb.IndexChunk(
                worker=message,
                keys=[k for k, _, _ in part],
                parent_keys=[p or 0 for _, p, _ in part],
                roots=[p is None for _, p, _ in part],
                engine_hashes=[e for _, _, e in part],
            )


@dataclass
class WarmResult:
    workers: int = 0
    workers_added: int = 0
    blocks: int = 0
    #: blocks whose ancestors no worker held on the peer: unreachable by any match, skipped
    skipped: int = 0


def _channel(target: str, config: Config) -> grpc.aio.Channel:
    options = [("grpc.max_receive_message_length", config.limits.max_message_bytes)]
    tls = config.tls
    if not tls.enabled:
        return grpc.aio.insecure_channel(target, options=options)
    # the peer runs with the same certificates: trust the configured CA, present our own pair
    roots = Path(tls.ca_file).read_bytes() if tls.ca_file else None
    creds = grpc.ssl_channel_credentials(roots, Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())
    return grpc.aio.secure_channel(target, creds, options=options)


async def _import(router: Router, stream: grpc.aio.UnaryStreamCall, result: WarmResult) -> None:
    deferred: list[tuple[str, list[tuple[int, int | None, int]]]] = []
    seen: set[str] = set()
    async for chunk in stream:
        wid = chunk.worker.id
        if wid not in router.workers:
            router.add_worker(convert.worker_spec(chunk.worker))
            result.workers_added += 1
        if wid not in seen:
            seen.add(wid)
            result.workers += 1
        blocks = [
            (k, None if root else p, e)
            for k, p, root, e in zip(chunk.keys, chunk.parent_keys, chunk.roots, chunk.engine_hashes)
        ]
        left = router.import_blocks(wid, blocks)
        result.blocks += len(blocks) - len(left)
        if left:
            deferred.append((wid, left))
    while deferred:  # parents held only by workers that came later in the stream
        progress, retry = 0, []
        for wid, blocks in deferred:
            left = router.import_blocks(wid, blocks)
            progress += len(blocks) - len(left)
            if left:
                retry.append((wid, left))
        result.blocks += progress
        deferred = retry
        if not progress:
            result.skipped = sum(len(b) for _, b in deferred)
            break


async def warm_from_peer(router: Router, config: Config, token: bytes | None = None) -> WarmResult:
    """Import the index of the replica at ``config.warm_from``; never raises for a bad peer."""
    result = WarmResult()
    target = config.warm_from
    metadata = [("authorization", f"Bearer {token.decode()}")] if token else None
    try:
        async with _channel(target, config) as channel:
            stream = router_pb2_grpc.KVRouterStub(channel).ExportIndex(
                pb.ExportIndexRequest(), timeout=config.warm_timeout_s, metadata=metadata
            )
            await _import(router, stream, result)
    except (TimeoutError, grpc.aio.AioRpcError, KVRouterError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        log.warning("warming from %s stopped: %s; serving with what was imported", target, detail,
                    extra={"workers": result.workers, "blocks": result.blocks})
        return result
    log.info("index warmed from peer", extra={"peer": target, "workers": result.workers,
                                               "workers_added": result.workers_added, "blocks": result.blocks,
                                               "skipped": result.skipped})
    return result
