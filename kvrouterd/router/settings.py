"""What the router core needs from the configuration (``RouterSettings``), checked at start-up.

``config.py`` builds it from the ``router:`` and ``limits:`` sections; the simulator builds it
directly. Every part of the router reads it through ``Shared.settings``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["MAX_SPECULATIVE_TTL_S", "PD_MODES", "DisaggregationSettings", "RouterSettings"]

#: how a prefill/decode pool routes (``router.disagg``): two hops only when it pays, always, never
PD_MODES = ("conditional", "always", "never")


@dataclass(frozen=True)
class DisaggregationSettings:
    """Prefill/decode routing (config ``disaggregation:``; ``router.disagg`` states the rules).

    The defaults come from ``kvrouterd sim cluster --pd`` on the Mooncake conversation trace
    and a long-context multi-turn workload (docs/results.md, "Prefill/decode disaggregation")."""

    #: conditional, always or never (never: the decode workers prefill every request themselves)
    mode: str = "conditional"
    #: prefill on the decode worker when it would compute at most this many prompt tokens (its
    #: uncached suffix): a transfer's fixed cost and a second queue outweigh so small a prefill
    local_prefill_max_uncached_tokens: int = 1024
    #: prefill on the decode worker when the chosen prefill worker already has this many
    #: prompt tokens to compute (routed and queued in the router); 0 = never for this reason
    prefill_busy_tokens: int = 65536
    #: ... but only while the decode worker's own prompt work (routed and queued prefill tokens,
    #: this request's included) stays within this: past it the prefill hop is taken anyway
    decode_busy_tokens: int = 8192

    def validate(self) -> None:
        if self.mode not in PD_MODES:
            raise ConfigError(f"disaggregation.mode must be one of {', '.join(PD_MODES)}, got {self.mode!r}")
        for name in ("local_prefill_max_uncached_tokens", "prefill_busy_tokens", "decode_busy_tokens"):
            if not 0 <= getattr(self, name) <= 1 << 30:
                raise ConfigError(f"disaggregation.{name} must be in [0, 2**30], got {getattr(self, name)}")

#: longest a block may count as cached before its engine stores it, s: past a few minutes the
#: request it came from has timed out (``inflight_timeout_s``) or the engine does not cache it
MAX_SPECULATIVE_TTL_S = 600.0


@dataclass(frozen=True)
class RouterSettings:
    """What the router core needs from the configuration."""

    block_size: int = 16
    routing: Mapping[str, Any] = field(default_factory=lambda: {"name": "cache_aware"})
    #: extra routing policies requests may name, besides the default one
    extra_routing: Sequence[Mapping[str, Any]] = ()
    eviction: Mapping[str, Any] = field(default_factory=lambda: {"name": "lru"})
    #: a request not completed within this many seconds stops counting as load
    inflight_timeout_s: float = 300.0
    max_prompt_tokens: int = 1 << 20
    #: default TTFT objective for policies that use one, ms
    default_ttft_slo_ms: float = 5000.0
    #: most blocks one EvictHint ranks: ranking costs grow with the answer, and the call runs
    #: on the routing loop (an engine wanting more asks again after evicting these)
    max_evict_blocks: int = 1024
    #: most pinned keys and engine hashes one eviction hint may list together
    max_evict_pinned: int = 65536
    #: client-chosen sizes (config ``limits.*``): ids, worker addresses and labels, characters
    max_id_length: int = 256
    max_address_length: int = 1024
    max_labels_length: int = 16384
    #: most bytes the in-flight table may hold (``Router.inflight_bytes``); 0 = no limit (the
    #: simulator), the daemon's config always sets one
    max_inflight_bytes: int = 0
    #: most requests in flight per client (``RouteRequest.client``); 0 = no limit (the
    #: simulator), the daemon's config always sets one
    max_inflight_per_client: int = 0
    #: modelled cache size of an approximate-mode worker without ``capacity_blocks``; 0 = such a
    #: worker's model is unbounded (the simulator's "infinite cache"), the daemon always sets one
    approximate_capacity_blocks: int = 0
    #: most characters all workers' descriptions (ids, addresses, endpoints, labels) may total,
    #: so ListWorkers and GetStats still fit in one message; 0 = no limit
    max_workers_description_length: int = 0
    #: seconds a routed prompt's blocks count as cached on its events-mode worker before the
    #: engine's Stored confirms them (config ``speculative.ttl_s``, ``router.speculative``); 0 = off, the blocks count only once stored
    speculative_ttl_s: float = 0.0
    #: most blocks claimed that way on one worker, and on all together (the oldest claims go first)
    speculative_max_blocks_per_worker: int = 1 << 16
    speculative_max_blocks: int = 1 << 19
    #: what loading a LoRA adapter costs, in requests of load: a worker without the adapter is
    #: a candidate for it only when the least loaded worker holding it has this many more
    #: requests (twice this when it would evict another adapter); ``router.pools``
    lora_load_cost: float = 2.0
    disaggregation: DisaggregationSettings = field(default_factory=DisaggregationSettings)

    def validate(self) -> None:
        if not 1 <= self.block_size <= 4096:
            raise ConfigError(f"block_size must be in [1, 4096], got {self.block_size}")
        if self.inflight_timeout_s <= 0:
            raise ConfigError(f"inflight_timeout_s must be > 0, got {self.inflight_timeout_s}")
        if self.max_prompt_tokens <= 0:
            raise ConfigError(f"max_prompt_tokens must be > 0, got {self.max_prompt_tokens}")
        if self.max_evict_blocks <= 0:
            raise ConfigError(f"max_evict_blocks must be > 0, got {self.max_evict_blocks}")
        if self.max_evict_pinned <= 0:
            raise ConfigError(f"max_evict_pinned must be > 0, got {self.max_evict_pinned}")
        for name in ("max_id_length", "max_address_length", "max_labels_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.speculative_ttl_s <= MAX_SPECULATIVE_TTL_S:
            raise ConfigError(f"speculative_ttl_s must be in [0, {MAX_SPECULATIVE_TTL_S:.0f}] (0 = off), "
                              f"got {self.speculative_ttl_s}")
        for name in ("speculative_max_blocks_per_worker", "speculative_max_blocks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.lora_load_cost <= 1e6:  # also NaN
            raise ConfigError(f"lora.load_cost_requests must be in [0, 1e6], got {self.lora_load_cost}")
        self.disaggregation.validate()
        for name in ("max_inflight_bytes", "max_inflight_per_client", "approximate_capacity_blocks",
                     "max_workers_description_length"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
