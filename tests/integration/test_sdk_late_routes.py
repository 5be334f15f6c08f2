"""The SDK against a router whose loop stalls past the callers' deadlines: a streamed Route
answered late was committed, and the SDK releases it so no phantom load stays behind."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvrouter_client import RouterClient
from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon


class ThreadedDaemon:
    """A daemon on its own event loop in a thread, so its loop can stall while the client's runs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._stop: asyncio.Event | None = None

        async def main() -> None:
            self.daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "block_size": 16}), seed=1)
            self.port = await self.daemon.start()
            self._stop = asyncio.Event()
            started.set()
            await self._stop.wait()
            await self.daemon.stop(grace=0)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(30)

    def stall(self, seconds: float) -> None:
        """Block the daemon's loop for ``seconds``, as a long event batch or a collection does."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def inflight(self) -> int:
        return self.daemon.router.workers.inflight_count

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.fixture
def threaded() -> Iterator[ThreadedDaemon]:
    daemon = ThreadedDaemon()
    try:
        yield daemon
    finally:
        daemon.stop()


async def test_routes_answered_after_their_callers_gave_up_are_released(threaded: ThreadedDaemon) -> None:
    target = f"127.0.0.1:{threaded.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = router_pb2_grpc.KVRouterStub(channel)
        for w in ("a", "b"):
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id=w, address=f"{w}:1")))
    fell_back = []

    def fallback(req: pb.RouteRequest) -> tuple[str, str]:
        fell_back.append(req)
        return ("a", "a:1")

    async with RouterClient(target, timeout=0.05, fallback=fallback) as client:
        await client.complete(await client.route(list(range(64))))  # the streams are open
        threaded.stall(0.3)
        await asyncio.sleep(0.02)
        results = await asyncio.gather(*(client.route(list(range(i * 1000, i * 1000 + 1024))) for i in range(20)))
        assert all(r.fallback for r in results) and len(fell_back) == 20
        # the router, once its loop runs again, commits all 20 and answers them late; the SDK
        # releases each one it had given up on, on the stream that carried it
        for _ in range(200):
            if threaded.inflight() == 0 and client.late_routes_released == 20:
                break
            await asyncio.sleep(0.02)
        assert client.late_routes_released == 20
        assert threaded.inflight() == 0
        assert all(w.pending_prefill_tokens == 0 for w in threaded.daemon.router.workers)
        # and the stream goes on serving: a Route now is answered and completed as usual
        result = await client.route(list(range(64)), timeout=2.0)
        assert not result.fallback and await client.complete(result)
    assert threaded.inflight() == 0
