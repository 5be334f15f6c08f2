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
    disaggregation: {mode: conditional, local_prefill_max_uncached_tokens: 1024}
    limits: {max_message_bytes: 16777216, max_prompt_tokens: 1048576}
    telemetry: {traces: none}

The policy sections are validated through the policy registry, so a typo in a policy
parameter fails here too. Loading reports every wrong field at once (``ConfigError.problems``).
The sections below the top level are ``config_sections``; this module composes them, reads
the file, the environment and the flags, and checks what spans sections.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .config_sections import (
    AdmissionConfig,
    AuthConfig,
    DisaggregationConfig,
    ExtProcConfig,
    LimitsConfig,
    LoraConfig,
    MetricsConfig,
    SpeculativeConfig,
    TelemetryConfig,
    TlsConfig,
    WorkerConfig,
    is_listen_address,
)
from .decimals import parse_decimal, parse_number
from .discovery.config import DiscoveryConfig
from .errors import ConfigError, KVRouterError
from .events.endpoints import check_worker_endpoints
from .events.zmq_config import ZmqEventsConfig
from .index.workers import MAX_LORAS, MAX_POOL_NAMES, is_host_port

__all__ = [
    "ENV_PREFIX",
    "AuthConfig",
    "Config",
    "ExtProcConfig",
    "LimitsConfig",
    "LoraConfig",
    "MetricsConfig",
    "SpeculativeConfig",
    "TelemetryConfig",
    "TlsConfig",
    "WorkerConfig",
    "load_config",
    "parse_config",
]

ENV_PREFIX = "KVROUTERD_"


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
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    #: routed prompts counted as cached on events-mode workers before their engines store them
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
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

        if not is_listen_address(self.listen):
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
                      "max_inflight_bytes", "max_inflight_per_client", "approximate_capacity_blocks"):
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
        for fname in ("local_prefill_max_uncached_tokens", "prefill_busy_tokens", "decode_busy_tokens"):
            if not 0 <= getattr(self.disaggregation, fname) <= 1 << 30:
                out.append(f"disaggregation.{fname}: must be in [0, 2**30], got {getattr(self.disaggregation, fname)}")
        if self.default_ttft_slo_ms <= 0:
            out.append("default_ttft_slo_ms: must be > 0")
        if self.telemetry.loop_stall_warn_ms != 0 and not 10 <= self.telemetry.loop_stall_warn_ms <= 60_000:
            out.append("telemetry.loop_stall_warn_ms: must be 0 (off) or in [10, 60000]")
        if not 0 < self.tick_interval_s <= 10:
            out.append("tick_interval_s: must be in (0, 10]")
        out += self.admission.problems()
        for section in (self.speculative, self.discovery, self.ext_proc, self.metrics, self.tls, self.auth):
            check(section.validate)
        if self.reload_interval_s < 0:
            out.append("reload_interval_s: must be >= 0 (0 = reload only on SIGHUP)")
        if self.warm_from and not is_listen_address(self.warm_from):
            out.append(f"warm_from: expected HOST:PORT or empty, got {self.warm_from!r}")
        if self.warm_timeout_s <= 0:
            out.append("warm_timeout_s: must be > 0")
        return out

    def router_settings(self):  # type: ignore[no-untyped-def]
        from .router import RouterSettings
        from .router.settings import DisaggregationSettings

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
            max_inflight_per_client=self.limits.max_inflight_per_client,
            approximate_capacity_blocks=self.limits.approximate_capacity_blocks,
            # half a message: ListWorkers / GetStats add state, counters and framing per worker
            max_workers_description_length=self.limits.max_message_bytes // 2,
            default_ttft_slo_ms=self.default_ttft_slo_ms,
            speculative_ttl_s=self.speculative.ttl_s,
            speculative_max_blocks_per_worker=self.speculative.max_blocks_per_worker,
            speculative_max_blocks=self.speculative.max_blocks,
            lora_load_cost=self.lora.load_cost_requests,
            disaggregation=DisaggregationSettings(**dataclasses.asdict(self.disaggregation)),
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
