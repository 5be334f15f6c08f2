"""A minimal asyncio client for the two Kubernetes API calls discovery needs: list and watch pods.

HTTP/1.1 over ``asyncio`` streams (TLS with the service-account CA), one connection per call
with ``Connection: close``, bearer token re-read from its file on every call because projected
service-account tokens rotate. The ``kubernetes`` package would pull in dozens of
dependencies for these two GETs.

Watch responses are a stream of JSON objects, one per line (chunked transfer encoding);
``watch_pods`` yields them as dicts. A 410 Gone, as an HTTP status or as an ``ERROR`` event,
raises ``Gone``: the resource version is too old and the caller must list again.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from ..errors import ConfigError
from .config import KubernetesDiscoveryConfig

__all__ = ["ApiError", "Gone", "KubeApi"]

#: a single watch event larger than this is treated as a broken stream (pods are a few KiB)
MAX_LINE_BYTES = 8 * 1024 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024


class ApiError(Exception):
    """The API server answered with an error status, or the connection broke."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class Gone(ApiError):
    """410: the resource version we watch from has been compacted away; list again."""


class _Response:
    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, read_timeout: float) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self._writer = writer
        self._timeout = read_timeout

    async def _read(self, coro: Any) -> bytes:
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except TimeoutError:
            raise ApiError(0, f"no data from the API server for {self._timeout:.0f}s") from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ApiError(0, f"connection to the API server broke: {exc}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await self._read(self._reader.readuntil(b"\r\n"))
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ApiError(0, f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    return
                data = await self._read(self._reader.readexactly(size + 2))
                yield data[:-2]
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            if remaining > MAX_BODY_BYTES:
                raise ApiError(0, f"response of {remaining} bytes is too large")
            while remaining > 0:
                data = await self._read(self._reader.read(min(remaining, 1 << 16)))
                if not data:
                    raise ApiError(0, "connection closed before the end of the response")
                remaining -= len(data)
                yield data
        else:
            while data := await self._read(self._reader.read(1 << 16)):
                yield data

    async def body(self) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(0, f"response larger than {MAX_BODY_BYTES} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, ssl.SSLError):
            pass


def _error_message(body: bytes) -> str:
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
        parts = urlsplit(url)
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")
        self.cfg = cfg
        self._ssl: ssl.SSLContext | None = None
        if self.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=cfg.ca_file if os.path.exists(cfg.ca_file) else None)

    def _token(self) -> str:
        try:
            with open(self.cfg.token_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError:
            return ""  # an API server that allows anonymous reads (tests, kubectl proxy)

    async def _get(self, path: str, query: Mapping[str, str], read_timeout: float) -> _Response:
        target = f"{self.base_path}{path}?{urlencode(query)}"
        lines = [f"GET {target} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: application/json",
                 "User-Agent: kvrouterd-discovery", "Connection: close"]
        if token := self._token():
            lines.append(f"Authorization: Bearer {token}")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=MAX_LINE_BYTES), 30.0)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise ApiError(0, f"cannot connect to the API server {self.host}:{self.port}: {exc}") from None
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        try:
            status_line = await asyncio.wait_for(reader.readline(), read_timeout)
            parts = status_line.decode("latin-1").split(" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise ApiError(0, f"bad status line from the API server: {status_line[:80]!r}")
            headers: dict[str, str] = {}
            while (line := await asyncio.wait_for(reader.readline(), read_timeout)) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
        except (OSError, TimeoutError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            raise ApiError(0, f"no valid response from the API server: {exc!r}") from None
        except BaseException:
            writer.close()
            raise
        return _Response(int(parts[1]), headers, reader, writer, read_timeout)

    def _pods_path(self, namespace: str) -> str:
        return f"/api/v1/namespaces/{quote(namespace, safe='')}/pods"

    async def list_pods(self, namespace: str, label_selector: str) -> tuple[list[dict[str, Any]], str]:
        """Every matching pod and the list's resourceVersion (where a watch starts)."""
        resp = await self._get(self._pods_path(namespace), {"labelSelector": label_selector}, 60.0)
        try:
            body = await resp.body()
        finally:
            await resp.close()
        if resp.status != 200:
            raise (Gone if resp.status == 410 else ApiError)(resp.status, _error_message(body))
        try:
            doc = json.loads(body)
            return list(doc.get("items") or []), str(doc["metadata"]["resourceVersion"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ApiError(resp.status, f"malformed pod list: {exc!r}") from None

    async def watch_pods(self, namespace: str, label_selector: str, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type": ..., "object": ...}``) after ``resource_version`` until the server ends the watch."""
        query = {"labelSelector": label_selector, "watch": "1", "resourceVersion": resource_version,
                 "allowWatchBookmarks": "true", "timeoutSeconds": str(self.cfg.watch_timeout_s)}
        # the server sends a bookmark or an event at least that often only if something happens;
        # a watch that says nothing past its own timeout is a dead connection
        resp = await self._get(self._pods_path(namespace), query, self.cfg.watch_timeout_s + 30.0)
        try:
            if resp.status != 200:
                body = await resp.body()
                raise (Gone if resp.status == 410 else ApiError)(resp.status, _error_message(body))
            buf = b""
            async for chunk in resp.chunks():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > MAX_LINE_BYTES:
                    raise ApiError(0, "watch event larger than the line limit")
                for line in lines:
                    if line.strip():
                        yield self._event(line)
            if buf.strip():
                yield self._event(buf)
        finally:
            await resp.close()

    @staticmethod
    def _event(line: bytes) -> dict[str, Any]:
        try:
            event = json.loads(line)
        except ValueError:
            raise ApiError(0, f"malformed watch event {line[:80]!r}") from None
        if not isinstance(event, dict):
            raise ApiError(0, f"malformed watch event {line[:80]!r}")
        if event.get("type") == "ERROR":
            status = event.get("object") or {}
            code = int(status.get("code") or 0)
            raise (Gone if code == 410 else ApiError)(code, str(status.get("message") or "watch error"))
        return event
