"""The container's health check: ask the running daemon's gRPC health service where it listens.

``python -m kvrouterd.server.healthcheck`` (the image's HEALTHCHECK) finds the ``kvrouterd
serve`` process in the container (PID 1, or its child under ``docker run --init``), reads its
command line, environment and working directory from /proc, and builds the config the daemon
built: its ``--config`` file (or ``KVROUTERD_CONFIG``), its ``KVROUTERD_*`` variables, then its
``--listen`` flag. It then calls ``grpc.health.v1.Health/Check`` (service ``""``) on that
address, over TLS when the config turns TLS on, presenting the daemon's own certificate and key
when the daemon requires client certificates. Exit status 0 = SERVING, 1 = anything else.

A wildcard listen address is dialled on loopback (``0.0.0.0`` as 127.0.0.1, ``[::]`` as
[::1]); a specific one as it is. Over TLS the server certificate is verified against
``--ca-file``, else the config's ``tls.ca_file``, else the daemon's own certificate (a
self-signed one), and must name the dialled address unless ``--server-name`` gives the name to
check instead (``docker run --health-cmd "python -m kvrouterd.server.healthcheck --server-name
router.example.com" ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, load_config
from ..decimals import decimal_arg, parse_decimal
from ..errors import ConfigError

__all__ = ["DaemonProcess", "dial_address", "find_daemon", "main", "read_daemon"]

#: seconds the Check RPC may take (Docker's HEALTHCHECK timeout is 3 s)
CHECK_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class DaemonProcess:
    """How a ``kvrouterd serve`` process was started."""

    pid: int
    argv: list[str]
    environ: dict[str, str]
    cwd: Path

    def config(self) -> Config:
        """The config the daemon built: file, then its KVROUTERD_* variables, then --listen."""
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--listen")
        parser.add_argument("--config")
        args, _ = parser.parse_known_args(self.argv[self.argv.index("serve") + 1:])
        path = args.config or self.environ.get("KVROUTERD_CONFIG") or None
        if path:
            path = str(self.cwd / path)  # relative to the daemon's directory, not ours
        overrides = {"listen": args.listen} if args.listen else {}
        return load_config(path, overrides, environ={k: v for k, v in self.environ.items() if k != "KVROUTERD_CONFIG"})


def _is_serve(argv: Sequence[str]) -> bool:
    return "serve" in argv and any(Path(a).name == "kvrouterd" or a == "kvrouterd" for a in argv[: argv.index("serve")])


def read_daemon(pid: int, proc: Path = Path("/proc")) -> DaemonProcess | None:
    """The process ``pid`` if it is a ``kvrouterd serve`` (None if not, or gone)."""
    base = proc / str(pid)
    try:
        argv = (base / "cmdline").read_bytes().split(b"\0")
        environ = (base / "environ").read_bytes().split(b"\0")
        cwd = Path(os.readlink(base / "cwd"))
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv if a]
    if not _is_serve(args):
        return None
    env = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if b"=" in e)
    return DaemonProcess(pid, args, env, cwd)


def find_daemon(proc: Path = Path("/proc")) -> DaemonProcess | None:
    """PID 1 when it is the daemon (the image's ENTRYPOINT), else the first ``kvrouterd serve`` found."""
    if (daemon := read_daemon(1, proc)) is not None:
        return daemon
    pids = sorted(pid for p in proc.iterdir() if (pid := parse_decimal(p.name)) is not None and pid not in (1, os.getpid()))
    for pid in pids:
        if (daemon := read_daemon(pid, proc)) is not None:
            return daemon
    return None


def dial_address(listen: str) -> str:
    """Where a client in the same network namespace reaches a listener bound to ``listen``."""
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def check(cfg: Config, ca_file: str | None = None, server_name: str | None = None) -> bool:
    """One Health/Check against the daemon ``cfg`` describes; True when it answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = dial_address(cfg.listen)
    if cfg.tls.enabled:
        root = Path(ca_file or cfg.tls.ca_file or cfg.tls.cert_file).read_bytes()
        key = cert = None
        if cfg.tls.require_client_cert:  # the daemon's own pair doubles as the client certificate
            key, cert = Path(cfg.tls.key_file).read_bytes(), Path(cfg.tls.cert_file).read_bytes()
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root, key, cert), options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            print(f"kvrouterd health check: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return False
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"kvrouterd health check: {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrouterd.server.healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--pid", type=decimal_arg, help="the daemon's process id (default: found in /proc)")
    parser.add_argument("--ca-file", help="verify the server certificate against this CA (default: see above)")
    parser.add_argument("--server-name", help="the name the server certificate must carry (default: the dialled host)")
    args = parser.parse_args(argv)
    daemon = read_daemon(args.pid) if args.pid else find_daemon()
    if daemon is None:
        print("kvrouterd health check: no `kvrouterd serve` process found", file=sys.stderr)
        return 1
    try:
        cfg = daemon.config()
    except ConfigError as exc:
        print(f"kvrouterd health check: the daemon's configuration: {exc}", file=sys.stderr)
        return 1
    try:
        return 0 if check(cfg, args.ca_file, args.server_name) else 1
    except OSError as exc:
        print(f"kvrouterd health check: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
