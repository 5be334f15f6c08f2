"""Pod objects to worker specs, and membership changes as pods come, change and go."""

from __future__ import annotations

import pytest

from kvrouterd.config import parse_config
from kvrouterd.discovery import CAPACITY_ANNOTATION, Change, KubernetesDiscoveryConfig, Membership, pod_worker_spec
from kvrouterd.errors import ConfigError
from kvrouterd.protocols import CacheMode

from .fake_kube import pod

CFG = KubernetesDiscoveryConfig(enabled=True, label_selector="app=vllm", port="http", kv_events_port="5557",
                                capacity_blocks=1000)


def test_ready_pod_becomes_an_events_mode_worker_at_its_ip_and_ports() -> None:
    spec = pod_worker_spec(pod("vllm-0", "10.1.2.3", labels={"app": "vllm", "zone": "a"}), CFG, block_size=16)
    assert spec is not None
    assert spec.id == "vllm-0"
    assert spec.address == "10.1.2.3:8000"  # named port "http" resolved from the container spec
    assert spec.kv_events_endpoint == "tcp://10.1.2.3:5557"
    assert spec.mode is CacheMode.EVENTS
    assert spec.capacity_blocks == 1000
    assert spec.block_size == 16
    assert dict(spec.labels) == {"app": "vllm", "zone": "a"}


def test_without_kv_events_port_the_worker_is_approximate() -> None:
    cfg = KubernetesDiscoveryConfig(enabled=True, label_selector="app=vllm", port="9000")
    spec = pod_worker_spec(pod("p", "10.0.0.9"), cfg)
    assert spec is not None
    assert spec.address == "10.0.0.9:9000"
    assert spec.mode is CacheMode.APPROXIMATE and spec.kv_events_endpoint == ""


def test_ipv6_pod_addresses_are_bracketed() -> None:
    spec = pod_worker_spec(pod("p", "fd00::5"), CFG)
    assert spec is not None
    assert spec.address == "[fd00::5]:8000"
    assert spec.kv_events_endpoint == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize(
    "p",
    [
        pod("starting", ready=False),
        pod("no-ip", ip=None),
        pod("pending", phase="Pending"),
        pod("leaving", terminating=True),
        pod("wrong-ports", ports=[{"name": "grpc", "containerPort": 9000}]),
    ],
    ids=["not-ready", "no-ip", "pending", "terminating", "named-port-missing"],
)
def test_pods_that_cannot_take_traffic_are_not_workers(p: dict) -> None:
    assert pod_worker_spec(p, CFG) is None


def test_require_ready_false_accepts_a_running_pod_that_is_not_ready() -> None:
    cfg = KubernetesDiscoveryConfig(enabled=True, label_selector="a=b", require_ready=False)
    assert pod_worker_spec(pod("p", ready=False), cfg) is not None
    assert pod_worker_spec(pod("p", ip=None), cfg) is None  # still nothing to connect to


def test_capacity_annotation_overrides_config_and_a_bad_one_is_ignored() -> None:
    spec = pod_worker_spec(pod("p", annotations={CAPACITY_ANNOTATION: "5000"}), CFG)
    assert spec is not None and spec.capacity_blocks == 5000
    spec = pod_worker_spec(pod("p", annotations={CAPACITY_ANNOTATION: "lots"}), CFG)
    assert spec is not None and spec.capacity_blocks == 1000


def test_id_prefix_is_applied() -> None:
    cfg = KubernetesDiscoveryConfig(enabled=True, label_selector="a=b", id_prefix="k8s/")
    m = Membership(cfg)
    assert [c.worker_id for c in m.upsert(pod("vllm-0"))] == ["k8s/vllm-0"]


def kinds(changes: list[Change]) -> list[tuple[str, str]]:
    return [(c.kind, c.worker_id) for c in changes]


def test_membership_follows_readiness_recreation_and_deletion() -> None:
    m = Membership(CFG)
    assert kinds(m.upsert(pod("a", "10.0.0.1"))) == [("add", "a")]
    assert kinds(m.upsert(pod("a", "10.0.0.1", rv="2"))) == []  # a status heartbeat changes nothing
    assert kinds(m.upsert(pod("a", "10.0.0.1", ready=False))) == [("remove", "a")]
    assert kinds(m.upsert(pod("a", "10.0.0.1", ready=False))) == []
    assert kinds(m.upsert(pod("a", "10.0.0.1"))) == [("add", "a")]
    # same name, new pod: its cache is empty, so the old worker's index must go
    assert kinds(m.upsert(pod("a", "10.0.0.7", uid="uid-new"))) == [("remove", "a"), ("add", "a")]
    assert kinds(m.delete(pod("a"))) == [("remove", "a")]
    assert kinds(m.delete(pod("a"))) == []
    assert len(m) == 0


def test_label_change_is_an_in_place_update() -> None:
    m = Membership(CFG)
    m.upsert(pod("a", labels={"app": "vllm"}))
    changes = m.upsert(pod("a", labels={"app": "vllm", "canary": "true"}))
    assert kinds(changes) == [("add", "a")]
    assert changes[0].spec is not None and dict(changes[0].spec.labels)["canary"] == "true"


def test_replace_diffs_a_full_listing_against_current_members() -> None:
    m = Membership(CFG)
    for name, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
        m.upsert(pod(name, ip))
    changes = m.replace([pod("a", "10.0.0.1"), pod("c", "10.0.0.3", ready=False), pod("d", "10.0.0.4")])
    assert sorted(kinds(changes)) == [("add", "d"), ("remove", "b"), ("remove", "c")]
    assert sorted(m.workers) == ["a", "d"]


def test_discovery_section_loads_through_the_daemon_config() -> None:
    cfg = parse_config({"discovery": {"kubernetes": {"enabled": True, "label_selector": "app=vllm", "port": 8000,
                                                     "kv_events_port": "kv-events"}}})
    k = cfg.discovery.kubernetes
    assert k.enabled and k.port == "8000" and k.kv_events_port == "kv-events"
    assert parse_config({}).discovery.kubernetes.enabled is False


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"enabled": True}, "label_selector"),
        ({"port": "0"}, "port"),
        ({"port": "Not_A_Port"}, "port"),
        ({"kv_events_port": "70000"}, "kv_events_port"),
        ({"namespace": "Bad_NS"}, "namespace"),
        ({"api_server": "ftp://x"}, "api_server"),
        ({"watch_timeout_s": 0}, "watch_timeout_s"),
        ({"backoff_initial_s": 5, "backoff_max_s": 1}, "backoff_initial_s"),
        ({"capacity_blocks": -1}, "capacity_blocks"),
        ({"selector": "a=b"}, "selector"),
    ],
)
def test_bad_discovery_config_fails_naming_the_field(section: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"discovery\.kubernetes\.{field}"):
        parse_config({"discovery": {"kubernetes": section}})


def test_replay_endpoint_follows_membership() -> None:
    cfg = KubernetesDiscoveryConfig(enabled=True, label_selector="a=b", kv_events_port="kv-events",
                                    kv_replay_port="5558")
    m = Membership(cfg)
    m.upsert(pod("a", "10.0.0.1"))
    assert m.replay_endpoint("a") == "tcp://10.0.0.1:5558"
    m.upsert(pod("a", "10.0.0.1", ready=False))
    assert m.replay_endpoint("a") == ""
    assert Membership(CFG).replay_endpoint("a") == ""  # none configured


def test_replay_port_without_events_port_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.kv_replay_port"):
        parse_config({"discovery": {"kubernetes": {"kv_replay_port": "5558"}}})
