"""Warm a new replica's index: from a peer (the ExportIndex RPC and the client that reads it),
or from the event bus's snapshot object plus the stream after it (``encode_snapshot`` /
``restore_snapshot``, the recommended path with ``events.bus``).

A replica started with ``warm_from: HOST:PORT`` reports NOT_SERVING, streams the peer's
index (``ExportIndex``: per worker, its block-key chains parents first, with the engine
hashes the peer learned and the blocks no worker holds that they hang under), registers the
workers it does not know yet with the peer's descriptions, adopts the LoRA adapters the peer
believed each worker has loaded (``Worker.loaded_loras``: the LoRA stage then does not start
blind), stores the blocks, and only then starts its event sources and reports SERVING. The
export walks each worker a few thousand blocks at a time, yielding to the event loop between
steps so routing never waits on it; every exported block follows its parent, blocks removed
during the walk are left out, and events applied during it or published between the export
and this replica's own subscription are missing until the engines' next events (or a ZMQ
replay, which rebuilds the worker) correct them. A peer that cannot be reached within
``warm_timeout_s`` is logged and the replica starts cold.

A snapshot is the same chunks behind a header, so it carries the residency too; one written
before ``loaded_loras`` existed reads as workers with none loaded, as before. The header names
the stream sequence the index reflects and the digest of the message at it
(``nats_bus.message_digest``), by which a restoring replica tells whether the stream is still
the one the snapshot was taken of (``BusEventSource.snapshot_start``); one written before the
digest was recorded is told by the stream's end alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import struct
import warnings
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .._generated.kvrouter.v1 import router_pb2_grpc
from ..config import Config
from ..errors import InvalidRequest, KVRouterError
from ..events.endpoints import EndpointAllowList, check_worker_endpoints
from ..index.workers import Worker
from ..router import Router
from ..telemetry.loop_lag import freeze_heap, unfreeze_heap
from . import convert
from .convert import pb

__all__ = [
    "DEFAULT_CHUNK_BLOCKS",
    "SNAPSHOT_MAGIC",
    "WarmResult",
    "encode_snapshot",
    "encode_snapshot_aside",
    "export_chunks",
    "export_chunks_now",
    "restore_snapshot",
    "snapshot_position",
    "warm_from_peer",
]

log = logging.getLogger("kvrouterd.server")

DEFAULT_CHUNK_BLOCKS = 65536
#: blocks the export walk visits between yields to the event loop: ~2.5 ms idle, and 3-5 times
#: that on a loaded 2-core machine, where 2,048 a step still held the loop 30-66 ms (issue #16)
EXPORT_STEP_BLOCKS = 512


async def export_chunks(
    router: Router, worker_ids: Sequence[str] = (), max_blocks: int = 0, step: int = EXPORT_STEP_BLOCKS
) -> AsyncIterator[pb.IndexChunk]:
    """IndexChunks for the given workers (all when empty). Raises NotFound for an unknown id.

    The walk visits at most ``step`` blocks between yields to the event loop, so exporting a
    worker of a million blocks never holds up a Route (``Router.export_steps`` says what
    events applied meanwhile do to the export). A worker deregistered meanwhile ends its part
    where it was: the chunks already sent stay sent, the other workers follow."""
    size = max_blocks or DEFAULT_CHUNK_BLOCKS
    workers = [router.workers.get(w) for w in worker_ids] if worker_ids else list(router.workers)
    for worker in workers:
        if router.workers.find(worker.id) is not worker:
            continue  # removed while earlier chunks were being sent
        for chunk in _worker_chunks(router, worker, size, step):
            if chunk is None:
                await asyncio.sleep(0)
            else:
                yield chunk
            # checked after every pause, before the walk goes on: a removed worker's slot is
            # freed once its blocks are dropped (a deregistration waits for that), and reading
            # it then answered KeyError(slot) (issue #28 item 4)
            if router.workers.find(worker.id) is not worker:
                break


def _worker_chunks(router: Router, worker: Worker, size: int, step: int) -> Iterator[pb.IndexChunk | None]:
    """One worker's chunks of at most ``size`` blocks, and None after each step of the walk
    (where the host yields to its loop). The caller checks the worker is still registered
    after each item, before asking for the next."""
    # the chunk is filled a step's blocks at a time: building a 65,536-block message from a
    # list in one call held the loop ~50-150 ms (issue #16)
    chunk, filled, sent = pb.IndexChunk(), 0, False
    unheld: list[tuple[int, int | None]] = []
    for blocks in router.export_steps(worker.id, step, unheld):
        # the unheld blocks a part's blocks hang under go in the chunk its first block goes in
        _extend_unheld(chunk, unheld)
        unheld.clear()
        while blocks:
            take, blocks = blocks[: size - filled], blocks[size - filled :]
            _extend(chunk, take)
            filled += len(take)
            if filled == size:
                yield _finish(router, worker, chunk)
                chunk, filled, sent = pb.IndexChunk(), 0, True
        yield None
    if filled or not sent:
        yield _finish(router, worker, chunk)


def _extend(chunk: pb.IndexChunk, part: list[tuple[int, int | None, int]]) -> None:
    chunk.keys.extend([k for k, _, _ in part])
    chunk.parent_keys.extend([p or 0 for _, p, _ in part])
    chunk.roots.extend([p is None for _, p, _ in part])
    chunk.engine_hashes.extend([e for _, _, e in part])


def _extend_unheld(chunk: pb.IndexChunk, part: list[tuple[int, int | None]]) -> None:
    chunk.unheld_keys.extend([k for k, _ in part])
    chunk.unheld_parent_keys.extend([p or 0 for _, p in part])
    chunk.unheld_roots.extend([p is None for _, p in part])


def _finish(router: Router, worker: Worker, chunk: pb.IndexChunk) -> pb.IndexChunk:
    chunk.worker.CopyFrom(convert.worker_message(worker, router.index.count(worker.slot), router.block_size))
    return chunk


def export_chunks_now(router: Router) -> Iterator[pb.IndexChunk]:
    """Every worker's IndexChunks in one synchronous step (a snapshot that must not let a
    batch land halfway; the ExportIndex RPC uses ``export_chunks``, which yields)."""
    for worker in list(router.workers):
        unheld: list[tuple[int, int | None]] = []
        blocks = [block for part in router.export_steps(worker.id, unheld=unheld) for block in part]
        for start in range(0, max(1, len(blocks)), DEFAULT_CHUNK_BLOCKS):
            chunk = _chunk(router, worker, blocks[start : start + DEFAULT_CHUNK_BLOCKS])
            if not start:
                _extend_unheld(chunk, unheld)  # few: what engines evicted above blocks they kept
            yield chunk


def _chunk(router: Router, worker: Worker, part: list[tuple[int, int | None, int]]) -> pb.IndexChunk:
    return pb.IndexChunk(
        worker=convert.worker_message(worker, router.index.count(worker.slot), router.block_size),
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
    #: blocks whose parent never came (a worker this replica refused held it): skipped
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


async def _import(
    router: Router, stream: AsyncIterable[pb.IndexChunk], result: WarmResult, allow: EndpointAllowList | None = None
) -> None:
    """Add the stream's workers (a peer's worker whose event endpoint ``allow`` refuses is
    skipped with its blocks: the peer may run another allow-list) and import their blocks."""
    deferred: list[tuple[str, list[tuple[int, int | None, int]]]] = []
    #: key -> parent key of the blocks no worker held on the peer, all read so far
    unheld: dict[int, int | None] = {}
    seen: set[str] = set()
    refused: set[str] = set()
    async for chunk in stream:
        wid = chunk.worker.id
        if wid in refused:
            continue
        if wid not in router.workers:
            spec = convert.worker_spec(chunk.worker)
            if allow is not None and spec.kv_events_endpoint:
                try:
                    check_worker_endpoints(allow, spec.id, spec.address, spec.kv_events_endpoint)
                except KVRouterError as exc:
                    log.warning("peer's worker not imported: %s", exc, extra={"worker_id": wid})
                    refused.add(wid)
                    continue
            router.add_worker(spec)
            result.workers_added += 1
        if wid not in seen:
            seen.add(wid)
            result.workers += 1
            if chunk.worker.loaded_loras:
                _adopt_loras(router, wid, chunk.worker.loaded_loras)
        unheld.update((k, None if root else p)
                      for k, p, root in zip(chunk.unheld_keys, chunk.unheld_parent_keys, chunk.unheld_roots))
        blocks = [
            (k, None if root else p, e)
            for k, p, root, e in zip(chunk.keys, chunk.parent_keys, chunk.roots, chunk.engine_hashes)
        ]
        left = router.import_blocks(wid, blocks, unheld)
        result.blocks += len(blocks) - len(left)
        if left:
            deferred.append((wid, left))
    while deferred:  # parents held only by workers that came later in the stream
        progress, retry = 0, []
        for wid, blocks in deferred:
            left = router.import_blocks(wid, blocks, unheld)
            progress += len(blocks) - len(left)
            if left:
                retry.append((wid, left))
        result.blocks += progress
        deferred = retry
        if not progress:
            result.skipped = sum(len(b) for _, b in deferred)
            break


def _adopt_loras(router: Router, worker_id: str, adapters: Sequence[str]) -> None:
    """The adapters the peer (or snapshot) believed ``worker_id`` has loaded, so the LoRA
    stage starts from them; names this router refuses (a peer with a longer ``max_id_length``)
    cost the worker its residency, never the import."""
    try:
        router.adopt_loras(worker_id, adapters)
    except KVRouterError as exc:
        log.warning("peer's LoRA residency not imported: %s", exc, extra={"worker_id": worker_id})


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
            await _import(router, stream, result, config.events.allow_list)
    except (TimeoutError, grpc.aio.AioRpcError, KVRouterError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        log.warning("warming from %s stopped: %s; serving with what was imported", target, detail,
                    extra={"workers": result.workers, "blocks": result.blocks})
        return result
    log.info("index warmed from peer", extra={"peer": target, "workers": result.workers,
                                               "workers_added": result.workers_added, "blocks": result.blocks,
                                               "skipped": result.skipped})
    return result


#: first bytes of a snapshot object: format name and version
SNAPSHOT_MAGIC = b"KVRSNAP1"
_LEN = struct.Struct(">I")


def encode_snapshot(router: Router, stream_sequence: int, stream_digest: str = "") -> bytes:
    """The whole index as it stands after ``stream_sequence`` of the event stream: a JSON
    header (that sequence, ``stream_digest``: the ``message_digest`` of its message, the block
    size, each worker's last applied batch number), then the ``ExportIndex`` chunks, each
    length-prefixed. Synchronous, so no batch lands halfway."""
    header = {
        "stream_sequence": stream_sequence,
        "stream_digest": stream_digest,
        "block_size": router.block_size,
        "sequences": {w.id: w.last_sequence for w in router.workers},
    }
    parts = [SNAPSHOT_MAGIC]
    for msg in (json.dumps(header).encode(), *(c.SerializeToString() for c in export_chunks_now(router))):
        parts += [_LEN.pack(len(msg)), msg]
    return b"".join(parts)


async def encode_snapshot_aside(router: Router, stream_sequence: int, stream_digest: str = "") -> bytes:
    """``encode_snapshot`` without stalling the event loop: the process forks, and the child,
    holding a copy-on-write image of the index exactly as it stands after ``stream_sequence``,
    encodes it and writes the bytes back through a pipe while the parent keeps routing (Redis's
    BGSAVE does the same). The loop pauses only for ``fork()`` itself, which copies the page
    tables: ~30 ms at 10^6 blocks (235 MB resident), against ~5 s of CPU for encoding in place
    (docs/deploy.md, measured with ``benchmarks/snapshot_stall``).

    The child touches every block it encodes (reference counts), so the pages it reads are
    copied: ~150 MB extra at 10^6 blocks while a snapshot is written. Where ``fork`` does not
    exist this encodes in place. Raises ``OSError`` if the child fails."""
    if not hasattr(os, "fork"):  # pragma: no cover - POSIX hosts only run the daemon
        return encode_snapshot(router, stream_sequence, stream_digest)
    read_fd, write_fd = os.pipe()
    # the objects alive now leave the parent's collections until the child is done (the Python
    # docs' advice for fork: gc.freeze() right before it): while the child shares their pages, a
    # full collection in the parent writes every tracked object's GC header and so copies its
    # page. At 10^6 blocks that collection took 190 ms and copied 16 MB with the native index
    # (52k tracked objects: its blocks are not tracked), 1.25 s and 94 MB on the pure-Python
    # one (1.07M), and nothing frozen (docs/operations/limits.md, "Big calls on a huge worker").
    # The freeze is the process's one heap freeze, counted (loop_lag.freeze_heap): a daemon
    # froze its start-up heap, and gc.unfreeze() here thawed that too after the first snapshot,
    # so every later full collection walked the start-up heap again. Counted, this snapshot's
    # thaw waits for the daemon's: what was alive at the snapshot (the index of then, mostly
    # untracked native blocks; freed by reference counting as usual when dropped) stays frozen
    # while the daemon runs, as the start-up heap does.
    freeze_heap()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns on fork() with threads (gRPC's, telemetry's): the child runs
            # none of their code, only the encode below, and leaves with os._exit
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                pid = os.fork()
            except OSError:  # out of memory or processes: no snapshot this time
                os.close(read_fd)
                os.close(write_fd)
                raise
        if pid == 0:  # pragma: no cover - the child (coverage does not follow it)
            _encode_in_child(router, stream_sequence, stream_digest, read_fd, write_fd)
        os.close(write_fd)
        try:
            data = await asyncio.to_thread(_read_all, read_fd)
            _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        except BaseException:  # cancelled (the daemon stops): the child's work is of no use
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            raise
    finally:
        unfreeze_heap()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise OSError(f"the snapshot encoder process failed with exit code {code}")
    return data


def _encode_in_child(  # pragma: no cover
    router: Router, stream_sequence: int, stream_digest: str, read_fd: int, write_fd: int
) -> None:
    code = 1
    try:
        os.close(read_fd)
        # a collection would write into every object's header: copied pages for nothing
        gc.disable()
        # the parent's signal handlers would wake the parent's loop through their shared wakeup fd
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        view = memoryview(encode_snapshot(router, stream_sequence, stream_digest))
        while view:
            view = view[os.write(write_fd, view):]
        code = 0
    finally:
        os._exit(code)


def _read_all(fd: int) -> bytes:
    """Everything until EOF (in a worker thread: ``os.read`` releases the GIL); closes ``fd``."""
    parts = []
    try:
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
    finally:
        os.close(fd)
    return b"".join(parts)


def _frames(data: bytes) -> Iterator[bytes]:
    pos = len(SNAPSHOT_MAGIC)
    while pos < len(data):
        if pos + _LEN.size > len(data):
            raise InvalidRequest("snapshot truncated in a length prefix")
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + n > len(data):
            raise InvalidRequest("snapshot truncated in a frame")
        yield data[pos : pos + n]
        pos += n


def _json_int(value: object) -> int:
    """A header number as encode_snapshot writes it: a JSON integer, never a string or a
    float that int() would also read ("٣" is 3 to int())."""
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _header(data: bytes) -> dict[str, Any]:
    """A snapshot's JSON header. Raises ``InvalidRequest`` if there is none that parses."""
    if not data.startswith(SNAPSHOT_MAGIC):
        raise InvalidRequest("not a kvrouterd snapshot (bad magic)")
    try:
        header = json.loads(next(_frames(data)))
    except StopIteration:
        raise InvalidRequest("snapshot without a header") from None
    except ValueError as exc:
        raise InvalidRequest(f"snapshot does not parse: {exc}") from None
    if type(header) is not dict:
        raise InvalidRequest(f"snapshot does not parse: a header of {type(header).__name__}")
    return header


def snapshot_position(data: bytes) -> tuple[int, str]:
    """The stream sequence a snapshot was taken after, and the ``message_digest`` of that
    sequence's message ("" in a snapshot written before it was recorded), read from the header
    alone. Raises ``InvalidRequest`` if it does not parse."""
    header = _header(data)
    try:
        digest = header.get("stream_digest", "")
        if type(digest) is not str:
            raise TypeError(f"expected a string, got {digest!r}")
        return _json_int(header["stream_sequence"]), digest
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"snapshot does not parse: {exc}") from None


async def restore_snapshot(router: Router, data: bytes) -> tuple[int, WarmResult]:
    """Load a snapshot written by ``encode_snapshot``; returns the stream sequence it was taken
    after. Workers it names that the router lacks are registered; each worker's batch number is
    restored so the stream's next batch reads as in order. A snapshot that does not parse or was
    taken at another block size raises ``InvalidRequest`` before anything changes. Whether the
    stream it names is still there is ``BusEventSource.snapshot_start``'s to tell, by its content:
    a snapshot of a stream made again since is still loaded (the daemon says why)."""
    header = _header(data)
    try:
        chunks = [pb.IndexChunk.FromString(f) for f in list(_frames(data))[1:]]
        stream_sequence = _json_int(header["stream_sequence"])
        sequences = {str(k): _json_int(v) for k, v in header["sequences"].items()}
        block_size = _json_int(header["block_size"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequest(f"snapshot does not parse: {exc}") from None
    if block_size != router.block_size:
        raise InvalidRequest(f"snapshot taken at block_size {block_size}, this router uses {router.block_size}")

    async def replay() -> AsyncIterator[pb.IndexChunk]:
        for chunk in chunks:
            yield chunk
            await asyncio.sleep(0)  # a big snapshot must not starve the probes answering NOT_SERVING

    result = WarmResult()
    await _import(router, replay(), result)
    for wid, seq in sequences.items():
        if wid in router.workers:
            router.workers.get(wid).last_sequence = seq
    for chunk in chunks:
        w = chunk.worker
        # a view that had lost events when the snapshot was taken still has: its publisher must resync
        # it (a worker degraded for rejected stores only is not: its next clean store mends it)
        if w.state == pb.WORKER_STATE_DEGRADED and w.state_reason != "stored events rejected" and w.id in router.workers:
            router.mark_resync_needed(w.id, w.state_reason)
    return stream_sequence, result
