"""``dynamo``: NVIDIA Dynamo's KV-router default cost, as its current source computes it.

Source: ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector/default.rs``
(``DefaultWorkerScorer::worker_logit``, ``minimum_cost_index``, ``softmax_sample_index``),
its inputs from ``lib/kv-router/src/scheduling/selector/mod.rs`` (``WorkerLoadInput``:
``raw_prefill_blocks``, ``decode_cost_blocks``) and ``lib/kv-router/src/sequences/``
(``WorkerLoadProjection::potential_decode_blocks``), defaults from
``lib/kv-router/src/scheduling/config.rs`` (``KvRouterConfig::default``). Read to learn, not
copied. For worker ``w`` (all counts in blocks of ``block_size`` tokens)::

    raw_prefill   = (active_prefill_tokens_w + prompt_tokens) / block_size
    credit        = overlap_score_credit * decay_w          (decay_w = 1 unless *_decay > 0)
    prefill_cost  = prefill_load_scale * max(0, raw_prefill - credit * overlap_blocks_w)
    decode_cost   = active_blocks_w + prompt blocks not already active on w
    cost_w        = prefill_cost + decode_cost + decode_active_request_weight * active_requests_w

``active_prefill_tokens_w`` are the uncached prompt tokens of requests routed to ``w`` whose
prefill has not finished (Dynamo's ``new_tokens(isl, overlap)`` per request);
``active_blocks_w`` the distinct full prompt blocks of the requests routed to ``w`` and not
yet completed (``router_assume_kv_reuse: true`` counts a block shared by two active requests
once; ``router_track_output_blocks: false`` leaves generated blocks out). With
``overlap_score_credit_decay`` > 0 the credit decays as ``1 / (1 + decay * excess)``,
``excess`` the worker's active prefill blocks above the least-loaded candidate's, divided by
the request's blocks. Lower is better. With ``router_temperature`` = 0 the cheapest worker
wins, ties broken uniformly at random (Dynamo's reservoir sampling); above 0 a worker is
drawn with probability proportional to ``exp(-(c - min) / ((max - min) * T))``, uniform when
all costs are equal.

What kvrouterd approximates, and why: Dynamo releases a request's prefill tokens when its
first token reaches the frontend; the router hears of a request only at ``Complete``, so
``active_prefill_tokens_w`` is the router's ledger of uncached tokens in flight
(``Worker.pending_prefill_tokens``), released at completion. That counts prompts already
decoding, so this policy weighs load somewhat more than Dynamo does. Host/disk cache tiers
(``host_cache_hit_weight`` 0.75, ``disk_cache_hit_weight`` 0.25) and the shared-cache term
(``shared_cache_multiplier`` 0.0) do not apply: the router indexes device blocks only.
``kv_cost`` is the older, simpler form the DualMap paper describes; this one is the peer.

Parameters (Dynamo's defaults):

- ``overlap_score_credit`` = 1.0: credit per cached block against prefill, in [0, 1].
- ``prefill_load_scale`` = 1.0: scale of the prefill term (the deprecated
  ``overlap_score_weight`` now maps here).
- ``overlap_score_credit_decay`` = 0.0: decay of the credit on prefill-loaded workers.
- ``decode_active_request_weight`` = 0.0: blocks charged per active request.
- ``router_temperature`` = 0.0: softmax temperature (0 = argmin).
- ``track_prefill_tokens`` = True: count active prefill tokens (``router_track_prefill_tokens``).
- ``assume_kv_reuse`` = True: count blocks shared by active requests once.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...index.workers import Worker
from ...protocols import Completion, Decision, RouteRequest
from ..base import RoutingContext, RoutingPolicyBase

__all__ = ["DynamoParams", "DynamoPolicy"]

#: in-flight requests remembered before the oldest is dropped (a lost Complete must not leak)
_MAX_TRACKED = 200_000


@dataclass(frozen=True)
class DynamoParams:
    overlap_score_credit: float = field(default=1.0, metadata={"help": "credit per cached block against prefill, in [0, 1]"})
    prefill_load_scale: float = field(default=1.0, metadata={"help": "scale of the prefill term, >= 0"})
    overlap_score_credit_decay: float = field(
        default=0.0, metadata={"help": "decay of the overlap credit on prefill-loaded workers, >= 0"}
    )
    decode_active_request_weight: float = field(default=0.0, metadata={"help": "blocks charged per active request, >= 0"})
    router_temperature: float = field(default=0.0, metadata={"help": "softmax sampling temperature (0 = argmin)"})
    track_prefill_tokens: bool = field(default=True, metadata={"help": "count active prefill tokens in the cost"})
    assume_kv_reuse: bool = field(default=True, metadata={"help": "count a block shared by active requests once"})

    def validate(self) -> None:
        if not 0.0 <= self.overlap_score_credit <= 1.0:
            raise ValueError(f"overlap_score_credit must be in [0, 1], got {self.overlap_score_credit}")
        for name in ("prefill_load_scale", "overlap_score_credit_decay", "decode_active_request_weight",
                     "router_temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class _Active:
    worker_id: str
    keys: tuple[int, ...]


@dataclass(slots=True)
class DynamoCost:
    """One worker's cost and its terms."""

    worker: Worker
    raw_prefill_blocks: float
    prefill_cost: float
    decode_cost: float
    request_cost: float

    @property
    def cost(self) -> float:
        return self.prefill_cost + self.decode_cost + self.request_cost


class DynamoPolicy(RoutingPolicyBase):
    params: DynamoParams

    def __init__(self, params: DynamoParams, rng: object) -> None:
        super().__init__(params, rng)  # type: ignore[arg-type]
        #: per worker, the prompt blocks of its active requests with their reference counts
        self._blocks: dict[str, Counter[int]] = {}
        #: per worker, the active prompt blocks counted without reuse (assume_kv_reuse off)
        self._plain: dict[str, int] = {}
        self._inflight: OrderedDict[str, _Active] = OrderedDict()

    def active_blocks(self, worker_id: str) -> int:
        """Blocks the worker's active requests hold, as Dynamo counts them."""
        if self.params.assume_kv_reuse:
            return len(self._blocks.get(worker_id, ()))
        return self._plain.get(worker_id, 0)

    def _new_blocks(self, worker_id: str, keys: Sequence[int]) -> int:
        if not self.params.assume_kv_reuse:
            return len(keys)
        active = self._blocks.get(worker_id)
        if not active:
            return len(keys)
        return sum(1 for k in keys if k not in active)

    def costs(self, ctx: RoutingContext) -> list[DynamoCost]:
        """The cost of every candidate, without changing state."""
        p = self.params
        bs = ctx.block_size
        keys = ctx.request.keys
        request_blocks = max(1, -(-ctx.prompt_tokens // bs))
        pending = [w.pending_prefill_tokens if p.track_prefill_tokens else 0 for w in ctx.candidates]
        floor = min(pending)
        out = []
        for w, active_prefill in zip(ctx.candidates, pending):
            raw = (active_prefill + ctx.prompt_tokens) / bs if p.track_prefill_tokens else 0.0
            decay = 1.0
            if p.overlap_score_credit_decay > 0 and p.track_prefill_tokens:
                excess = (active_prefill - floor) / bs / request_blocks
                decay = 1.0 / (1.0 + p.overlap_score_credit_decay * excess)
            credit = p.overlap_score_credit * decay * ctx.overlap(w)
            prefill = p.prefill_load_scale * max(0.0, raw - credit)
            decode = float(self.active_blocks(w.id) + self._new_blocks(w.id, keys))
            out.append(DynamoCost(w, raw, prefill, decode, p.decode_active_request_weight * w.inflight_requests))
        return out

    def _pick(self, rows: list[DynamoCost]) -> tuple[DynamoCost, str]:
        costs = [r.cost for r in rows]
        lo, hi = min(costs), max(costs)
        temperature = self.params.router_temperature
        if temperature > 0:
            if hi == lo:
                return rows[self.rng.randrange(len(rows))], "softmax_sample"
            weights = [math.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
            return self.rng.choices(rows, weights=weights)[0], "softmax_sample"
        best = [r for r in rows if r.cost == lo]
        return (best[self.rng.randrange(len(best))] if len(best) > 1 else best[0]), "min_cost"

    def select(self, ctx: RoutingContext) -> Decision:
        rows = self.costs(ctx)
        pick, reason = self._pick(rows)
        scored = []
        if ctx.explain:
            scored = [ctx.candidate(r.worker, -r.cost, cost=round(r.cost, 3), prefill_blocks=round(r.prefill_cost, 3),
                                    decode_blocks=r.decode_cost, raw_prefill_blocks=round(r.raw_prefill_blocks, 3))
                      for r in rows]
        return self.decide(ctx, pick.worker, reason, scored, cost=round(pick.cost, 3),
                           prefill_blocks=round(pick.prefill_cost, 3), decode_blocks=pick.decode_cost)

    # ---- the active-sequence ledger (Dynamo's ActiveSequences, per worker) ---------------
    def on_dispatch(self, decision: Decision, ctx: RoutingContext) -> None:
        rid = ctx.request.request_id
        if not rid:
            return
        keys = tuple(ctx.request.keys)
        wid = decision.worker_id
        self._blocks.setdefault(wid, Counter()).update(keys)
        self._plain[wid] = self._plain.get(wid, 0) + len(keys)
        self._inflight[rid] = _Active(wid, keys)
        if len(self._inflight) > _MAX_TRACKED:
            self._release(self._inflight.popitem(last=False)[1])

    def _release(self, entry: _Active) -> None:
        blocks = self._blocks.get(entry.worker_id)
        if blocks is None:
            return
        blocks.subtract(entry.keys)
        for k in entry.keys:
            if blocks.get(k, 0) <= 0:
                blocks.pop(k, None)
        self._plain[entry.worker_id] = max(0, self._plain.get(entry.worker_id, 0) - len(entry.keys))

    def on_complete(self, worker: Worker | None, request: RouteRequest | None, completion: Completion, now: float) -> None:
        entry = self._inflight.pop(completion.request_id, None)
        if entry is not None:
            self._release(entry)

    def on_worker_removed(self, worker: Worker) -> None:
        self._blocks.pop(worker.id, None)
        self._plain.pop(worker.id, None)
