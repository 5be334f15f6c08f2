"""Transport security and caller authentication for the gRPC port.

* **TLS / mutual TLS** (config ``tls``): the server certificate chain, key and client CA come
  from files and are re-read when any of them changes, so a rotated Kubernetes Secret (or a
  cert-manager renewal) takes effect on the next connection without a restart. gRPC asks
  ``CertificateFiles.fetch`` at each new handshake; it costs one ``stat`` per file and
  returns None (keep the current certificates) unless a file changed. A half-written or
  unreadable update is logged and the previous certificates stay in use.
* **Bearer tokens** (config ``auth``): ``TokenAuthInterceptor`` checks
  ``authorization: Bearer <token>`` on the methods listed in ``auth.protect`` (by default
  the control RPCs RegisterWorker, DeregisterWorker and PublishEvents) with a constant-time
  comparison and answers UNAUTHENTICATED otherwise. The data path (Route, Complete), health
  and reflection are not checked unless listed, and pay only one set lookup per call. When
  auth is off no interceptor is installed at all. A refused call is counted and logged by the
  ledger of refused calls (``call_errors``: ``kvrouter_rpc_rejected_total{code="UNAUTHENTICATED"}``,
  WARNING lines sampled per RPC), so a caller retrying without a token costs bounded log.

Neither feature lets a caller name a file or a host: paths come only from the config file.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from .._generated.kvrouter.v1 import router_pb2
from ..config import AuthConfig, TlsConfig
from ..errors import ConfigError
from .call_errors import CallErrors

__all__ = [
    "CertificateFiles",
    "TokenAuthInterceptor",
    "TokenSource",
    "build_interceptors",
    "client_token",
    "server_credentials",
]

log = logging.getLogger("kvrouterd.server.security")

_SERVICE = router_pb2.DESCRIPTOR.services_by_name["KVRouter"]


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


class CertificateFiles:
    """The server's PEM files, re-read when their modification stamp changes."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self._paths = [p for p in (tls.cert_file, tls.key_file, tls.ca_file) if p]
        self._stamps: list[tuple[int, int, int]] = []
        #: times the certificates were replaced after start (for logs and tests)
        self.reloads = 0
        try:
            self.initial = self._load()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tls: {exc}") from None

    def _load(self) -> grpc.ServerCertificateConfiguration:
        stamps = [_stamp(p) for p in self._paths]
        cert = Path(self.tls.cert_file).read_bytes()
        key = Path(self.tls.key_file).read_bytes()
        ca = Path(self.tls.ca_file).read_bytes() if self.tls.ca_file else None
        for name, data in (("cert_file", cert), ("key_file", key), ("ca_file", ca)):
            if data is not None and b"-----BEGIN" not in data:
                raise ValueError(f"{name} {getattr(self.tls, name)!r} holds no PEM data")
        self._stamps = stamps
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC per handshake: new certificates if a file changed, else None."""
        try:
            if [_stamp(p) for p in self._paths] == self._stamps:
                return None
            config = self._load()
        except (OSError, ValueError) as exc:
            log.warning("TLS files changed but could not be loaded; keeping the current ones: %s", exc)
            return None
        self.reloads += 1
        log.info("TLS certificates reloaded", extra={"cert_file": self.tls.cert_file})
        return config


def server_credentials(tls: TlsConfig) -> tuple[grpc.ServerCredentials, CertificateFiles]:
    files = CertificateFiles(tls)
    creds = grpc.dynamic_ssl_server_credentials(
        files.initial, files.fetch, require_client_authentication=tls.require_client_cert
    )
    return creds, files


class TokenSource:
    """The accepted tokens: from an environment variable (fixed) or a file (re-read on change)."""

    def __init__(self, auth: AuthConfig, environ: Mapping[str, str] | None = None) -> None:
        self._file = auth.token_file
        self._stamp: tuple[int, int, int] | None = None
        if auth.token_env:
            env = os.environ if environ is None else environ
            token = env.get(auth.token_env, "").strip()
            if not token:
                raise ConfigError(f"auth.token_env: environment variable {auth.token_env} is unset or empty")
            self._tokens: tuple[bytes, ...] = (token.encode(),)
        else:
            try:
                self._tokens = self._read()
            except OSError as exc:
                raise ConfigError(f"auth.token_file: cannot read {self._file}: {exc.strerror}") from None
            if not self._tokens:
                raise ConfigError(f"auth.token_file: {self._file} holds no token")

    def _read(self) -> tuple[bytes, ...]:
        stamp = _stamp(self._file)
        lines = Path(self._file).read_bytes().splitlines()
        self._stamp = stamp
        return tuple(t for line in lines if (t := line.strip()))

    def tokens(self) -> tuple[bytes, ...]:
        if self._file:
            try:
                if _stamp(self._file) != self._stamp:
                    # an emptied file accepts nothing: failing closed is the safe reading
                    self._tokens = self._read()
                    log.info("auth token file reloaded", extra={"tokens": len(self._tokens)})
            except OSError as exc:
                log.warning("auth token file unreadable; keeping the current tokens: %s", exc)
        return self._tokens

    def accepts(self, presented: bytes) -> bool:
        ok = False
        for token in self.tokens():
            # every token is compared, so timing reveals neither which one matched nor how much
            ok |= hmac.compare_digest(presented, token)
        return ok


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> bytes:
    for key, value in metadata or ():
        if key == "authorization":
            raw = value.encode() if isinstance(value, str) else bytes(value)
            scheme, _, token = raw.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
    return b""


def _deny_handler(method: Any) -> grpc.RpcMethodHandler:
    message = f"{method.name} needs a valid bearer token (metadata 'authorization: Bearer <token>')"

    async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if method.client_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for protected methods called without an accepted bearer token; each
    refusal is reported to ``call_errors`` (counted, logged sampled)."""

    def __init__(self, tokens: TokenSource, protect: Sequence[str], call_errors: CallErrors) -> None:
        self.tokens = tokens
        self.call_errors = call_errors
        #: method path -> its short name and the handler that refuses it
        self._deny: dict[str, tuple[str, grpc.RpcMethodHandler]] = {}
        if {"Route", "Complete"} & set(protect):
            # RouteStream carries Route and Complete: leaving it open would bypass their token
            protect = [*protect, "RouteStream"]
        for name in protect:
            method = _SERVICE.methods_by_name[name]
            self._deny[f"/{_SERVICE.full_name}/{name}"] = name, _deny_handler(method)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        protected = self._deny.get(handler_call_details.method)
        if protected is not None and not self.tokens.accepts(_bearer(handler_call_details.invocation_metadata)):
            rpc, deny = protected
            # the deny handler is not wrapped by decoding.SafeRegistrar, so the ledger hears it here
            self.call_errors.rejected(rpc, grpc.StatusCode.UNAUTHENTICATED.name, "no accepted bearer token",
                                      level=logging.WARNING)
            return deny
        return await continuation(handler_call_details)


def client_token(auth: AuthConfig, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The token this daemon presents when it calls a peer (the first accepted one), if any."""
    return TokenSource(auth, environ).tokens()[0] if auth.enabled else None


def build_interceptors(
    auth: AuthConfig, call_errors: CallErrors, environ: Mapping[str, str] | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors for ``auth`` (none when auth is off); refusals go to ``call_errors``."""
    if not auth.enabled:
        return []
    return [TokenAuthInterceptor(TokenSource(auth, environ), auth.protect, call_errors)]
