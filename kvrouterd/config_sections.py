"""The config file's sections below the top level, one frozen dataclass each: its keys, defaults and checks.

``config.Config`` composes them (with the sections other rooms own: ``events``, ``discovery``);
each section's ``validate`` names the field it refuses, and ``config`` collects every refusal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .decimals import parse_decimal
from .errors import ConfigError
from .index.workers import WorkerSpec
from .protocols import CacheMode, WorkerRole

if TYPE_CHECKING:
    from .policies.latency import LatencyParams

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "DisaggregationConfig",
    "ExtProcConfig",
    "LimitsConfig",
    "LoraConfig",
    "MetricsConfig",
    "SpeculativeConfig",
    "TelemetryConfig",
    "TlsConfig",
    "WorkerConfig",
    "is_listen_address",
]


@dataclass(frozen=True)
class WorkerConfig:
    id: str
    address: str
    capacity_blocks: int = 0
    mode: Literal["events", "approximate"] = "approximate"
    kv_events_endpoint: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    #: the engine's page size in tokens when it is not the router's block_size (SGLang's
    #: default page is 1 token; vLLM may run 32 or 64): its events are re-chunked
    block_size: int = 0
    #: base models served (its model pool); empty = any model
    models: list[str] = field(default_factory=list)
    #: LoRA adapters it can load; empty = any adapter of a model it serves
    loras: list[str] = field(default_factory=list)
    #: most adapters loaded at once (vLLM --max-loras); 0 = unknown
    max_loras: int = 0
    #: prefill, decode or both (an aggregated worker)
    role: Literal["both", "prefill", "decode"] = "both"

    def to_spec(self, block_size: int) -> WorkerSpec:
        return WorkerSpec(
            id=self.id,
            address=self.address,
            capacity_blocks=self.capacity_blocks,
            block_size=self.block_size or block_size,
            labels=dict(self.labels),
            mode=CacheMode.EVENTS if self.mode == "events" else CacheMode.APPROXIMATE,
            kv_events_endpoint=self.kv_events_endpoint,
            models=tuple(self.models),
            loras=tuple(self.loras),
            max_loras=self.max_loras,
            role=WorkerRole[self.role.upper()],
        )


@dataclass(frozen=True)
class LoraConfig:
    """LoRA-aware routing (README "Model pools and LoRA adapters", ``router/pools.py``)."""

    #: what loading an adapter costs, in requests of load: a worker without the adapter takes
    #: its requests only once every worker holding it has this many more in flight (twice this
    #: when loading it would evict another adapter)
    load_cost_requests: float = 2.0


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode pools (README "Prefill/decode disaggregation", ``router/disagg.py``);
    the defaults are ``router.settings.DisaggregationSettings``'s, from the simulator."""

    #: conditional: two hops only when they pay; always; never: decode workers prefill everything
    mode: Literal["conditional", "always", "never"] = "conditional"
    #: the decode worker prefills a request itself when at most this many prompt tokens are not
    #: in its cache (a short prompt counts the same way)
    local_prefill_max_uncached_tokens: int = 1024
    #: ... or when the chosen prefill worker already has this many prompt tokens to compute; 0 = off
    prefill_busy_tokens: int = 65536
    #: either only while the decode worker's own prompt work (this request's included) stays within this
    decode_busy_tokens: int = 8192


@dataclass(frozen=True)
class LimitsConfig:
    #: largest gRPC message accepted or sent, bytes (a 1M-token prompt is ~4 MiB packed)
    max_message_bytes: int = 16 * 1024 * 1024
    max_prompt_tokens: int = 1 << 20
    #: a Route whose prompt field takes this many bytes or more (256 KiB: 64k packed tokens), and
    #: an ext_proc request body this large, is decoded (tokenized) and hashed on a worker thread,
    #: so it does not hold up the routing loop; 0 = never
    off_loop_prompt_bytes: int = 256 * 1024
    #: events per PublishEvents batch
    max_batch_events: int = 65536
    #: bytes of one event batch (a PublishEvents message, an event-bus message); a longer one is
    #: RESOURCE_EXHAUSTED before it is parsed. A batch is read and applied in one turn of the
    #: routing loop, so this bounds how long it holds routing (docs/operations/limits.md, "Limits")
    max_event_batch_bytes: int = 512 * 1024
    #: blocks of one event batch: stored pages (tokens // the event's block size) or engine
    #: hashes if more, plus removed engine hashes, each event counting at least 8 (its own
    #: cost); more is RESOURCE_EXHAUSTED before any engine hash is read. The SDK splits under both
    max_batch_blocks: int = 4096
    max_concurrent_streams: int = 1024
    #: seconds after which a routed request that never completed stops counting as load
    inflight_timeout_s: float = 300.0
    #: most blocks one EvictHint answers (ranking runs on the routing loop; ask again for more)
    max_evict_blocks: int = 1024
    #: most pinned_keys and pinned_engine_hashes one EvictHint may list together (each is a
    #: set entry built on the routing loop; more is RESOURCE_EXHAUSTED)
    max_evict_pinned: int = 65536
    #: longest client-chosen id, characters: request, session, worker and candidate ids, model,
    #: LoRA, cache salt and policy names (longer ones are INVALID_ARGUMENT)
    max_id_length: int = 256
    #: longest worker address or kv_events_endpoint, characters
    max_address_length: int = 1024
    #: most characters of one worker's labels, keys and values together
    max_labels_length: int = 16384
    #: most bytes the table of routed-not-completed requests may hold (their block keys and
    #: ids), Routes waiting in admission queues included; a Route that would go over is
    #: RESOURCE_EXHAUSTED until requests complete or expire
    max_inflight_bytes: int = 256 * 1024 * 1024
    #: most routed, not completed requests one client (one gRPC connection: its peer address
    #: and port; all its RouteStreams with it) may hold; a Route over it is RESOURCE_EXHAUSTED
    #: until it completes some or they expire, so one client that never calls Complete cannot
    #: fill the in-flight table for everyone
    max_inflight_per_client: int = 16384
    #: cache size, in blocks, modelled for an approximate-mode worker registered without
    #: capacity_blocks (its modelled cache would otherwise grow without bound)
    approximate_capacity_blocks: int = 262144


@dataclass(frozen=True)
class TelemetryConfig:
    #: span exporter: none, console or otlp. The OTEL_TRACES_EXPORTER variable, when set,
    #: wins (standard OpenTelemetry configuration; OTEL_EXPORTER_OTLP_* configure OTLP).
    traces: Literal["none", "console", "otlp"] = "none"
    service_name: str = "kvrouterd"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    #: log a WARNING naming what held the event loop when it is blocked this long, ms
    #: (telemetry/loop_lag.py); 0 = no watchdog thread. The lag and gc-pause histograms are always kept
    loop_stall_warn_ms: float = 100.0


@dataclass(frozen=True)
class ExtProcConfig:
    """Envoy ext_proc endpoint picker, served beside the KVRouter API (see docs/envoy.md)."""

    enabled: bool = True
    #: a local tokenizer.json (needs the ``tokenizer`` extra); empty = approximate keys over
    #: the prompt text's bytes, which only match approximate-mode state
    tokenizer: str = ""
    #: salt block keys with the body's ``model``; event sources must then set the same model
    salt_keys_with_model: bool = True
    #: largest request body buffered for routing, bytes; a larger one is shed with HTTP 429
    max_body_bytes: int = 16 * 1024 * 1024
    #: endpoints in ``x-gateway-destination-endpoint``: the chosen worker, then fallbacks (the
    #: policy's alternative). Envoy's ORIGINAL_DST cluster reads a single ip:port: use 1 there
    max_endpoints: int = 2

    def validate(self) -> None:
        if self.max_endpoints < 1:
            raise ConfigError("ext_proc.max_endpoints: must be >= 1")
        if self.max_body_bytes <= 0:
            raise ConfigError("ext_proc.max_body_bytes: must be > 0")
        if self.tokenizer and not os.path.isfile(self.tokenizer):
            raise ConfigError(f"ext_proc.tokenizer: no such file {self.tokenizer!r}")


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus text-format endpoint (``GET /metrics``) on its own HTTP port."""

    #: HOST:PORT to serve /metrics on, e.g. 0.0.0.0:9464; empty = no endpoint
    listen: str = ""

    def validate(self) -> None:
        if self.listen and not is_listen_address(self.listen):
            raise ConfigError(f"metrics.listen: expected HOST:PORT or empty, got {self.listen!r}")


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the gRPC port. Files are re-read when they change (certificate rotation)."""

    #: PEM certificate chain and private key of the server; both or neither
    cert_file: str = ""
    key_file: str = ""
    #: PEM CA bundle that client certificates are verified against
    ca_file: str = ""
    #: refuse clients without a certificate signed by ca_file (mutual TLS)
    require_client_cert: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("tls: set both cert_file and key_file, or neither")
        if (self.ca_file or self.require_client_cert) and not self.cert_file:
            raise ConfigError("tls.ca_file: client certificates need server TLS (cert_file and key_file)")
        if self.require_client_cert and not self.ca_file:
            raise ConfigError("tls.require_client_cert: needs ca_file to verify client certificates")


@dataclass(frozen=True)
class AuthConfig:
    """Bearer-token auth (``authorization: Bearer <token>``) for the listed KVRouter methods.

    The data path (Route, Complete) stays open unless listed; health and reflection never
    need a token (probes). A token file may hold several tokens, one per line, so a rotation
    can accept the old and the new one; it is re-read when it changes.
    """

    #: file holding the accepted token(s)
    token_file: str = ""
    #: name of an environment variable holding the token (read once at start)
    token_env: str = ""
    #: KVRouter methods that need the token
    protect: list[str] = field(default_factory=lambda: [
        "RegisterWorker", "DeregisterWorker", "PublishEvents", "ReportLoad", "EvictHint", "ExportIndex"])

    @property
    def enabled(self) -> bool:
        return bool(self.token_file or self.token_env)

    def validate(self) -> None:
        if self.token_file and self.token_env:
            raise ConfigError("auth: set one of token_file and token_env, not both")
        if not self.enabled:
            return
        from ._generated.kvrouter.v1 import router_pb2

        methods = router_pb2.DESCRIPTOR.services_by_name["KVRouter"].methods_by_name
        if not self.protect:
            raise ConfigError("auth.protect: list at least one method when a token is configured")
        for i, name in enumerate(self.protect):
            if name not in methods:
                raise ConfigError(f"auth.protect[{i}]: unknown method {name!r}; known: {', '.join(sorted(methods))}")


def is_listen_address(value: str) -> bool:
    """``HOST:PORT`` with an ASCII port in 0-65535 (0: any free port), as a listen setting takes it."""
    host, sep, digits = value.rpartition(":")
    port = parse_decimal(digits)
    return bool(sep and host and port is not None and 0 <= port <= 65535)


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission queue mode (DualMap section 3.3): Route waits while its worker is full; and
    deadline admission (``kvrouterd.deadline``): a Route predicted to miss its TTFT SLO on
    every eligible worker is shed."""

    #: routed-but-uncompleted requests a worker may hold before Route waits; 0 = mode off
    max_inflight: int = 0
    #: longest a Route may wait in a queue before it is shed (RESOURCE_EXHAUSTED), seconds
    max_wait_s: float = 30.0
    #: deadline admission: off, shed (refuse at routing time a request predicted to miss its
    #: SLO everywhere) or defer (shed, and drop a queued request the moment it can no longer
    #: meet its SLO; needs max_inflight)
    deadline: str = "shed"
    #: shed a request that declares no TTFT SLO of its own (``ttft_slo_ms``, ext_proc's
    #: ``x-slo-ttft-ms`` header) when it cannot meet ``default_ttft_slo_ms``; false (the
    #: default): such a request is steered by the default SLO but never refused by it
    shed_without_slo: bool = False
    #: admit a request when this quantile of its predicted TTFT (the model times the observed
    #: spread of observed / predicted TTFT) meets its SLO
    deadline_quantile: float = 0.9
    #: the TTFT model deadline admission predicts with: ``LatencyParams`` fields
    #: (policies/latency.py), e.g. {prefill_ms_per_1k_tokens: 40, calibrate: true}
    latency: dict[str, Any] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether Route goes through the admission gate at all."""
        return self.max_inflight > 0 or self.deadline != "off"

    def latency_params(self) -> LatencyParams:
        from .policies.latency import LatencyParams

        return LatencyParams(**self.latency)

    def problems(self) -> list[str]:
        from .deadline import DEADLINE_MODES

        out = []
        if self.max_inflight < 0:
            out.append("admission.max_inflight: must be >= 0 (0 = off)")
        if self.max_wait_s <= 0:
            out.append("admission.max_wait_s: must be > 0")
        if self.deadline not in DEADLINE_MODES:
            out.append(f"admission.deadline: expected one of {', '.join(DEADLINE_MODES)}, got {self.deadline!r}")
        elif not 0.0 < self.deadline_quantile < 1.0:
            out.append(f"admission.deadline_quantile: must be in (0, 1), got {self.deadline_quantile}")
        elif self.deadline == "defer" and self.max_inflight <= 0:
            out.append("admission.deadline: defer holds requests in admission queues; set admission.max_inflight > 0")
        try:
            self.latency_params().validate()
        except (TypeError, ValueError) as exc:  # an unknown field, or a value out of range
            out.append(f"admission.latency: {exc}")
        return out


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative indexing (``router/speculative.py``): a prompt routed to an events-mode
    worker counts as cached there at once, until its engine's Stored confirms it or ``ttl_s``
    passes, so follow-ups sharing its prefix find it while the prefill still runs."""

    #: seconds a routed prompt's blocks count as cached before their Stored events arrive;
    #: 0 = off (the default). 10 s covers queueing plus prefill of a long prompt near capacity:
    #: twice the default TTFT objective, past which the request has missed it anyway. Off by
    #: default because it helps load-balancing prefix policies (cache_aware: 6.5 -> 7.5 req/s
    #: on Mooncake in the simulator) and hurts DualMap, whose hashed pair then piles a hot
    #: prefix on one worker (toolagent: 65 -> 50 req/s); docs/operations/configure.md
    ttl_s: float = 0.0
    #: most blocks claimed that way on one worker (65,536 blocks: 1M tokens at 16 a block),
    #: and on all workers together (~100 B each); the oldest claims give way first
    max_blocks_per_worker: int = 1 << 16
    max_blocks: int = 1 << 19

    def validate(self) -> None:
        from .router.settings import MAX_SPECULATIVE_TTL_S

        problems = []
        if not 0 <= self.ttl_s <= MAX_SPECULATIVE_TTL_S:
            problems.append(f"speculative.ttl_s: must be in [0, {MAX_SPECULATIVE_TTL_S:.0f}] (0 = off), got {self.ttl_s}")
        for name in ("max_blocks_per_worker", "max_blocks"):
            if getattr(self, name) <= 0:
                problems.append(f"speculative.{name}: must be > 0, got {getattr(self, name)}")
        if problems:
            raise ConfigError(*problems)
