"""A fake Kubernetes API server on 127.0.0.1 that serves scripted pod lists and watches.

Lists are answered from ``lists`` in order (the last one repeats). Each watch request takes
the next script from ``watches``: a ``Reply`` is sent as a plain response (e.g. 410 Gone),
an ``asyncio.Queue`` is streamed with chunked encoding, one JSON line per event put on it,
until ``None`` ends the watch. With no script left the watch hangs, as a quiet real one does.
Every request is recorded with its path, query and headers.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit


@dataclass
class Reply:
    status: int
    body: Any
    chunked: bool = False


@dataclass
class Request:
    path: str
    query: dict[str, str]
    headers: dict[str, str]


@dataclass
class FakeKubeApi:
    lists: list[Reply] = field(default_factory=list)
    watches: list[Reply | asyncio.Queue] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    port: int = 0
    _server: asyncio.AbstractServer | None = None
    _handlers: set[asyncio.Task] = field(default_factory=set)

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    def watch(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.watches.append(q)
        return q

    def list_requests(self) -> list[Request]:
        return [r for r in self.requests if "watch" not in r.query]

    def watch_requests(self) -> list[Request]:
        return [r for r in self.requests if "watch" in r.query]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            request_line = (await reader.readline()).decode()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            target = urlsplit(request_line.split(" ")[1])
            req = Request(target.path, dict(parse_qsl(target.query)), headers)
            self.requests.append(req)
            if "watch" in req.query:
                script = self.watches.pop(0) if self.watches else None
                if script is None:
                    await asyncio.Event().wait()
                elif isinstance(script, Reply):
                    await self._reply(writer, script)
                else:
                    await self._stream(writer, script)
            else:
                reply = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
                await self._reply(writer, reply)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    async def _reply(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
        reason = {200: "OK", 410: "Gone", 500: "Internal Server Error", 403: "Forbidden"}.get(reply.status, "X")
        if reply.chunked:
            writer.write(f"HTTP/1.1 {reply.status} {reason}\r\nContent-Type: application/json\r\n"
                         f"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode())
            half = len(body) // 2
            for part in (body[:half], body[half:]):
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(f"HTTP/1.1 {reply.status} {reason}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, q: asyncio.Queue) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        while (event := await q.get()) is not None:
            data = (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n"
            # split every event over two chunks: the client must reassemble lines across chunks
            half = len(data) // 2
            for part in (data[:half], data[half:]):
                writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def pod(name: str, ip: str | None = "10.0.0.1", *, ready: bool = True, phase: str = "Running", uid: str | None = None,
        rv: str = "1", labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        ports: list[dict[str, Any]] | None = None, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "llm", "uid": uid or f"uid-{name}", "resourceVersion": rv,
                            "labels": labels if labels is not None else {"app": "vllm"}}
    if annotations:
        meta["annotations"] = annotations
    if terminating:
        meta["deletionTimestamp"] = "2026-11-21T20:00:00Z"
    status: dict[str, Any] = {"phase": phase,
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta,
            "spec": {"containers": [{"name": "engine", "ports": ports or [
                {"name": "http", "containerPort": 8000}, {"name": "kv-events", "containerPort": 5557}]}]},
            "status": status}


def pod_list(pods: list[dict[str, Any]], rv: str) -> Reply:
    return Reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": rv}, "items": pods})


def event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def gone_event() -> dict[str, Any]:
    return {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "message": "too old resource version: 1 (50)", "reason": "Expired",
                                        "code": 410}}


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``cond()`` holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)
