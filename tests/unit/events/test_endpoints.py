"""events.allowed_endpoints: which hosts a worker's kv_events_endpoint may make the daemon dial (issue #16 item 2)."""

from __future__ import annotations

import pytest

from kvrouterd.errors import ConfigError, Forbidden, InvalidRequest
from kvrouterd.events.endpoints import EndpointAllowList, check_worker_endpoints


def test_by_default_only_the_workers_own_host_is_allowed():
    allow = EndpointAllowList.parse(["@worker"])
    allow.check("w", "10.0.0.5:8000", "tcp://10.0.0.5:5557")
    allow.check("w", "[fd00::5]:8000", "tcp://[fd00:0::5]:5557")  # IP literals compare normalised
    allow.check("w", "Engine-0.ns.svc:8000", "tcp://engine-0.ns.svc:5557")  # names case-insensitively
    for endpoint in ("tcp://10.0.0.6:5557", "tcp://169.254.169.254:80", "tcp://engine-1.ns.svc:5557"):
        with pytest.raises(Forbidden, match="not allowed by events.allowed_endpoints"):
            allow.check("w", "10.0.0.5:8000", endpoint)
    assert EndpointAllowList() == EndpointAllowList.parse(["@worker"])  # the servicer's default


def test_networks_and_host_patterns_replace_the_default_when_listed():
    allow = EndpointAllowList.parse(["10.0.0.0/8", "fd00::/8", "*.engines.svc.cluster.local", "vllm-0"])
    allow.check("w", "other:1", "tcp://10.200.0.1:5557")
    allow.check("w", "other:1", "tcp://[fd00::1]:5557")
    allow.check("w", "other:1", "tcp://Pod-3.Engines.svc.cluster.local:5557")
    allow.check("w", "other:1", "tcp://vllm-0:5557")
    # a name never matches a network (nothing is resolved); the worker's own host is no longer implied
    for endpoint in ("tcp://ten.example:5557", "tcp://192.168.0.1:5557", "tcp://vllm-01:5557"):
        with pytest.raises(Forbidden):
            allow.check("w", "192.168.0.1:8000", endpoint)


def test_ipc_and_inproc_are_refused_unless_a_pattern_of_their_own_allows_them():
    default = EndpointAllowList.parse(["@worker", "*"])
    for endpoint in ("ipc:///tmp/engine.sock", "inproc://events"):
        with pytest.raises(Forbidden, match="refused unless events.allowed_endpoints lists"):
            default.check("w", "h:1", endpoint)
    allow = EndpointAllowList.parse(["ipc:///run/engines/*", "inproc://*"])
    allow.check("w", "h:1", "ipc:///run/engines/vllm-0.sock")
    allow.check("w", "h:1", "inproc://events")
    with pytest.raises(Forbidden):
        allow.check("w", "h:1", "ipc:///etc/passwd")


def test_an_empty_list_allows_nothing_and_star_allows_every_tcp_host():
    with pytest.raises(Forbidden, match="empty: no endpoint is allowed"):
        EndpointAllowList.parse([]).check("w", "h:1", "tcp://h:1")
    EndpointAllowList.parse(["*"]).check("w", "h:1", "tcp://198.51.100.7:5557")


def test_hosts_that_are_no_host_are_malformed_not_forbidden():
    allow = EndpointAllowList.parse(["*"])
    for endpoint in ("tcp://eth0;10.0.0.1:5557", "tcp://a b:1", "tcp://a..b:1", "tcp://[nonsense]:1"):
        with pytest.raises(InvalidRequest, match="neither an IP address nor a DNS name"):
            allow.check("w", "h:1", endpoint)


def test_the_replay_endpoint_is_checked_too():
    allow = EndpointAllowList.parse(["@worker"])
    check_worker_endpoints(allow, "w", "10.0.0.5:8000", "tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:5558")
    with pytest.raises(Forbidden, match="replay"):
        check_worker_endpoints(allow, "w", "10.0.0.5:8000", "tcp://10.0.0.5:5557?replay=tcp://10.9.9.9:5558")
    with pytest.raises(InvalidRequest, match="numeric port"):
        check_worker_endpoints(allow, "w", "10.0.0.5:8000", "tcp://10.0.0.5?dp_rank=1")


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "10.0.0.1/8", "http://x", "", "1.2.3"])
def test_a_bad_entry_fails_at_start_naming_it(entry):
    with pytest.raises(ConfigError, match=r"events.allowed_endpoints\[0\]"):
        EndpointAllowList.parse([entry])


def test_the_bridge_dials_a_discovered_pod_only_if_the_allow_list_allows_it():
    """``kvrouterd bridge`` reads engines for the bus: the same rule as the daemon (item 2)."""
    from kvrouterd.config import parse_config
    from kvrouterd.index.workers import WorkerSpec
    from kvrouterd.protocols import CacheMode
    from kvrouterd.server.bridge import BridgeProcess

    cfg = parse_config({"events": {"bus": {"kind": "nats", "url": "nats://127.0.0.1:1"}}})
    bridge = BridgeProcess(cfg)
    bridge._sync = lambda: None  # no subscriber sockets: only which workers it would bridge
    bridge._discovered(WorkerSpec("a", "10.1.0.7:8000", mode=CacheMode.EVENTS, kv_events_endpoint="tcp://10.1.0.8:5557"))
    bridge._discovered(WorkerSpec("b", "10.1.0.7:8000", mode=CacheMode.EVENTS, kv_events_endpoint="tcp://10.1.0.7:5557"))
    assert set(bridge.workers) == {"b"}


def test_an_ipc_pattern_admits_no_path_that_climbs_out_of_its_directory():
    """Issue #28 item 10: ``ipc://DIR/*`` admitted ``ipc://DIR/../x`` (``*`` matches ``/``), and
    the daemon really dialled outside DIR."""
    allow = EndpointAllowList.parse(["ipc:///run/engines/*"])
    for path in ("/run/engines/../x", "/run/engines/a/../../x", "/run/engines/..", "/run/engines/../engines/a"):
        with pytest.raises(Forbidden, match=r"must not contain '\.\.'"):
            allow.check("w", "h:1", f"ipc://{path}")
    with pytest.raises(Forbidden, match="replay"):  # the replay address too, percent-encoded or not
        check_worker_endpoints(allow, "w", "h:1", "ipc:///run/engines/a?replay=ipc:///run/engines/%2E%2E/b")
    # "." and "//" are normalised before matching: the same file, the same answer
    allow.check("w", "h:1", "ipc:///run/engines/./vllm-0.sock")
    allow.check("w", "h:1", "ipc:///run//engines/vllm-0.sock")
    with pytest.raises(Forbidden):
        allow.check("w", "h:1", "ipc:///run/engines/./../x")
    with pytest.raises(ConfigError, match=r"events.allowed_endpoints\[0\].*'\.\.'"):
        EndpointAllowList.parse(["ipc:///run/engines/../*"])
    assert EndpointAllowList.parse(["ipc:///run/./engines/*"]).ipc_patterns == ("/run/engines/*",)


@pytest.mark.parametrize("spec", [
    "tcp://10.0.0.5:5557?dp_rank=²",  # isdigit() is true, int() raises: was an uncaught ValueError
    "tcp://10.0.0.5:5557?dp_rank=١",  # Arabic-Indic 1: int() reads it
    "tcp://10.0.0.5:5557?dp_rank=%20",
    "tcp://10.0.0.5:5557?dp_rank=1_0",
    "tcp://10.0.0.5:٥٥٥٧",  # the subscriber then failed forever: libzmq dials ASCII ports only
    "tcp://10.0.0.5:5557?replay=tcp://10.0.0.5:٥٥٥٨",
    "tcp://10.0.0.5:²",
])
def test_numbers_in_an_endpoint_are_ascii_digits_only(spec):
    with pytest.raises(InvalidRequest, match="dp_rank must be an integer|numeric port"):
        check_worker_endpoints(EndpointAllowList.parse(["*"]), "w", "10.0.0.5:8000", spec)
