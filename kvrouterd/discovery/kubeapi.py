"""The two Kubernetes API calls discovery needs, list and watch pods, on ``kubernetes_asyncio``.

``kubernetes_asyncio`` (the asyncio port of the official client) does the HTTP, TLS against
the service-account CA, and the watch stream's framing and ``ERROR`` events; this module only
adapts it to what ``KubernetesDiscovery`` expects:

* pods as plain dicts, exactly as the API server sent them (``_preload_content=False`` and
  the watch's ``raw_object``), so ``pods.Membership`` reads the same JSON as ``kubectl``;
* the bearer token read from its file on every request (``_request_auth``), because projected
  service-account tokens rotate; no file = anonymous (tests, ``kubectl proxy``);
* a 410 Gone, as an HTTP status or as a watch ``ERROR`` event, raised as ``Gone`` (the caller
  lists again and applies the difference); every other failure as ``ApiError``. Relisting and
  back-off stay with the caller, so one loop owns them.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from .config import KubernetesDiscoveryConfig

if TYPE_CHECKING:
    from kubernetes_asyncio import client as k8s

__all__ = ["ApiError", "Gone", "KubeApi"]

# kubernetes_asyncio and aiohttp are imported where they are used: importing them takes about
# half a second (every generated model), which a daemon without discovery should not pay.

#: seconds a list may take, connection included
LIST_TIMEOUT_S = 60.0


class ApiError(Exception):
    """The API server answered with an error status, or the connection broke."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class Gone(ApiError):
    """410: the resource version we watch from has been compacted away; list again."""


def _error(status: int, message: str) -> ApiError:
    return (Gone if status == 410 else ApiError)(status, message)


def _status_message(body: bytes) -> str:
    try:
        status = json.loads(body)
        return str(status.get("message") or status.get("reason") or body[:200])
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


class KubeApi:
    """List and watch pods in one namespace through the API server's REST interface."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        url = cfg.api_server
        if not url:
            host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError("discovery.kubernetes.api_server: not running in a pod "
                                  "(KUBERNETES_SERVICE_HOST unset); set the API server URL")
            url = f"https://{host if ':' not in host else f'[{host}]'}:{port}"
        self.cfg = cfg
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.scheme, self.host = parts.scheme, parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        from kubernetes_asyncio import client as k8s

        self.configuration = k8s.Configuration(host=self.url)
        if os.path.exists(cfg.ca_file):
            self.configuration.ssl_ca_cert = cfg.ca_file  # else the system's roots
        self._client: k8s.ApiClient | None = None

    def _core(self) -> k8s.CoreV1Api:
        from kubernetes_asyncio import client as k8s

        # the aiohttp session behind ApiClient must be made on the running loop
        if self._client is None:
            self._client = k8s.ApiClient(self.configuration)
        return k8s.CoreV1Api(self._client)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _auth(self) -> dict[str, Any]:
        """Per-request auth with the token file's current content ({} = anonymous)."""
        try:
            with open(self.cfg.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError:
            return {}
        return {"_request_auth": {"in": "header", "key": "authorization", "value": f"Bearer {token}"}} if token else {}

    async def list_pods(self, namespace: str, label_selector: str) -> tuple[list[dict[str, Any]], str]:
        """Every matching pod and the list's resourceVersion (where a watch starts)."""
        import aiohttp

        try:
            resp = await self._core().list_namespaced_pod(
                namespace, label_selector=label_selector, _preload_content=False,
                _request_timeout=LIST_TIMEOUT_S, **self._auth())
            async with resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ApiError(0, f"cannot connect to the API server {self.url}: {exc}") from None
        if status != 200:
            raise _error(status, _status_message(body))
        try:
            doc = json.loads(body)
            return list(doc.get("items") or []), str(doc["metadata"]["resourceVersion"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ApiError(status, f"malformed pod list: {exc!r}") from None

    async def watch_pods(self, namespace: str, label_selector: str, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type": ..., "object": ...}``) after ``resource_version`` until the server ends the watch."""
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.watch import Watch

        # Watch(return_type="object") leaves each object a dict; timeout_seconds makes the server
        # end the watch (the caller resumes from the last version), and a watch that says
        # nothing past it plus a margin is a dead connection
        watch = Watch(return_type="object")
        stream = watch.stream(
            self._core().list_namespaced_pod, namespace, label_selector=label_selector,
            resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self.cfg.watch_timeout_s,
            _request_timeout=aiohttp.ClientTimeout(sock_connect=30.0, sock_read=self.cfg.watch_timeout_s + 30.0),
            **self._auth())
        try:
            while True:
                try:
                    event = await stream.next()
                except StopAsyncIteration:
                    return
                except ApiException as exc:  # an HTTP error status, or an ERROR event in the stream
                    raise _error(exc.status or 0, str(exc.reason)) from None
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    raise ApiError(0, f"watch on the API server {self.url} broke: {exc!r}") from None
                except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for a malformed event
                    raise ApiError(0, f"watch on the API server {self.url}: {exc}") from None
                if not isinstance(event, dict):  # not JSON: a proxy's error page, or a broken stream
                    status = getattr(watch.resp, "status", 0)
                    raise _error(status if status != 200 else 0, f"malformed watch event {str(event)[:80]!r}")
                yield {"type": event["type"], "object": event["raw_object"]}
        finally:
            await watch.close()
