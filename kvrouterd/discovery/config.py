"""The ``discovery`` config section: which engine pods become workers, and how to reach them.

Example::

    discovery:
      kubernetes:
        enabled: true
        label_selector: app=vllm,role=decode
        port: http              # container port name, or a number such as 8000
        kv_events_port: "5557"  # set: the pod publishes KV events (events mode) at tcp://IP:5557
        kv_replay_port: "5558"  # optional: its replay endpoint, tcp://IP:5558
        capacity_blocks: 20000  # per pod; the pod annotation kvrouterd.io/capacity-blocks wins
        model_label: llm-d.ai/model   # the pod's model pool (llm-d's label; "" = not read)
        role_label: llm-d.ai/role     # prefill, decode or both (llm-d's label; "" = not read)

Kept apart from ``config.py`` so the loader only learns one field; the section is built by
the same generic loader (unknown keys and bad values fail naming ``discovery.kubernetes.*``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib.util import find_spec

from ..decimals import parse_decimal
from ..errors import ConfigError

__all__ = ["CLIENT_EXTRA", "SERVICE_ACCOUNT_DIR", "DiscoveryConfig", "KubernetesDiscoveryConfig"]

#: the package extra that installs the Kubernetes client discovery runs on (kvrouterd[discovery])
CLIENT_EXTRA = "discovery"

#: where Kubernetes mounts a pod's service-account token, CA bundle and namespace
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

# RFC 1123 label (namespace) and IANA_SVC_NAME (named container port) as Kubernetes validates them
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$")


def _check_port(value: str, where: str, allow_empty: bool) -> None:
    if value == "" and allow_empty:
        return
    if (number := parse_decimal(value)) is not None:
        if not 1 <= number <= 65535:
            raise ConfigError(f"{where}: port number must be in [1, 65535], got {value}")
        return
    if not _PORT_NAME.match(value):
        raise ConfigError(f"{where}: expected a port number or a container port name, got {value!r}")


@dataclass(frozen=True)
class KubernetesDiscoveryConfig:
    enabled: bool = False
    #: namespace to watch; empty = the namespace this pod runs in (from the service account)
    namespace: str = ""
    #: Kubernetes label selector of the engine pods, e.g. ``app=vllm,tier in (decode)``
    label_selector: str = ""
    #: the engine's serving port: a number, or the name of a container port on the pod
    port: str = "8000"
    #: the engine's KV-event (ZMQ) port; empty = the engine publishes none (approximate mode)
    kv_events_port: str = ""
    #: the engine's KV-event replay (ZMQ ROUTER) port, used to recover missed batches; empty = none
    kv_replay_port: str = ""
    #: KV capacity per pod in blocks, unless the pod's ``kvrouterd.io/capacity-blocks`` annotation says
    capacity_blocks: int = 0
    #: pod label naming the model the pod serves, as llm-d's charts set it and InferencePools select
    #: on; the annotation ``kvrouterd.io/models`` (full names, comma-separated) wins; "" = not read
    model_label: str = "llm-d.ai/model"
    #: pod label naming its role, ``prefill``, ``decode`` or ``both`` (llm-d's); "" = not read
    role_label: str = "llm-d.ai/role"
    #: prefixed to the pod name to form the worker id (avoids clashes with static workers)
    id_prefix: str = ""
    #: only pods whose Ready condition is True are workers (a starting engine gets no traffic)
    require_ready: bool = True
    #: API server URL; empty = https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    api_server: str = ""
    token_file: str = f"{SERVICE_ACCOUNT_DIR}/token"
    ca_file: str = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
    #: the API server ends each watch after this long; we then re-watch from the last version
    watch_timeout_s: int = 300
    #: retry delay after a failed request, doubling up to backoff_max_s, each shortened by up
    #: to 20% at random (the daemon's one schedule, retry.py)
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def validate(self, where: str = "discovery.kubernetes") -> None:
        if self.namespace and not _NAMESPACE.match(self.namespace):
            raise ConfigError(f"{where}.namespace: not a valid namespace name: {self.namespace!r}")
        if self.enabled and not self.label_selector.strip():
            # an empty selector would turn every pod in the namespace into a worker
            raise ConfigError(f"{where}.label_selector: required when discovery is enabled")
        if self.enabled and find_spec("kubernetes_asyncio") is None:
            # an optional dependency: a daemon without discovery should not carry the client
            raise ConfigError(f"{where}.enabled: needs the {CLIENT_EXTRA!r} extra, which installs kubernetes_asyncio "
                              f"(pip install 'kvrouterd[{CLIENT_EXTRA}]'; the container image has it)")
        _check_port(self.port, f"{where}.port", allow_empty=False)
        _check_port(self.kv_events_port, f"{where}.kv_events_port", allow_empty=True)
        _check_port(self.kv_replay_port, f"{where}.kv_replay_port", allow_empty=True)
        if self.kv_replay_port and not self.kv_events_port:
            raise ConfigError(f"{where}.kv_replay_port: needs kv_events_port")
        if self.capacity_blocks < 0:
            raise ConfigError(f"{where}.capacity_blocks: must be >= 0")
        if self.api_server and not self.api_server.startswith(("https://", "http://")):
            raise ConfigError(f"{where}.api_server: expected an http(s):// URL, got {self.api_server!r}")
        if not 1 <= self.watch_timeout_s <= 3600:
            raise ConfigError(f"{where}.watch_timeout_s: must be in [1, 3600]")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ConfigError(f"{where}.backoff_initial_s: must be > 0 and <= backoff_max_s")


@dataclass(frozen=True)
class DiscoveryConfig:
    kubernetes: KubernetesDiscoveryConfig = field(default_factory=KubernetesDiscoveryConfig)

    def validate(self) -> None:
        self.kubernetes.validate()
