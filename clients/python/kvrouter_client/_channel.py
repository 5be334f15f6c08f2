"""Channels shared by the SDK's clients: options, TLS, bearer tokens."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

__all__ = ["CONNECT_BACKOFF_MAX_S", "TLS", "channel_options", "open_aio_channel", "open_channel"]

#: longest pause between two connection attempts of a publisher's channel. A refused connect
#: costs the router nothing, and a longer pause is time a restarted router spends without its
#: engines' caches (issue #28: a 5 s cap made READY come 4.6-9.8 s after SERVING)
CONNECT_BACKOFF_MAX_S = 0.5


def channel_options(options: Iterable[tuple[str, Any]], initial_backoff_s: float, max_backoff_s: float) -> list[tuple[str, Any]]:
    """Caller options plus a reconnect backoff that suits a router: gRPC's default (1 s growing
    to 120 s) would keep a restarted router unused for minutes."""
    opts = list(options)
    names = {name for name, _ in opts}
    for name, value in (("grpc.initial_reconnect_backoff_ms", int(initial_backoff_s * 1000)),
                        ("grpc.min_reconnect_backoff_ms", int(initial_backoff_s * 1000)),
                        ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000))):
        if name not in names:
            opts.append((name, max(1, value)))
    return opts


@dataclass(frozen=True)
class TLS:
    """TLS to the router. ``ca_file`` trusts a private CA (empty: the system's roots);
    ``cert_file`` and ``key_file`` together present a client certificate (mutual TLS);
    ``server_name`` overrides the name the router's certificate must carry (empty: the target's host)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS: pass both cert_file and key_file (mutual TLS), or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


def _token_value(token: str | None, token_file: str | None) -> str:
    if token and token_file:
        raise ValueError("pass token or token_file, not both")
    if token_file:
        lines = Path(token_file).read_text().splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise ValueError(f"token_file {token_file}: empty")
    return token or ""


class _ClientCallDetails(
    namedtuple("_ClientCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    """The sync interceptor API wants a ClientCallDetails it can build."""


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call (blocking channels)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> _ClientCallDetails:
        return _ClientCallDetails(d.method, d.timeout, [*(d.metadata or ()), self.header], d.credentials,
                                  getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)


class _AioBearer:
    """Adds ``authorization: Bearer <token>`` to every call (asyncio channels). grpc.aio files
    each interceptor under one call kind only, so there is one subclass per kind."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d: aio.ClientCallDetails) -> aio.ClientCallDetails:
        return d._replace(metadata=aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), self.header))


class _AioBearerUnaryUnary(_AioBearer, aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _AioBearerUnaryStream(_AioBearer, aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _AioBearerStreamUnary(_AioBearer, aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), requests)


class _AioBearerStreamStream(_AioBearer, aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), requests)


def _aio_bearer(token: str) -> list[aio.ClientInterceptor]:
    return [kind(token) for kind in (_AioBearerUnaryUnary, _AioBearerUnaryStream, _AioBearerStreamUnary, _AioBearerStreamStream)]


def open_aio_channel(target: str, options: list[tuple[str, Any]], tls: TLS | None,
                     token: str | None, token_file: str | None) -> aio.Channel:
    """The SDK's own asyncio channel: plaintext, or TLS; with a bearer token on every call if given."""
    bearer = _token_value(token, token_file)
    interceptors = _aio_bearer(bearer) if bearer else None
    if tls is not None:
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
        return aio.secure_channel(target, tls.credentials(), options=options, interceptors=interceptors)
    return aio.insecure_channel(target, options=options, interceptors=interceptors)


def open_channel(target: str, options: list[tuple[str, Any]], tls: TLS | None,
                 token: str | None, token_file: str | None) -> grpc.Channel:
    """The blocking twin of open_aio_channel."""
    bearer = _token_value(token, token_file)
    if tls is not None:
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
        channel = grpc.secure_channel(target, tls.credentials(), options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(channel, _BearerToken(bearer)) if bearer else channel
