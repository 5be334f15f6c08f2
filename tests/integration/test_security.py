"""TLS, mutual TLS, certificate rotation, bearer-token auth and limits, over real grpc.aio.

Certificates are made per test run with the ``openssl`` command line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError
from kvrouterd.server.call_errors import LOG_BURST
from kvrouterd.server.app import Daemon

from .test_daemon import publish, stored

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}", cwd=d)


def make_leaf(d: Path, ca: str, name: str) -> None:
    (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        make_ca(d, ca)
    make_leaf(d, "ca", "server")
    make_leaf(d, "ca", "client")
    make_leaf(d, "other-ca", "rogue-client")
    make_leaf(d, "other-ca", "server2")
    return d


@contextlib.asynccontextmanager
async def serve(cfg: dict) -> AsyncIterator[Daemon]:
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", **cfg}), seed=1)
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop(grace=0.2)


def creds(pki: Path, ca: str = "ca", client: str | None = None) -> grpc.ChannelCredentials:
    key = (pki / f"{client}.key").read_bytes() if client else None
    chain = (pki / f"{client}.crt").read_bytes() if client else None
    return grpc.ssl_channel_credentials((pki / f"{ca}.crt").read_bytes(), key, chain)


async def list_workers(channel: grpc.aio.Channel, **kw: object) -> pb.ListWorkersResponse:
    return await router_pb2_grpc.KVRouterStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5, **kw)


def tls_cfg(pki: Path, **extra: object) -> dict:
    return {"tls": {"cert_file": str(pki / "server.crt"), "key_file": str(pki / "server.key"), **extra}}


async def test_tls_serves_trusting_clients_and_refuses_plaintext(pki):
    async with serve(tls_cfg(pki)) as daemon:
        async with grpc.aio.secure_channel(f"127.0.0.1:{daemon.port}", creds(pki)) as ch:
            assert list((await list_workers(ch)).workers) == []
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await list_workers(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # a client that trusts another CA does not accept the server
        async with grpc.aio.secure_channel(f"127.0.0.1:{daemon.port}", creds(pki, ca="other-ca")) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await list_workers(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki):
    cfg = tls_cfg(pki, ca_file=str(pki / "ca.crt"), require_client_cert=True)
    async with serve(cfg) as daemon:
        target = f"127.0.0.1:{daemon.port}"
        async with grpc.aio.secure_channel(target, creds(pki, client="client")) as ch:
            await list_workers(ch)
        for client in (None, "rogue-client"):
            async with grpc.aio.secure_channel(target, creds(pki, client=client)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await list_workers(ch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, client


async def test_rotated_certificate_files_are_used_by_new_connections(pki, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key"):
        shutil.copy(pki / name, live / name)
    cfg = {"tls": {"cert_file": str(live / "server.crt"), "key_file": str(live / "server.key")}}
    async with serve(cfg) as daemon:
        target = f"127.0.0.1:{daemon.port}"
        async with grpc.aio.secure_channel(target, creds(pki)) as ch:
            await list_workers(ch)
        # rotate to a certificate from another CA the way a Secret update does: new files, renamed in
        for name in ("crt", "key"):
            shutil.copy(pki / f"server2.{name}", live / f"next.{name}")
            os.replace(live / f"next.{name}", live / f"server.{name}")
        async with grpc.aio.secure_channel(target, creds(pki, ca="other-ca")) as ch:
            await list_workers(ch)
        assert daemon.certificates is not None and daemon.certificates.reloads == 1
        async with grpc.aio.secure_channel(target, creds(pki)) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await list_workers(ch)
        # a broken update keeps the current certificates
        (live / "server.crt").write_text("not a certificate\n")
        async with grpc.aio.secure_channel(target, creds(pki, ca="other-ca")) as ch:
            await list_workers(ch)


def test_unreadable_tls_files_fail_at_start(tmp_path):
    import asyncio

    cfg = {"tls": {"cert_file": str(tmp_path / "missing.crt"), "key_file": str(tmp_path / "missing.key")}}
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", **cfg}))
    with pytest.raises(ConfigError, match="tls"):
        asyncio.run(daemon.start())


# ---- bearer tokens -------------------------------------------------------------------------

def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


WORKER = pb.RegisterWorkerRequest(worker=pb.Worker(id="w", address="w:1", mode=pb.CACHE_STATE_MODE_EVENTS))


async def test_token_guards_control_rpcs_and_leaves_the_data_path_open(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-one\n")
    async with serve({"auth": {"token_file": str(token_file)}}) as daemon, grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        stub = router_pb2_grpc.KVRouterStub(ch)
        for md in (None, bearer("wrong"), [("authorization", "s3cret-one")]):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterWorker(WORKER, metadata=md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(daemon.router.workers) == 0
        await stub.RegisterWorker(WORKER, metadata=bearer("s3cret-one"))

        batch = pb.EventBatch(worker_id="w", sequence=0, events=[stored(list(range(16)), [1])])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await publish(stub, batch)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(daemon.router.index) == 0

        async def one():
            yield batch

        summary = await stub.PublishEvents(one(), metadata=bearer("s3cret-one"))
        assert summary.batches_applied == 1

        # data path and read-only calls need no token
        resp = await stub.Route(pb.RouteRequest(token_ids=list(range(32))))
        assert resp.worker_id == "w" and resp.matched_blocks == 1
        await stub.Complete(pb.CompleteRequest(request_id=resp.request_id, success=True))
        await stub.ListWorkers(pb.ListWorkersRequest())
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="w"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # calls that steer routing or reveal the fleet are protected by default too (issue #16)
        for call in (stub.ReportLoad(pb.ReportLoadRequest(worker_id="w", queued_requests=999)),
                     stub.EvictHint(pb.EvictHintRequest(worker_id="w", blocks=1))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [c async for c in stub.ExportIndex(pb.ExportIndexRequest())]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert daemon.router.workers.get("w").reported_queue == 0
        # the scheme name is case-insensitive (RFC 7235)
        await stub.EvictHint(pb.EvictHintRequest(worker_id="w", blocks=1), metadata=[("authorization", "bEARER s3cret-one")])

        # rotation: the file now accepts a new and an old token, then only the new one
        token_file.write_text("s3cret-two\ns3cret-one\n")
        await stub.RegisterWorker(WORKER, metadata=bearer("s3cret-two"))
        await stub.RegisterWorker(WORKER, metadata=bearer("s3cret-one"))
        token_file.write_text("s3cret-two-and-longer\n")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterWorker(WORKER, metadata=bearer("s3cret-one"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="w"), metadata=bearer("s3cret-two-and-longer"))
        assert len(daemon.router.workers) == 0


async def test_protect_list_can_cover_the_engine_rpcs_too():
    env_name = "KVROUTERD_TEST_TOKEN_7"
    os.environ[env_name] = "tok"
    try:
        async with serve({"auth": {"token_env": env_name, "protect": ["ReportLoad", "EvictHint"]}}) as daemon, grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            stub = router_pb2_grpc.KVRouterStub(ch)
            await stub.RegisterWorker(WORKER)  # not listed: open
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w", queued_requests=3))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert daemon.router.workers.get("w").reported_queue == 0
            await stub.ReportLoad(pb.ReportLoadRequest(worker_id="w", queued_requests=3), metadata=bearer("tok"))
            assert daemon.router.workers.get("w").reported_queue == 3
    finally:
        del os.environ[env_name]


async def test_protecting_route_protects_route_stream_too():
    env_name = "KVROUTERD_TEST_TOKEN_8"
    os.environ[env_name] = "tok"
    try:
        async with serve({"auth": {"token_env": env_name, "protect": ["Route"]}}) as daemon, grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            stub = router_pb2_grpc.KVRouterStub(ch)
            await stub.RegisterWorker(WORKER)
            message = pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=[1] * 32))
            call = stub.RouteStream()
            await call.write(message)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert daemon.router.workers.inflight_count == 0
            call = stub.RouteStream(metadata=bearer("tok"))
            await call.write(message)
            assert (await call.read()).route.worker_id == "w"
            await call.done_writing()
    finally:
        del os.environ[env_name]


async def test_refused_tokens_are_counted_and_logged_sampled_like_other_rejections(caplog):
    # one WARNING line per refused call let a client without a token write unbounded log
    env_name = "KVROUTERD_TEST_TOKEN_9"
    os.environ[env_name] = "tok"
    try:
        async with serve({"auth": {"token_env": env_name}}) as daemon, grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
            caplog.set_level(logging.INFO, logger="kvrouterd.server")
            ledger = daemon.service.call_errors
            ledger._rejections.clock = lambda: 0.0  # one sampling interval, however loaded the machine
            stub = router_pb2_grpc.KVRouterStub(ch)
            for md in [None, bearer("wrong")] * 20:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RegisterWorker(WORKER, metadata=md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError):
                await publish(stub, pb.EventBatch(worker_id="w", sequence=0))
            await stub.RegisterWorker(WORKER, metadata=bearer("tok"))  # accepted: not counted
            assert ledger.rejected_count("RegisterWorker", "UNAUTHENTICATED") == 40
            assert ledger.rejected_count("PublishEvents", "UNAUTHENTICATED") == 1
            lines = [r for r in caplog.records if "rejected (UNAUTHENTICATED)" in r.getMessage()]
            assert len(lines) == LOG_BURST + 1 and all(r.levelno == logging.WARNING for r in lines)
            ledger.flush(now=float("inf"))
            summaries = [r.getMessage() for r in caplog.records if "suppressed" in r.getMessage()]
            assert summaries == [f"RegisterWorker UNAUTHENTICATED: suppressed {40 - LOG_BURST} more rejections"]
    finally:
        del os.environ[env_name]


def test_missing_token_fails_at_start(tmp_path):
    import asyncio

    for auth, match in (
        ({"token_env": "KVROUTERD_TEST_UNSET_VAR"}, "unset or empty"),
        ({"token_file": str(tmp_path / "nope")}, "cannot read"),
    ):
        daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "auth": auth}))
        with pytest.raises(ConfigError, match=match):
            asyncio.run(daemon.start())
    (tmp_path / "empty").write_text("\n\n")
    daemon = Daemon(parse_config({"listen": "127.0.0.1:0", "auth": {"token_file": str(tmp_path / "empty")}}))
    with pytest.raises(ConfigError, match="holds no token"):
        asyncio.run(daemon.start())


# ---- limits ---------------------------------------------------------------------------------

async def test_batch_and_message_limits_are_enforced_without_changing_state():
    cfg = {"limits": {"max_batch_events": 4, "max_message_bytes": 8192}}
    async with serve(cfg) as daemon, grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
        stub = router_pb2_grpc.KVRouterStub(ch)
        await stub.RegisterWorker(WORKER)
        big = pb.EventBatch(worker_id="w", sequence=0, events=[stored(list(range(16 * i, 16 * i + 16)), [i]) for i in range(5)])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await publish(stub, big)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_batch_events=4" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Route(pb.RouteRequest(token_ids=list(range(1 << 20, (1 << 20) + 4096))))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(daemon.router.index) == 0 and daemon.router.workers.inflight_count == 0
