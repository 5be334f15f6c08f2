"""A real daemon on 127.0.0.1:0 with real grpc.aio channels, and the spans it records."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.benchmarks.nats_server import NatsServer
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon


class RunningDaemon:
    def __init__(self, daemon: Daemon, channel: grpc.aio.Channel, spans: InMemorySpanExporter) -> None:
        self.daemon = daemon
        self.channel = channel
        self.stub = router_pb2_grpc.KVRouterStub(channel)
        self.spans = spans

    @property
    def router(self):  # type: ignore[no-untyped-def]
        return self.daemon.router


@pytest.fixture
def daemon_config() -> dict:
    """Override in a test module to change the daemon's configuration."""
    return {}


@pytest.fixture
async def running(daemon_config: dict) -> AsyncIterator[RunningDaemon]:
    spans = InMemorySpanExporter()
    cfg = parse_config({"listen": "127.0.0.1:0", **daemon_config})
    daemon = Daemon(cfg, span_exporter=spans, seed=1)
    port = await daemon.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield RunningDaemon(daemon, channel, spans)
    finally:
        await channel.close()
        await daemon.stop(grace=0.5)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server with JetStream on loopback, for the event-bus tests."""
    server = NatsServer(tmp_path / "js")
    server.start()
    try:
        yield server
    finally:
        server.stop()
