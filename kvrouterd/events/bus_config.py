"""The event-bus settings: ``events.bus`` and its ``replica_sync``, each checked at start.

``nats_bus`` (the shared engine-event stream) and ``replica_sync`` (the shared load stream) each
read their part; keeping the two classes here lets ``replica_sync`` import ``nats_bus`` (for
its connection) without ``nats_bus`` importing it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["NatsBusConfig", "ReplicaSyncConfig"]


@dataclass(frozen=True)
class ReplicaSyncConfig:
    """``events.bus.replica_sync``: share in-flight load and approximate prefixes over the bus."""

    #: on by default whenever the bus is (events.bus.kind: nats)
    enabled: bool = True
    #: JetStream stream holding the load deltas; created on first use if missing
    stream: str = "KVROUTER_LOAD"
    #: the one subject every replica publishes its deltas on
    subject: str = "kvrouter.load"

    def validate(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", self.stream):
            raise ConfigError(f"events.bus.replica_sync.stream: letters, digits, '_' and '-' only, got {self.stream!r}")
        if not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*", self.subject):
            raise ConfigError(f"events.bus.replica_sync.subject: dot-separated tokens, got {self.subject!r}")


@dataclass(frozen=True)
class NatsBusConfig:
    """``events.bus``: where replicas share engine events ("" kind = no bus)."""

    #: "" (off: engines publish to each replica, or ZMQ subscribers) or "nats"
    kind: str = ""
    #: NATS server URL(s), comma separated (nats://host:4222)
    url: str = "nats://127.0.0.1:4222"
    #: JetStream stream holding the engine events; created on first use if missing
    stream: str = "KVROUTER_EVENTS"
    #: subjects are <subject_prefix>.<worker token>
    subject_prefix: str = "kvrouter.events"
    #: seconds to wait for the server at start before failing with a clear error
    connect_timeout_s: float = 5.0
    #: oldest events the stream keeps (seconds; 0 = unlimited), bounding its disk
    max_age_s: float = 3600.0
    #: JetStream object store bucket holding the index snapshot a new replica restores from
    snapshot_bucket: str = "KVROUTER_SNAPSHOTS"
    #: seconds between two snapshots written by each replica (0 = never write one)
    snapshot_interval_s: float = 60.0
    #: in-flight load and approximate prefixes shared between replicas (events/replica_sync.py)
    replica_sync: ReplicaSyncConfig = field(default_factory=ReplicaSyncConfig)

    @property
    def enabled(self) -> bool:
        return self.kind == "nats"

    def validate(self) -> None:
        if self.kind not in ("", "nats"):
            raise ConfigError(f"events.bus.kind must be '' or 'nats', got {self.kind!r}")
        if not self.enabled:
            return
        if not all(u.strip().startswith(("nats://", "tls://")) for u in self.url.split(",")):
            raise ConfigError(f"events.bus.url: expected nats://HOST:PORT (comma separated), got {self.url!r}")
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", self.stream):
            raise ConfigError(f"events.bus.stream: letters, digits, '_' and '-' only, got {self.stream!r}")
        if not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*", self.subject_prefix):
            raise ConfigError(f"events.bus.subject_prefix: dot-separated tokens, got {self.subject_prefix!r}")
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"events.bus.connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", self.snapshot_bucket):
            raise ConfigError(f"events.bus.snapshot_bucket: letters, digits, '_' and '-' only, got {self.snapshot_bucket!r}")
        if self.snapshot_interval_s < 0:
            raise ConfigError(f"events.bus.snapshot_interval_s must be >= 0, got {self.snapshot_interval_s}")
        if self.max_age_s < 0:
            raise ConfigError(f"events.bus.max_age_s must be >= 0, got {self.max_age_s}")
        self.replica_sync.validate()
