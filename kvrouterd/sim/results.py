"""What one simulated run produced (``RunResult``), read by the sweep, the report and ``sim reproduce``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import metrics as m

__all__ = ["RunResult"]


@dataclass
class RunResult:
    """One run: its policy pair, workload, rate and seed; the summary, every request's record,
    the router's counters and each engine's cache figures."""

    routing: str
    eviction: str
    workload: str
    rate: float
    seed: int
    capacity_blocks: int
    #: tokens per block of the workload (Mooncake traces 512, generators 64 unless told): the
    #: unit of capacity_blocks and of every block count
    block_tokens: int
    summary: m.RunSummary
    records: list[m.RequestRecord]
    wall_s: float
    counters: dict[str, int]
    engine_stats: list[dict[str, Any]]

    def as_dict(self, with_records: bool = False) -> dict[str, Any]:
        out = {"routing": self.routing, "eviction": self.eviction, "workload": self.workload, "rate": self.rate,
               "seed": self.seed, "capacity_blocks": self.capacity_blocks, "block_tokens": self.block_tokens,
               "wall_s": round(self.wall_s, 3), **self.summary.as_dict(),
               "router_counters": self.counters, "engines": self.engine_stats}
        if with_records:
            out["ttft_s"] = [r.ttft_s for r in self.records]
        return out
