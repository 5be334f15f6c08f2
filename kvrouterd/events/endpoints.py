"""A worker's KV-event endpoint: the addresses the subscriber dials, and whether it may.

``ZmqEndpoint`` is a worker's ``kv_events_endpoint`` parsed (publisher, replay, data-parallel
rank, model; ``rank_endpoint`` is where a rank publishes); ``EndpointAllowList`` is
``events.allowed_endpoints``, which decides whether the daemon may dial them.

A worker's ``kv_events_endpoint`` makes the daemon's ZMQ subscriber dial it (a SUB socket
and a replay DEALER). RegisterWorker is open unless auth is on, so without a rule any caller
could make the daemon connect anywhere: to scan the network behind it, or to feed it from a
host it should not trust. Every endpoint (publisher and replay) of every worker, whether
from the config file, RegisterWorker, Kubernetes discovery or a peer's index, is checked
against the allow-list before the worker is added. Entries:

``@worker``
    the host of the worker's own ``address`` (the default, and the only entry by default:
    engines publish on the machine they serve from). Compared as written (IP literals
    normalised, names case-insensitively); names are never resolved.
``10.0.0.0/8``, ``fd00::/8``, ``10.0.0.5``
    tcp endpoints whose host is an IP literal inside the network. A host *name* never
    matches a network: the daemon resolves nothing to decide (libzmq resolves when it dials).
``*.engines.svc.cluster.local``, ``vllm-*``, ``*``
    tcp endpoints whose host (name or IP as written) matches the shell-style pattern,
    case-insensitively. ``*`` allows every tcp host.
``ipc:///run/engines/*``, ``inproc://*``
    ``ipc://`` / ``inproc://`` endpoints whose path matches the pattern. Without such an entry
    they are refused: an ipc endpoint names a file on the daemon's own machine. An ipc path is
    matched normalised (``/run/engines/./a`` is ``/run/engines/a``), and one with a ``..``
    segment is refused whatever the list says: ``DIR/*`` would otherwise admit ``DIR/../x``.

An endpoint nothing allows is refused with ``errors.Forbidden`` (PERMISSION_DENIED over
gRPC; a config-file worker fails start-up; a discovered pod is logged and not routed to).
An empty list allows no endpoint: engines then publish over PublishEvents or the bus.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from ..decimals import parse_decimal
from ..errors import ConfigError, Forbidden, InvalidRequest, quote

__all__ = [
    "WORKER_HOST", "ZMQ_SCHEMES", "EndpointAllowList", "ZmqEndpoint", "check_worker_endpoints", "endpoint_host",
    "rank_endpoint",
]

#: the allow-list entry standing for the host of the worker's own address
WORKER_HOST = "@worker"

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: a DNS name or IPv4 literal as ZMQ's tcp transport reads it (no ``iface;`` source prefix)
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})$")


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint, normalised: brackets stripped, IP literals
    in canonical form, names lower-case. Raises InvalidRequest for anything else."""
    rest = endpoint.partition("://")[2]
    host = rest.rpartition(":")[0]
    return _normalise_host(host, endpoint)


def _normalise_host(host: str, shown: str) -> str:
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if bare != host or not _HOST_NAME.match(bare) or ".." in bare:
        raise InvalidRequest(f"kv_events_endpoint {quote(shown)}: host {quote(host)} is neither an IP address "
                             "nor a DNS name")
    return bare.lower().rstrip(".")


@dataclass(frozen=True)
class EndpointAllowList:
    """Parsed ``events.allowed_endpoints`` (see the module docstring)."""

    entries: tuple[str, ...] = (WORKER_HOST,)
    networks: tuple[IpNetwork, ...] = ()
    host_patterns: tuple[str, ...] = ()
    ipc_patterns: tuple[str, ...] = ()
    inproc_patterns: tuple[str, ...] = ()
    worker_host: bool = True

    @classmethod
    def parse(cls, entries: Sequence[str], where: str = "events.allowed_endpoints") -> EndpointAllowList:
        networks: list[IpNetwork] = []
        hosts: list[str] = []
        ipc: list[str] = []
        inproc: list[str] = []
        worker = False
        for i, raw in enumerate(entries):
            entry = str(raw).strip()
            if entry == WORKER_HOST:
                worker = True
            elif entry.startswith("ipc://"):
                pattern = entry[len("ipc://"):] or "*"
                if _climbs(pattern):
                    raise ConfigError(f"{where}[{i}]: {entry!r}: an ipc:// pattern must not contain '..'")
                ipc.append(posixpath.normpath(pattern))
            elif entry.startswith("inproc://"):
                inproc.append(entry[len("inproc://"):] or "*")
            elif "://" in entry:
                raise ConfigError(f"{where}[{i}]: {entry!r}: only ipc:// and inproc:// entries name a scheme "
                                  "(tcp hosts are written bare: 10.0.0.0/8, *.svc.cluster.local)")
            elif not entry:
                raise ConfigError(f"{where}[{i}]: empty entry")
            elif any(c in entry for c in "*?["):
                hosts.append(entry.lower())
            else:
                try:
                    networks.append(ipaddress.ip_network(entry.strip("[]"), strict=True))
                except ValueError as exc:
                    if "/" in entry or parse_decimal(entry.replace(".", "")) is not None or ":" in entry:
                        raise ConfigError(f"{where}[{i}]: {entry!r} is not a network: {exc}") from None
                    hosts.append(entry.lower().rstrip("."))  # one host name, matched exactly
        return cls(tuple(entries), tuple(networks), tuple(hosts), tuple(ipc), tuple(inproc), worker)

    def check(self, worker_id: str, worker_address: str, endpoint: str, name: str = "kv_events_endpoint") -> None:
        """Raise ``Forbidden`` unless ``endpoint`` (one address, no ``?query``) is allowed for a
        worker serving at ``worker_address``; InvalidRequest if its host is malformed."""
        scheme, _, path = endpoint.partition("://")
        where = f"worker {worker_id!r}: {name} {quote(endpoint)}"
        if scheme in ("ipc", "inproc"):
            patterns = self.ipc_patterns if scheme == "ipc" else self.inproc_patterns
            if scheme == "ipc":
                # libzmq dials the path as written and the kernel resolves it, so "DIR/*"
                # would admit "DIR/../x": "." and "//" are normalised away before matching,
                # and ".." is refused (normalising it is wrong past a symlink: the kernel
                # reads DIR/link/../x as the link target's parent's x, not DIR/x)
                if _climbs(path):
                    raise Forbidden(f"{where}: an ipc:// path must not contain '..'")
                path = posixpath.normpath(path)
            if any(fnmatch.fnmatchcase(path, p) for p in patterns):
                return
            raise Forbidden(f"{where}: {scheme}:// endpoints are refused unless events.allowed_endpoints lists "
                            f"a matching {scheme}:// pattern")
        host = endpoint_host(endpoint)
        if self.worker_host and worker_address:
            own = worker_address.rpartition(":")[0]
            try:
                if host == _normalise_host(own, worker_address):
                    return
            except InvalidRequest:
                pass  # a worker address that is no host cannot vouch for anything
        if self.networks:
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                ip = None
            if ip is not None and any(ip in net for net in self.networks):
                return
        if any(fnmatch.fnmatchcase(host, p) for p in self.host_patterns):
            return
        raise Forbidden(f"{where}: host {host!r} is not allowed by events.allowed_endpoints "
                        f"({', '.join(map(repr, self.entries)) or 'empty: no endpoint is allowed'})")


@dataclass(frozen=True)
class ZmqEndpoint:
    """One engine publisher as the engine was configured, and the router worker it feeds.

    ``endpoint`` / ``replay_endpoint`` are the engine's base addresses (``tcp://host:5557``);
    ``dp_rank`` selects the rank, which publishes on port + rank. ``model`` salts the keys of
    stored blocks (engines do not send it), matching the ``model`` of route requests.
    """

    worker_id: str
    endpoint: str
    replay_endpoint: str = ""
    dp_rank: int = 0
    model: str = ""

    def validate(self) -> None:
        if not self.worker_id:
            raise ConfigError("zmq endpoint: worker_id must not be empty")
        if self.dp_rank < 0:
            raise ConfigError(f"zmq endpoint {self.worker_id!r}: dp_rank must be >= 0")
        if not self.endpoint:
            raise ConfigError(f"zmq endpoint {self.worker_id!r}: endpoint must not be empty")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value:
                _check_address(self.worker_id, name, value, self.dp_rank)

    @classmethod
    def parse(cls, worker_id: str, spec: str, model: str = "") -> ZmqEndpoint:
        """An endpoint from a worker's ``kv_events_endpoint`` string, so config and
        RegisterWorker can say everything in one field::

            tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:5600&dp_rank=1&model=llama-3-8b

        ``replay``, ``dp_rank`` and ``model`` are optional (``model`` defaults to ``model``).
        """
        address, _, query = spec.partition("?")
        params: dict[str, str] = {}
        for part in filter(None, query.split("&")):
            key, sep, value = part.partition("=")
            if not sep or key not in ("replay", "dp_rank", "model"):
                raise ConfigError(f"worker {worker_id!r}: kv_events_endpoint: unknown parameter {part!r} "
                                  "(known: replay, dp_rank, model)")
            params[key] = unquote(value)
        rank = parse_decimal(params.get("dp_rank", "0"))
        if rank is None:
            raise ConfigError(f"worker {worker_id!r}: kv_events_endpoint: dp_rank must be an integer, "
                              f"got {params['dp_rank']!r}")
        endpoint = cls(worker_id, address, params.get("replay", ""), rank, params.get("model", model))
        endpoint.validate()
        return endpoint

    @property
    def pub_address(self) -> str:
        return rank_endpoint(self.endpoint, self.dp_rank)

    @property
    def replay_address(self) -> str:
        return rank_endpoint(self.replay_endpoint, self.dp_rank) if self.replay_endpoint else ""


#: ZMQ transports an engine publisher can use; anything else (http://, udp://, ...) is refused
#: at start or at RegisterWorker instead of failing later inside the subscriber
ZMQ_SCHEMES = ("tcp", "ipc", "inproc")


def _check_address(worker_id: str, name: str, value: str, dp_rank: int) -> None:
    scheme, sep, rest = value.partition("://")
    where = f"worker {worker_id!r}: kv_events_endpoint {name} {_quote(value)}"
    if not sep or scheme not in ZMQ_SCHEMES:
        raise ConfigError(f"{where}: must be tcp://HOST:PORT (or ipc:// / inproc://)")
    if scheme != "tcp":
        if not rest:
            raise ConfigError(f"{where}: names no path")
        return
    host, colon, digits = rest.rpartition(":")
    port = parse_decimal(digits)
    if not colon or not host or port is None:
        raise ConfigError(f"{where}: must be tcp://HOST:PORT with a numeric port")
    if host.startswith("[") != host.endswith("]") or host in ("*", "[*]"):
        raise ConfigError(f"{where}: must name the engine's host (not the * it binds to)")
    if not 1 <= port + dp_rank <= 65535:
        raise ConfigError(f"{where}: port {port} + dp_rank {dp_rank} is outside 1-65535")


def _climbs(path: str) -> bool:
    """Whether an ipc path has a ``..`` segment (which can lead out of any directory)."""
    return ".." in path.split("/")


def _quote(value: str, limit: int = 120) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The address data-parallel rank ``rank`` uses: tcp port + rank, else a ``_dp{rank}`` suffix."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, sep, digits = endpoint.rpartition(":")
        port = parse_decimal(digits)
        if not sep or port is None:
            raise ConfigError(f"cannot offset {endpoint!r} by rank {rank}: no numeric port")
        return f"{host}:{port + rank}"
    return f"{endpoint}_dp{rank}"


def check_worker_endpoints(allow: EndpointAllowList, worker_id: str, address: str, kv_events_endpoint: str) -> None:
    """A worker's ``kv_events_endpoint`` as the subscriber will dial it: malformed is
    InvalidRequest, a publisher or replay address the allow-list refuses is Forbidden."""
    try:
        endpoint = ZmqEndpoint.parse(worker_id, kv_events_endpoint)
    except ConfigError as exc:
        raise InvalidRequest(str(exc)) from None
    allow.check(worker_id, address, endpoint.endpoint)
    if endpoint.replay_endpoint:
        allow.check(worker_id, address, endpoint.replay_endpoint, "kv_events_endpoint replay")
