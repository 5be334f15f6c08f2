"""The API client's in-cluster behaviour: HTTPS verified against the service-account CA,
the API server address from the pod's environment, and token rotation."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvrouterd.discovery import ApiError, KubeApi, KubernetesDiscoveryConfig
from kvrouterd.errors import ConfigError

from .fake_kube import FakeKubeApi, pod, pod_list


def _self_signed(where: Path, name: str) -> tuple[Path, Path]:
    cert, key = where / f"{name}.crt", where / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    server_cert, server_key = _self_signed(tmp_path, "server")
    other_cert, _ = _self_signed(tmp_path, "other")
    token = tmp_path / "token"
    token.write_text("token-a")
    return {"cert": server_cert, "key": server_key, "other": other_cert, "token": token}


@pytest.fixture
async def https_api(certs: dict[str, Path]) -> AsyncIterator[tuple[FakeKubeApi, str]]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs["cert"], certs["key"])
    fake = FakeKubeApi(lists=[pod_list([pod("vllm-0", "10.0.0.1")], rv="7")])
    url = await fake.start(ctx)
    yield fake, url
    await fake.stop()


async def test_https_verified_against_the_service_account_ca(https_api, certs) -> None:  # type: ignore[no-untyped-def]
    fake, url = https_api
    api = KubeApi(KubernetesDiscoveryConfig(api_server=url, ca_file=str(certs["cert"]), token_file=str(certs["token"])))
    pods, rv = await api.list_pods("llm", "app=vllm")
    assert [p["metadata"]["name"] for p in pods] == ["vllm-0"] and rv == "7"
    assert fake.requests[0].headers["authorization"] == "Bearer token-a"
    # projected tokens rotate: every request reads the file again
    certs["token"].write_text("token-b\n")
    await api.list_pods("llm", "app=vllm")
    assert fake.requests[1].headers["authorization"] == "Bearer token-b"
    await api.close()


async def test_https_with_an_untrusted_certificate_is_refused(https_api, certs) -> None:  # type: ignore[no-untyped-def]
    fake, url = https_api
    api = KubeApi(KubernetesDiscoveryConfig(api_server=url, ca_file=str(certs["other"]), token_file=str(certs["token"])))
    with pytest.raises(ApiError, match="cannot connect"):
        await api.list_pods("llm", "app=vllm")
    await api.close()
    assert fake.requests == []  # the token never left the process


@pytest.mark.parametrize(
    ("host", "port", "url_host"),
    [("10.96.0.1", "443", "10.96.0.1"), ("fd00:10:96::1", "6443", "fd00:10:96::1")],
)
def test_in_cluster_api_server_comes_from_the_pod_environment(host: str, port: str, url_host: str) -> None:
    api = KubeApi(KubernetesDiscoveryConfig(), environ={"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port})
    assert (api.scheme, api.host, api.port) == ("https", url_host, int(port))


def test_without_environment_or_api_server_it_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        KubeApi(KubernetesDiscoveryConfig(), environ={})


async def test_a_non_json_list_is_an_api_error(tmp_path: Path) -> None:
    from .fake_kube import Reply

    fake = FakeKubeApi(lists=[Reply(200, b"<html>proxy login</html>")])
    url = await fake.start()
    try:
        api = KubeApi(KubernetesDiscoveryConfig(api_server=url, token_file=str(tmp_path / "none")))
        with pytest.raises(ApiError, match="malformed pod list"):
            await api.list_pods("llm", "app=vllm")
        await api.close()
        assert "authorization" not in fake.requests[0].headers  # no token file: anonymous
    finally:
        await fake.stop()


def test_a_daemon_without_discovery_does_not_import_the_kubernetes_client() -> None:
    import subprocess
    import sys

    code = "import sys, kvrouterd.server.app; print('kubernetes_asyncio' in sys.modules, 'aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
