"""``llm_d``: llm-d's default scheduling profile, its three scorers and the max-score picker.

Source: llm-d/llm-d-inference-scheduler (now the llm-d router), read to learn, not copied:
``pkg/epp/config/loader/defaults.go`` (``loadDefaultConfig``: the "default" profile with
``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight 2, ``prefix-cache-scorer``
weight 3; ``ensureSchedulingLayer`` adds ``max-score-picker``), the scorers under
``pkg/epp/framework/plugins/scheduling/scorer/`` (``queuedepth/queue.go``,
``kvcacheutilization/kvcache_utilization.go``, ``prefix/plugin.go``), the sum in
``pkg/epp/scheduling/scheduler_profile.go`` (``runScorerPlugins``: each score clamped to
[0, 1] and multiplied by its weight) and ``picker/maxscore/picker.go`` (shuffle, then the
highest total; ``maxNumOfEndpoints`` 1). Each scorer gives a worker a score in [0, 1]:

- queue: ``(max_q - q) / (max_q - min_q)`` over the candidates, ``q`` the worker's waiting
  requests; 1 for every worker when all queues are equal.
- KV-cache utilisation: ``1 - kv_utilization``.
- prefix cache: matched prompt blocks / prompt blocks, both counted over the prompt's first
  ``max_prefix_blocks`` blocks only (0 for a prompt without a full block). llm-d's producer
  hashes at most ``maxPrefixBlocksToMatch`` = 256 blocks of the engine's block size
  (``dataproducer/approximateprefix/types.go``, ``defaultMaxPrefixBlocks``; ``hashing.go``,
  ``hashPrompt``, truncates the prompt there), so two prompts that agree on their first 256
  blocks score alike: a worker holding those blocks scores 1 however long the prompt runs on.

The request goes to the highest ``queue_weight * queue + kv_cache_weight * kv + prefix_weight
* prefix``; ties are broken uniformly at random (the picker shuffles before a stable sort).

Inputs, and what is approximated:

- ``q`` is the engine's reported waiting queue (``ReportLoad``'s queued requests, llm-d's
  ``vllm:num_requests_waiting`` scraped every 50 ms, ``datalayer/runtime.go``) plus the
  requests waiting for the worker in the router's admission queue. An engine that never
  reports scores 1 like every other: in ``sim cluster`` pass ``--load-report-ms 50``. The
  simulated engines report a request still prefilling as queued (vLLM counts a request it
  prefills in chunks as running), so here the queue scorer also sees prefills in progress.
- ``kv_utilization`` is the engine's reported KV-cache use (``ReportLoad``), 0 until reported:
  llm-d reads ``vllm:kv_cache_usage_perc``, the blocks running requests hold, cached blocks
  no request holds counting as free (``sim.engine.SimEngine.used_blocks`` reports the same).
  With every queue empty, idle workers then tie at 1 on both load scorers and the picker
  draws among them; were cached blocks counted, each worker's fill would differ a little and
  every request of a simultaneous burst would go to the least-filled one.
- The prefix match is the router's index (engine events, or routing-time placement in
  approximate mode). llm-d's default producer (``approx-prefix-cache-producer``) learns only
  from its own routing decisions, an LRU of ``lruCapacityPerServer`` blocks per server
  (31,250, or the engine's reported cache size with ``autoTune``); the router's index is that
  view in approximate mode and a truer one with engine events.

Measured (``sim cluster``, Mooncake trace, 4,000 requests, 8 engines, caches 30%, SLO 5 s,
reports every 100 ms, no admission): 96.7% within the SLO at 0.5 req/s, 91.3% at 2, 85.1% at
4: capacity 2.0 req/s (88.3% at 0.5 while the simulated engines counted cached blocks as
used). Between two reports nothing moves a worker's scores, and the trace's timestamps lie on
a 3 s grid, about 9 requests per instant: once engines are busy their reports differ, and a
burst goes to the best-scored worker of the last report (at 4 req/s, 75% of a burst on one
worker on average; 468 of 522 misses on a worker given 3 or more of its burst; reports every
50 ms change nothing). Each burst spread uniformly over its 3 s (scaled to the rate), the same
run meets the SLO for 96.5% at 4 req/s (``cache_aware``: 94.4%).

Parameters (llm-d's defaults):

- ``queue_weight`` = 2.0, ``kv_cache_weight`` = 2.0, ``prefix_weight`` = 3.0 (each >= 0,
  not all 0).
- ``max_prefix_blocks`` = 256: prompt blocks the prefix scorer considers, in the router's
  (the engines') blocks, as llm-d's ``autoTune`` reads the engine's block size (0 = all).

Not modelled: llm-d hashes a prompt's trailing partial block too (one more block in the
denominator, matched only by an identical tail), and its approximate index credits a server
with every block of the run that some server holds, not only its own leading run (the two
differ only after a server's LRU dropped a block inside a prefix it still holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...index.workers import Worker
from ...protocols import Decision
from ..base import RoutingContext, RoutingPolicyBase

__all__ = ["LlmDParams", "LlmDPolicy"]


@dataclass(frozen=True)
class LlmDParams:
    queue_weight: float = field(default=2.0, metadata={"help": "weight of the queue scorer"})
    kv_cache_weight: float = field(default=2.0, metadata={"help": "weight of the KV-cache-utilisation scorer"})
    prefix_weight: float = field(default=3.0, metadata={"help": "weight of the prefix-cache scorer"})
    max_prefix_blocks: int = field(default=256, metadata={"help": "prompt blocks the prefix scorer reads (0 = all)"})

    def validate(self) -> None:
        for name in ("queue_weight", "kv_cache_weight", "prefix_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.queue_weight + self.kv_cache_weight + self.prefix_weight == 0:
            raise ValueError("queue_weight, kv_cache_weight and prefix_weight must not all be 0")
        if self.max_prefix_blocks < 0:
            raise ValueError(f"max_prefix_blocks must be >= 0, got {self.max_prefix_blocks}")


def _clamp(score: float) -> float:
    return 0.0 if score < 0 else 1.0 if score > 1 else score


@dataclass(slots=True)
class LlmDScores:
    """One worker's three scorer outputs and their weighted sum."""

    worker: Worker
    queue: float
    kv_cache: float
    prefix: float
    total: float


class LlmDPolicy(RoutingPolicyBase):
    params: LlmDParams

    @staticmethod
    def waiting(worker: Worker) -> int:
        """Requests waiting for ``worker``: the engine's queue plus the router's admission queue."""
        return worker.reported_queue + worker.queued_requests

    def scores(self, ctx: RoutingContext) -> list[LlmDScores]:
        """Every candidate's scores, without changing state."""
        p = self.params
        queues = [self.waiting(w) for w in ctx.candidates]
        lo, hi = min(queues), max(queues)
        # llm-d matches only the prompt's first maxPrefixBlocksToMatch blocks
        # (dataproducer/approximateprefix/hashing.go, hashPrompt)
        cap = p.max_prefix_blocks or ctx.prompt_blocks
        blocks = min(ctx.prompt_blocks, cap)
        out = []
        for w, q in zip(ctx.candidates, queues):
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            kv = _clamp(1.0 - w.kv_utilization)
            prefix = _clamp(min(ctx.overlap(w), blocks) / blocks) if blocks else 0.0
            total = p.queue_weight * _clamp(queue) + p.kv_cache_weight * kv + p.prefix_weight * prefix
            out.append(LlmDScores(w, queue, kv, prefix, total))
        return out

    def select(self, ctx: RoutingContext) -> Decision:
        rows = self.scores(ctx)
        top = max(r.total for r in rows)
        best = [r for r in rows if r.total == top]
        pick = best[self.rng.randrange(len(best))] if len(best) > 1 else best[0]
        scored = []
        if ctx.explain:
            scored = [ctx.candidate(r.worker, r.total, queue_score=round(r.queue, 4), kv_cache_score=round(r.kv_cache, 4),
                                    prefix_score=round(r.prefix, 4)) for r in rows]
        return self.decide(ctx, pick.worker, "max_score", scored, score=round(pick.total, 4),
                           prefix_score=round(pick.prefix, 4))
