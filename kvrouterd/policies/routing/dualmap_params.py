"""DualMap's parameters (``dualmap``) and the paper-only variant's (``dualmap_paper``).

What each one does, and why its default, is in ``dualmap``'s docstring; this module only
declares and validates them, so the policy's file stays one algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..latency import LatencyParams

__all__ = ["DualMapPaperParams", "DualMapParams"]


@dataclass(frozen=True)
class DualMapParams(LatencyParams):
    # the paper profiles the GPU once (3.2); online calibration is opt-in (see the docstring)
    calibrate: bool = field(default=False, metadata={"help": "fit the prefill model online from observed TTFT"})
    segment_tokens: int = field(default=512, metadata={"help": "tokens per hash-key segment"})
    base_segments: int = field(default=2, metadata={"help": "segments in a cold prefix's hash key"})
    max_key_segments: int = field(default=64, metadata={"help": "longest hash key, in segments"})
    virtual_nodes: int = field(default=128, metadata={"help": "points per worker on each hash ring"})
    hotness_window_s: float = field(default=60.0, metadata={"help": "sliding window for prefix traffic shares, s"})
    hotness_buckets: int = field(default=12, metadata={"help": "buckets the hotness window is split into"})
    hotness_min_requests: int = field(default=50, metadata={"help": "requests in the window before hotness is judged"})
    default_ttft_slo_ms: float = field(default=5000.0, metadata={"help": "TTFT SLO for requests that carry none, ms"})
    slo_test: Literal["static_threshold", "latency_model"] = field(
        default="static_threshold",
        metadata={"help": "overload test: token threshold from the static model, or the calibrated TTFT estimate"},
    )
    slo_threshold_tokens: int = field(
        default=0, metadata={"help": "pending-token threshold for static_threshold (0 = derive from the SLO)"}
    )
    decode_bottleneck_s: float = field(
        default=3.0, metadata={"help": "no prefill completed for this long with work queued = overloaded (0 = off)"}
    )
    decode_bottleneck_gate: Literal["paper", "guarded"] = field(
        default="paper", metadata={"help": "A.7 as written, or also gated on reported KV use and the longest "
                                             "prefill in flight"})
    decode_bottleneck_kv: float = field(
        default=0.95, metadata={"help": "guarded A.7: reported KV use, in [0, 1], below which a worker is not stuck"})
    switch_to: Literal["min_ttft", "less_loaded"] = field(
        default="min_ttft",
        metadata={"help": "paper SLO switch target: the candidate with the lower estimated TTFT, its cache hit "
                          "included (A.5, A.6), or the one with fewer pending tokens (3.2's summary)"},
    )
    slo_switch: Literal["paper", "guarded"] = field(
        default="paper", metadata={"help": "switch whenever the preferred candidate is overloaded (paper), or only "
                                             "to one that meets the SLO with headroom and saves more than it recomputes"})
    switch_headroom: float = field(
        default=0.2, metadata={"help": "guarded switch: a target must be within (1 - this) of the SLO, in [0, 1)"})
    cold_placement: Literal["pair", "fleet"] = field(
        default="fleet", metadata={"help": "prompts cached nowhere: the lighter of the pair (paper), or the best worker "
                                           "of the fleet, remembered for follow-ups"})
    placement_memory_entries: int = field(
        default=65536, metadata={"help": "fleet placements remembered (prefix key -> worker)"})
    placement_memory_ttl_s: float = field(
        default=600.0, metadata={"help": "a placement unused this long is forgotten, s (0 = only by the bound)"})

    def validate(self) -> None:
        super().validate()
        for name in ("segment_tokens", "base_segments", "max_key_segments", "virtual_nodes",
                     "hotness_buckets", "hotness_min_requests", "placement_memory_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_key_segments < self.base_segments:
            raise ValueError(f"max_key_segments must be >= base_segments, got {self.max_key_segments}")
        if self.hotness_window_s <= 0:
            raise ValueError(f"hotness_window_s must be > 0, got {self.hotness_window_s}")
        if self.default_ttft_slo_ms <= 0:
            raise ValueError(f"default_ttft_slo_ms must be > 0, got {self.default_ttft_slo_ms}")
        if self.slo_threshold_tokens < 0:
            raise ValueError(f"slo_threshold_tokens must be >= 0, got {self.slo_threshold_tokens}")
        if self.decode_bottleneck_s < 0:
            raise ValueError(f"decode_bottleneck_s must be >= 0, got {self.decode_bottleneck_s}")
        if not 0.0 <= self.decode_bottleneck_kv <= 1.0:
            raise ValueError(f"decode_bottleneck_kv must be in [0, 1], got {self.decode_bottleneck_kv}")
        if not 0.0 <= self.switch_headroom < 1.0:
            raise ValueError(f"switch_headroom must be in [0, 1), got {self.switch_headroom}")
        if not self.placement_memory_ttl_s >= 0:
            raise ValueError(f"placement_memory_ttl_s must be >= 0, got {self.placement_memory_ttl_s}")


@dataclass(frozen=True)
class DualMapPaperParams(DualMapParams):
    """DualMap as the paper states it: every departure above switched off."""

    decode_bottleneck_gate: Literal["paper", "guarded"] = "paper"
    slo_switch: Literal["paper", "guarded"] = "paper"
    cold_placement: Literal["pair", "fleet"] = "pair"
