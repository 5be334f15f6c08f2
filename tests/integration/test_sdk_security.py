"""The SDK's TLS and bearer-token options against a real daemon with TLS and auth on."""

from __future__ import annotations

import asyncio

import pytest
from kvrouter_client import TLS, EventPublisher, RouterClient, RouterRejected, SyncRouterClient

from .test_security import pki, serve, tls_cfg  # noqa: F401  (pki is a fixture)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return path


async def test_router_client_and_publisher_over_mutual_tls_with_a_token(pki, token_file):  # noqa: F811
    cfg = {**tls_cfg(pki, ca_file=str(pki / "ca.crt"), require_client_cert=True),
           "auth": {"token_file": str(token_file), "protect": ["RegisterWorker", "PublishEvents", "ListWorkers"]}}
    tls = TLS(ca_file=str(pki / "ca.crt"), cert_file=str(pki / "client.crt"), key_file=str(pki / "client.key"),
              server_name="localhost")
    async with serve(cfg) as daemon:
        target = f"127.0.0.1:{daemon.port}"
        async with EventPublisher(target, "gpu-0", block_size=16, tls=tls, token_file=str(token_file)) as pub:
            await pub.register("10.0.0.5:8000", capacity_blocks=100)
            pub.stored(list(range(64)))
            assert await pub.flush(5.0)
        assert len(daemon.router.index) == 4

        async with RouterClient(target, tls=tls, token="s3cret-token", timeout=5) as router:
            assert (await router.route(list(range(64)))).worker_id == "gpu-0"
            assert [w.id for w in await router.list_workers()] == ["gpu-0"]

        # without the token the protected call is refused; the data path stays open
        async with RouterClient(target, tls=tls, timeout=5, streams=0) as router:
            assert (await router.route(list(range(64)))).worker_id == "gpu-0"
            with pytest.raises(RouterRejected) as err:
                await router.list_workers()
            assert err.value.code.name == "UNAUTHENTICATED"

        sync = await asyncio.to_thread(SyncRouterClient, target, tls=tls, token_file=str(token_file), timeout=5)
        try:
            workers = await asyncio.to_thread(sync.list_workers)
            assert [w.id for w in workers] == ["gpu-0"]
        finally:
            sync.close()


def test_half_a_client_pair_or_two_token_sources_are_refused(token_file):
    with pytest.raises(ValueError, match="cert_file and key_file"):
        TLS(cert_file="c.crt")
    with pytest.raises(ValueError, match="token or token_file"):
        RouterClient("127.0.0.1:1", token="a", token_file=str(token_file))
