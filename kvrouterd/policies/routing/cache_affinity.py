"""``cache_affinity``: the worker holding the longest cached prefix; a cold prompt by its prefix hash.

The *Cache Affinity* baseline of DualMap: "a cache-affinity strategy maps
requests with identical prompt prefixes to the same instance using a prompt-aware function"
(section 1) and "always routes a request to the instance with the highest expected cache
reuse" (section 3.2, A.1.1), so m requests sharing a prefix reach a hit rate of
``max(0, 1 - 1/m)`` (section 2.3): only the first misses. It ignores load entirely, so a hot
prefix piles onto one worker.

A prompt's *key* is its first ``key_tokens`` tokens (DualMap's own partial prefix, 2 x 512;
all its full blocks if shorter): the prefix whose m requests the paper's hit-rate argument
counts (section 2.3).

- A prompt whose whole key some candidate holds goes to the one holding the longest prefix
  (ties to fewer pending prefill tokens, then the lower slot): reason ``longest_prefix``.
- A prompt whose key no candidate holds is cold (``cold_placement: prefix_hash``, the
  paper's): its key is hashed onto a consistent-hash ring of the workers (``hash_ring``,
  ring f1), so every request with that key lands on the same worker even before any engine
  reports caching it: reason ``prefix_hash``. A cached prefix shorter than the key does not
  make a prompt warm: on the Mooncake conversation trace every prompt starts with the same
  512-token block, and following it would send the whole trace to the first prompt's
  worker. ``cold_placement: least_loaded`` sends a prompt no candidate holds any block of to
  the fewest pending prefill tokens instead (reason ``cold_least_loaded``), kvrouterd's
  earlier variant, whose events-mode races spread a shared prefix over several workers.
- A prompt without a full block goes to the fewest pending prefill tokens (``no_prefix``).

Parameters:

- ``cold_placement`` = "prefix_hash": where a prompt cached nowhere goes.
- ``key_tokens`` = 1024: tokens of the prompt prefix hashed (a shorter prompt hashes all of
  its full blocks); at least one block.
- ``virtual_nodes`` = 128: points per worker on the hash ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...index.workers import Worker
from ...protocols import Decision
from ..base import RoutingContext, RoutingPolicyBase
from .hash_ring import DualHashRing

__all__ = ["CacheAffinityParams", "CacheAffinityPolicy"]


@dataclass(frozen=True)
class CacheAffinityParams:
    cold_placement: Literal["prefix_hash", "least_loaded"] = field(
        default="prefix_hash", metadata={"help": "a prompt cached nowhere: by its prefix hash, or least loaded"}
    )
    key_tokens: int = field(default=1024, metadata={"help": "prompt-prefix tokens hashed to place a cold prompt"})
    virtual_nodes: int = field(default=128, metadata={"help": "points per worker on the hash ring"})

    def validate(self) -> None:
        if self.cold_placement not in ("prefix_hash", "least_loaded"):
            raise ValueError(f"cold_placement must be 'prefix_hash' or 'least_loaded', got {self.cold_placement!r}")
        if self.key_tokens < 1:
            raise ValueError(f"key_tokens must be >= 1, got {self.key_tokens}")
        if self.virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {self.virtual_nodes}")


class CacheAffinityPolicy(RoutingPolicyBase):
    params: CacheAffinityParams

    def __init__(self, params: CacheAffinityParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        self.ring = DualHashRing(params.virtual_nodes)

    def key_blocks(self, ctx: RoutingContext) -> int:
        """Blocks in the prompt's key: its first ``key_tokens`` tokens, at most the prompt."""
        return min(len(ctx.request.keys), max(1, self.params.key_tokens // ctx.block_size))

    def hashed_worker(self, ctx: RoutingContext) -> str | None:
        """The candidate the prompt's key hashes to (None: no full block, or none on the ring)."""
        blocks = self.key_blocks(ctx)
        if not blocks:
            return None
        by_id = {w.id for w in ctx.candidates}
        # block keys chain their predecessors, so the key of the prefix's last block names it
        return self.ring.first(ctx.request.keys[blocks - 1], 0, by_id.__contains__)

    def select(self, ctx: RoutingContext) -> Decision:
        candidates = ctx.candidates
        chosen = min(candidates, key=lambda w: (-ctx.overlap(w), w.pending_prefill_tokens, w.slot))
        least_loaded = self.params.cold_placement == "least_loaded"
        if not ctx.request.keys:
            reason = "no_prefix"
        elif ctx.overlap(chosen) >= (1 if least_loaded else self.key_blocks(ctx)):
            reason = "longest_prefix"
        elif least_loaded:
            chosen = min(candidates, key=lambda w: (w.pending_prefill_tokens, w.slot))
            reason = "cold_least_loaded"
        else:
            hashed = self.hashed_worker(ctx)
            if hashed is not None:
                chosen = next(w for w in candidates if w.id == hashed)
                reason = "prefix_hash"
            else:
                reason = "not_on_ring"
        scored = []
        if ctx.explain:
            scored = [ctx.candidate(w, float(ctx.overlap(w))) for w in ctx.explained(chosen)]
        return self.decide(ctx, chosen, reason, scored)

    def on_worker_added(self, worker: Worker) -> None:
        self.ring.add(worker.id)

    def on_worker_removed(self, worker: Worker) -> None:
        self.ring.remove(worker.id)
