"""The ``events`` settings: how every ZMQ subscriber of the daemon connects, replays and decodes.

One ``ZmqEventsConfig`` is shared by all subscribers (``zmq_source``); each engine's addresses
come from its worker's ``kv_events_endpoint`` (``endpoints.ZmqEndpoint``). The config file nests
two more settings under ``events``, kept here with them: ``allowed_endpoints`` (which addresses
the daemon may dial, ``endpoints.EndpointAllowList``) and ``bus`` (the shared NATS event stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..decimals import parse_decimal
from ..errors import ConfigError
from .bus_config import NatsBusConfig
from .endpoints import EndpointAllowList

__all__ = ["ZmqEventsConfig"]


@dataclass(frozen=True)
class ZmqEventsConfig:
    """Settings shared by every ZMQ subscriber."""

    #: topic prefix to subscribe to ("" = every topic; vLLM's default topic is "")
    topic: str = ""
    #: seconds without a batch before an endpoint is shown as silent and its socket recreated
    silence_s: float = 30.0
    #: seconds to wait for each replay reply frame before giving the replay up
    replay_timeout_s: float = 2.0
    #: upper bound on batches accepted from one replay
    replay_max_batches: int = 100_000
    #: on first contact with a running engine, replay from sequence 0 to recover its cache
    replay_on_join: bool = True
    #: "ignore" drops events for non-GPU tiers; "track" keeps their blocks per tier, apart
    other_media: Literal["ignore", "track"] = "ignore"
    #: ZMQ reconnect backoff (the library doubles the interval up to the max); also the bounds
    #: of the daemon's own waits before recreating a silent socket or restarting a failed
    #: subscriber (retry.py: doubling, each shortened by up to 20% at random)
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 10_000
    #: adapter names of vLLM 0.11's lora_id-only events ({"7": "sql-adapter"}); a stored
    #: event with an id not listed is rejected (unknown_lora_id) rather than keyed wrongly
    lora_ids: dict[str, str] = field(default_factory=dict)
    #: a shared event stream for many replicas (NATS JetStream; events.nats_bus, docs/deploy.md)
    bus: NatsBusConfig = field(default_factory=NatsBusConfig)
    #: hosts and networks a worker's kv_events_endpoint may name (events.endpoints; "@worker" =
    #: the host of the worker's own address). ipc:// and inproc:// need an entry of their own
    allowed_endpoints: list[str] = field(default_factory=lambda: ["@worker"])

    @property
    def allow_list(self) -> EndpointAllowList:
        return EndpointAllowList.parse(self.allowed_endpoints)

    @property
    def lora_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for key, name in self.lora_ids.items():
            lora_id = parse_decimal(str(key))
            if lora_id is None or not name:
                raise ConfigError(f"events.lora_ids: {key!r}: keys are vLLM lora ids (integers), values adapter names")
            names[lora_id] = name
        return names

    def validate(self) -> None:
        self.bus.validate()
        _ = self.allow_list  # a bad entry fails here, naming it
        if self.silence_s <= 0:
            raise ConfigError(f"events.silence_s must be > 0, got {self.silence_s}")
        if self.replay_timeout_s <= 0:
            raise ConfigError(f"events.replay_timeout_s must be > 0, got {self.replay_timeout_s}")
        if self.replay_max_batches <= 0:
            raise ConfigError(f"events.replay_max_batches must be > 0, got {self.replay_max_batches}")
        if self.other_media not in ("ignore", "track"):
            raise ConfigError(f"events.other_media must be 'ignore' or 'track', got {self.other_media!r}")
        if not 0 < self.reconnect_ivl_ms <= self.reconnect_ivl_max_ms:
            raise ConfigError("events.reconnect_ivl_ms must be > 0 and <= reconnect_ivl_max_ms")
        _ = self.lora_names  # a bad key fails here, naming it
