"""No RPC makes the daemon open a file, connect anywhere or start a process.

Every KVRouter method is called with hostile-looking values (paths, URLs, hosts) while a
Python audit hook records file opens, socket connects and name lookups, and process starts.
gRPC's own networking runs in C and raises no audit events; the handlers are Python, so any
file or network access they did would.
"""

from __future__ import annotations

import sys

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

from .test_daemon import BS, publish, stored

_WATCHED = ("open", "os.open", "socket.connect", "socket.getaddrinfo", "socket.bind", "subprocess.Popen",
            "os.system", "os.exec", "os.posix_spawn", "shutil.copyfile", "os.remove", "os.rename")
_recording: list[tuple[str, tuple]] | None = None


def _hook(event: str, args: tuple) -> None:
    if _recording is not None and event in _WATCHED:
        _recording.append((event, args))


sys.addaudithook(_hook)  # audit hooks cannot be removed; it records only inside the test below


async def test_no_rpc_touches_files_hosts_or_processes(running):
    global _recording
    stub = running.stub
    hostile = "../../../../etc/passwd"
    calls = []
    _recording = []
    try:
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
            id="w", address="evil.example.com:80", mode=pb.CACHE_STATE_MODE_EVENTS,
            kv_events_endpoint="tcp://evil.example.com:5557", labels={"path": hostile},
        )))
        await publish(stub, pb.EventBatch(worker_id="w", sequence=0, events=[
            pb.CacheEvent(stored=pb.StoredBlocks(engine_hashes=[1], token_ids=list(range(BS)), model=hostile, lora="file:///etc/shadow")),
        ]))
        await publish(stub, pb.EventBatch(worker_id="w", sequence=1, events=[stored(list(range(BS, 2 * BS)), [2], parent=1)]))
        r = await stub.Route(pb.RouteRequest(token_ids=list(range(3 * BS)), model=hostile, lora="http://evil.example.com/",
                                             session_id=hostile, request_id="/tmp/x"))
        await stub.Complete(pb.CompleteRequest(request_id=r.request_id, success=True))
        await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w", queued_requests=1))
        await stub.EvictHint(pb.EvictHintRequest(worker_id="w", blocks=1))
        await stub.ListWorkers(pb.ListWorkersRequest())
        await stub.GetStats(pb.GetStatsRequest())
        assert [c.worker.id async for c in stub.ExportIndex(pb.ExportIndexRequest())] == ["w"]
        for bad in (pb.RouteRequest(policy=hostile, token_ids=[1] * BS), pb.RouteRequest(candidate_workers=[hostile], token_ids=[1] * BS)):
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Route(bad)
        await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="w"))
        calls = list(_recording)
    finally:
        _recording = None
    assert calls == []
