"""Configuration: one YAML schema, overridden by environment variables, then CLI flags.

Precedence (later wins): embedded defaults < ``--config`` file < ``KVROUTERD_*`` environment
< command-line flags. Every section is a frozen dataclass; unknown keys and bad values fail
at start-up with a ConfigError naming the field (``workers[1].capacity_blocks: ...``).

Example (every key optional)::

    listen: 0.0.0.0:50051
    block_size: 16
    routing: {name: cache_aware, cache_threshold: 0.3}
    extra_routing: [least_loaded]     # policies a request may name; a bare name = default parameters
    eviction: lru
    workers:
      - {id: gpu-0, address: 10.0.0.5:8000, capacity_blocks: 20000, mode: events}
      - {id: gpu-1, address: 10.0.0.6:8000, models: [meta-llama/Llama-3.1-8B-Instruct],
         loras: [sql-lora, chat-lora], max_loras: 4}
    lora: {load_cost_requests: 2}
    limits: {max_message_bytes: 16777216, max_prompt_tokens: 1048576}
    telemetry: {traces: none}

The policy sections are validated through the policy registry, so a typo in a policy
parameter fails here too. Loading reports every wrong field at once (``ConfigError.problems``).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from .decimals import parse_decimal, parse_number
from .discovery.config import DiscoveryConfig
from .errors import ConfigError, KVRouterError
from .events.endpoints import check_worker_endpoints
from .events.zmq_config import ZmqEventsConfig
from .index.workers import MAX_LORAS, MAX_POOL_NAMES, WorkerSpec, is_host_port
from .protocols import CacheMode, WorkerRole

if TYPE_CHECKING:
    from .policies.latency import LatencyParams

__all__ = [
    "ENV_PREFIX",
    "AuthConfig",
    "Config",
    "ExtProcConfig",
    "LimitsConfig",
    "LoraConfig",
    "MetricsConfig",
    "TelemetryConfig",
    "TlsConfig",
    "WorkerConfig",
    "load_config",
    "parse_config",
]

ENV_PREFIX = "KVROUTERD_"


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
        if self.listen and not _is_host_port(self.listen):
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


def _is_host_port(value: str) -> bool:
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
    deadline: str = "off"
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
        elif self.deadline == "defer" and self.max_inflight <= 0:
            out.append("admission.deadline: defer holds requests in admission queues; set admission.max_inflight > 0")
        try:
            self.latency_params().validate()
        except (TypeError, ValueError) as exc:  # an unknown field, or a value out of range
            out.append(f"admission.latency: {exc}")
        return out


@dataclass(frozen=True)
class Config:
    listen: str = "127.0.0.1:50051"
    block_size: int = 16
    routing: dict[str, Any] = field(default_factory=lambda: {"name": "cache_aware"})
    extra_routing: list[dict[str, Any]] = field(default_factory=list)
    eviction: dict[str, Any] = field(default_factory=lambda: {"name": "lru"})
    default_ttft_slo_ms: float = 5000.0
    workers: list[WorkerConfig] = field(default_factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    #: vLLM / SGLang ZMQ KV-event subscribers (workers declare kv_events_endpoint); docs/engine-events.md
    events: ZmqEventsConfig = field(default_factory=ZmqEventsConfig)
    #: engine pods found through the Kubernetes API (see kvrouterd/discovery/config.py)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    #: seconds between periodic maintenance (in-flight expiry, policy ticks)
    tick_interval_s: float = 0.02
    #: Envoy external processing (Gateway API Inference Extension endpoint picker)
    ext_proc: ExtProcConfig = field(default_factory=ExtProcConfig)
    #: Prometheus /metrics endpoint (off unless metrics.listen is set)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: TLS / mutual TLS on the gRPC port
    tls: TlsConfig = field(default_factory=TlsConfig)
    #: bearer-token auth for control RPCs
    auth: AuthConfig = field(default_factory=AuthConfig)
    #: seconds between checks of the config file for changes (policy parameters are
    #: reloaded in place, as on SIGHUP); 0 = only on SIGHUP
    reload_interval_s: float = 5.0
    #: HOST:PORT of a running replica to copy the index from before reporting SERVING; empty = start cold
    warm_from: str = ""
    #: seconds the warm-up may take before the replica serves with what it has
    warm_timeout_s: float = 30.0

    def validate(self) -> None:
        """Raise one ConfigError listing every wrong field (``problems``), or return."""
        if problems := self.problems():
            raise ConfigError(*problems)

    def problems(self) -> list[str]:
        """Every wrong field, each as ``field: what is wrong``, in the file's order."""
        from .policies import registry

        out: list[str] = []

        def check(call: Callable[[], object], prefix: str = "") -> None:
            try:
                call()
            except ConfigError as exc:
                out.extend(prefix + p for p in exc.problems)
            except KVRouterError as exc:
                out.append(prefix + str(exc))

        if not _is_host_port(self.listen):
            out.append(f"listen: expected HOST:PORT, got {self.listen!r}")
        if not 1 <= self.block_size <= 4096:
            out.append(f"block_size: must be in [1, 4096], got {self.block_size}")
        check(lambda: registry.build("routing", self.routing), "routing: ")  # type: ignore[arg-type]
        for i, spec in enumerate(self.extra_routing):
            check(lambda spec=spec: registry.build("routing", spec), f"extra_routing[{i}]: ")  # type: ignore[misc]
        check(lambda: registry.build("eviction", self.eviction), "eviction: ")  # type: ignore[arg-type]
        check(self.events.validate)  # before the workers: their endpoints are checked against its allow-list
        allow = self.events.allow_list
        lim = self.limits
        seen: set[str] = set()
        for i, w in enumerate(self.workers):
            if not w.id:
                out.append(f"workers[{i}].id: must not be empty")
            elif w.id in seen:
                out.append(f"workers[{i}].id: duplicate worker id {w.id!r}")
            seen.add(w.id)
            if not w.address:
                out.append(f"workers[{i}].address: must not be empty")
            elif not is_host_port(w.address):
                out.append(f"workers[{i}].address: {w.address!r} must be HOST:PORT (IPv6 as [ADDR]:PORT)")
            elif w.kv_events_endpoint:
                check(lambda w=w: check_worker_endpoints(allow, w.id, w.address, w.kv_events_endpoint),  # type: ignore[misc]
                      f"workers[{i}].kv_events_endpoint: ")
            if w.capacity_blocks < 0:
                out.append(f"workers[{i}].capacity_blocks: must be >= 0")
            for fname, names in (("models", w.models), ("loras", w.loras)):
                if len(names) > MAX_POOL_NAMES:
                    out.append(f"workers[{i}].{fname}: {len(names)} names, at most {MAX_POOL_NAMES}")
                for name in names:
                    if not name or len(name) > lim.max_id_length:
                        out.append(f"workers[{i}].{fname}: {name!r} must be 1 to limits.max_id_length="
                                   f"{lim.max_id_length} characters")
            if not 0 <= w.max_loras <= MAX_LORAS:
                out.append(f"workers[{i}].max_loras: must be in [0, {MAX_LORAS}] (0 = unknown)")
            for fname, value, limit in (("id", w.id, lim.max_id_length), ("address", w.address, lim.max_address_length),
                                        ("kv_events_endpoint", w.kv_events_endpoint, lim.max_address_length),
                                        ("labels", "".join(k + v for k, v in w.labels.items()), lim.max_labels_length)):
                if len(value) > limit:
                    out.append(f"workers[{i}].{fname}: {len(value)} characters, over the limits.max_*_length of {limit}")
        for fname in ("max_message_bytes", "max_prompt_tokens", "max_batch_events", "max_event_batch_bytes",
                      "max_batch_blocks", "max_concurrent_streams",
                      "max_evict_blocks", "max_evict_pinned", "max_id_length", "max_address_length", "max_labels_length",
                      "max_inflight_bytes", "approximate_capacity_blocks"):
            if getattr(lim, fname) <= 0:
                out.append(f"limits.{fname}: must be > 0")
        if 0 < lim.max_batch_blocks < 8:
            out.append("limits.max_batch_blocks: must be >= 8, what one event counts at least")
        if 0 < lim.max_message_bytes < 4096:
            out.append("limits.max_message_bytes: must be >= 4096")
        if lim.inflight_timeout_s <= 0:
            out.append("limits.inflight_timeout_s: must be > 0")
        if lim.off_loop_prompt_bytes < 0:
            out.append("limits.off_loop_prompt_bytes: must be >= 0 (0 = hash every prompt on the loop)")
        if not 0 <= self.lora.load_cost_requests <= 1e6:
            out.append(f"lora.load_cost_requests: must be in [0, 1e6], got {self.lora.load_cost_requests}")
        if self.default_ttft_slo_ms <= 0:
            out.append("default_ttft_slo_ms: must be > 0")
        if self.telemetry.loop_stall_warn_ms != 0 and not 10 <= self.telemetry.loop_stall_warn_ms <= 60_000:
            out.append("telemetry.loop_stall_warn_ms: must be 0 (off) or in [10, 60000]")
        if not 0 < self.tick_interval_s <= 10:
            out.append("tick_interval_s: must be in (0, 10]")
        out += self.admission.problems()
        for section in (self.discovery, self.ext_proc, self.metrics, self.tls, self.auth):
            check(section.validate)
        if self.reload_interval_s < 0:
            out.append("reload_interval_s: must be >= 0 (0 = reload only on SIGHUP)")
        if self.warm_from and not _is_host_port(self.warm_from):
            out.append(f"warm_from: expected HOST:PORT or empty, got {self.warm_from!r}")
        if self.warm_timeout_s <= 0:
            out.append("warm_timeout_s: must be > 0")
        return out

    def router_settings(self):  # type: ignore[no-untyped-def]
        from .router import RouterSettings

        return RouterSettings(
            block_size=self.block_size,
            routing=self.routing,
            extra_routing=tuple(self.extra_routing),
            eviction=self.eviction,
            inflight_timeout_s=self.limits.inflight_timeout_s,
            max_prompt_tokens=self.limits.max_prompt_tokens,
            max_evict_blocks=self.limits.max_evict_blocks,
            max_evict_pinned=self.limits.max_evict_pinned,
            max_id_length=self.limits.max_id_length,
            max_address_length=self.limits.max_address_length,
            max_labels_length=self.limits.max_labels_length,
            max_inflight_bytes=self.limits.max_inflight_bytes,
            approximate_capacity_blocks=self.limits.approximate_capacity_blocks,
            # half a message: ListWorkers / GetStats add state, counters and framing per worker
            max_workers_description_length=self.limits.max_message_bytes // 2,
            default_ttft_slo_ms=self.default_ttft_slo_ms,
            lora_load_cost=self.lora.load_cost_requests,
        )


# ---- generic loading ----------------------------------------------------------------

def _type_name(t: Any) -> str:
    return getattr(t, "__name__", str(t))


def _convert(t: Any, value: Any, where: str, problems: list[str]) -> Any:
    """``value`` as type ``t``. A wrong leaf raises ConfigError; inside a list, mapping or
    section each wrong entry is added to ``problems`` and left out (its default applies), so
    one load reports every wrong field."""
    origin = typing.get_origin(t)
    if dataclasses.is_dataclass(t):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(t, value, where, problems)
    if origin is Literal:
        allowed = typing.get_args(t)
        if value not in allowed:
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin is list:
        (item_t,) = typing.get_args(t)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [v for v in (_entry(item_t, v, f"{where}[{i}]", problems) for i, v in enumerate(value)) if v is not _BAD]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_t, val_t = typing.get_args(t)
        if val_t is Any:
            return {str(k): v for k, v in value.items()}
        converted = {str(k): _entry(val_t, v, f"{where}.{k}", problems) for k, v in value.items()}
        return {k: v for k, v in converted.items() if v is not _BAD}
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{where}: unsupported union type")  # pragma: no cover - schema bug
    if t is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if t is int:
        if isinstance(value, str) and (number := parse_decimal(value.strip(), signed=True)) is not None:
            return number
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if t is float:
        if isinstance(value, str):
            if (real := parse_number(value.strip())) is None:
                raise ConfigError(f"{where}: expected a number, got {value!r}")
            return real
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if t is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


#: a wrong entry, left out of its container
_BAD = object()


def _entry(t: Any, value: Any, where: str, problems: list[str]) -> Any:
    try:
        return _convert(t, value, where, problems)
    except ConfigError as exc:
        problems += exc.problems
        return _BAD


def _build(cls: Any, data: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    """A ``cls`` from ``data``: unknown and wrong keys go to ``problems`` (a wrong one takes
    its default); a missing required one raises, since there is no default to take."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    problems += [f"{prefix}{key}: unknown setting; known: {', '.join(sorted(fields))}" for key in data if key not in fields]
    converted = {k: _entry(hints[k], v, f"{prefix}{k}", problems) for k, v in data.items() if k in fields}
    missing = [
        f"{prefix}{name}: required" for name, f in fields.items()
        if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ConfigError(*missing)
    return cls(**{k: v for k, v in converted.items() if v is not _BAD})


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k not in ("routing", "eviction"):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


#: environment variable -> dotted config path
ENV_KEYS = {
    "LISTEN": "listen",
    "BLOCK_SIZE": "block_size",
    "ROUTING_POLICY": "routing.name",
    "EVICTION_POLICY": "eviction.name",
    "DEFAULT_TTFT_SLO_MS": "default_ttft_slo_ms",
    "MAX_MESSAGE_BYTES": "limits.max_message_bytes",
    "MAX_PROMPT_TOKENS": "limits.max_prompt_tokens",
    "TRACES": "telemetry.traces",
    "LOG_LEVEL": "telemetry.log_level",
    "LOG_FORMAT": "telemetry.log_format",
    "METRICS_LISTEN": "metrics.listen",
    "TLS_CERT_FILE": "tls.cert_file",
    "TLS_KEY_FILE": "tls.key_file",
    "TLS_CA_FILE": "tls.ca_file",
    "TLS_REQUIRE_CLIENT_CERT": "tls.require_client_cert",
    "AUTH_TOKEN_FILE": "auth.token_file",
    "AUTH_TOKEN_ENV": "auth.token_env",
}


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: cannot override inside a non-mapping")
    if parents and parents[-1] in ("routing", "eviction") and leaf == "name" and node.get("name") != value:
        node.clear()  # a different policy: its parameters no longer apply
    node[leaf] = value


def _expand_policy_names(data: dict[str, Any]) -> None:
    """``routing: cache_aware`` is ``routing: {name: cache_aware}``; so for eviction and each
    extra_routing entry (a policy with its default parameters)."""
    for key in ("routing", "eviction"):
        if isinstance(data.get(key), str):
            data[key] = {"name": data[key]}
    if isinstance(data.get("extra_routing"), list):
        data["extra_routing"] = [{"name": s} if isinstance(s, str) else s for s in data["extra_routing"]]


def parse_config(data: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """A validated Config from a mapping (as loaded from YAML) and dotted-path overrides."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError("the config file must hold a mapping at the top level")
    merged: dict[str, Any] = _merge({}, data or {})
    _expand_policy_names(merged)
    for dotted, value in (overrides or {}).items():
        _set_path(merged, dotted, value)
    problems: list[str] = []
    cfg = _build(Config, merged, "", problems)
    # the values' own checks run on what was read, wrong entries at their defaults, so a
    # type error and a range error elsewhere are reported together
    problems += cfg.problems()
    if problems:
        raise ConfigError(*problems)
    return cfg


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Defaults, then the YAML file, then KVROUTERD_* variables, then ``overrides``."""
    env = os.environ if environ is None else environ
    data: Any = None
    path = path or env.get(ENV_PREFIX + "CONFIG") or None
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    merged_overrides: dict[str, Any] = {}
    from_env: dict[str, str] = {}  # dotted path -> the variable that set it
    for suffix, dotted in ENV_KEYS.items():
        if (value := env.get(ENV_PREFIX + suffix)) is not None:
            merged_overrides[dotted] = value
            from_env[dotted] = ENV_PREFIX + suffix
    for dotted in overrides or {}:
        from_env.pop(dotted, None)  # a flag wins over the variable
    merged_overrides.update(overrides or {})
    try:
        cfg = parse_config(data, merged_overrides)
    except ConfigError as exc:
        raise ConfigError(*(_name_variable(p, from_env, env) for p in exc.problems)) from None
    _reject_unknown_variables(env, cfg)
    return cfg


#: KVROUTERD_* variables that are not config keys: the config file, the pure-Python switch
#: (kvrouterd.index.native) and the image's build argument
NON_CONFIG_VARIABLES = frozenset({"CONFIG", "PURE_PYTHON", "EXTRAS"})


def _reject_unknown_variables(env: Mapping[str, str], cfg: Config) -> None:
    """A misspelt KVROUTERD_* variable would otherwise be silently ignored."""
    known = {ENV_PREFIX + s for s in (*ENV_KEYS, *NON_CONFIG_VARIABLES)}
    if cfg.auth.token_env:
        known.add(cfg.auth.token_env)  # the token may live in a KVROUTERD_-named variable
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise ConfigError(
            f"unknown environment variable {unknown[0]}; known: {', '.join(sorted(known - {cfg.auth.token_env}))}"
        )


def _name_variable(message: str, from_env: Mapping[str, str], env: Mapping[str, str]) -> str:
    """Prefix an error about an env-sourced key with the variable and its value."""
    for dotted, variable in sorted(from_env.items(), key=lambda kv: -len(kv[0])):
        head = dotted.split(".")[0]
        if message.startswith((dotted + ":", dotted + " ", head + ":")):
            return f"{variable}={env[variable]!r}: {message}"
    return message
