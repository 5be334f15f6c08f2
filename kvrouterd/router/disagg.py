"""Prefill/decode disaggregation: the two hops of a Route in a P/D pool, and whether the second is worth taking.

A **P/D pool** is a request's eligible workers (after the pool filter, ``candidate_workers``
and the LoRA stage) when some have the ``prefill`` role and some do not: the prefill workers
compute prompts' KV and send it to a ``decode`` (or ``both``) worker, which generates. One
Route then answers both hops (``Decision.prefill``):

1. **The decode hop first**: the request's routing policy picks among the decode-capable
   workers. Every policy weighs load; where decode workers publish KV events (vLLM does on
   both roles with ``--kv-events-config``) or run in approximate mode, it also weighs what
   each holds of the prompt, so a conversation's turns keep their decode worker and the
   bypass below becomes possible. llm-d's ``disagg-profile-handler`` runs its decode profile
   first too (``pkg/epp/framework/plugins/scheduling/profilehandler/disagg/
   disagg_profile_handler.go``), as Dynamo's conditional disaggregation peeks its decode
   router first (``lib/llm/src/kv_router/prefill_router/conditional_bypass.rs``).
2. **Conditional disaggregation** (``disaggregation.mode: conditional``, the default): the
   decode worker prefills locally, with no prefill hop, when
   - it would compute at most ``local_prefill_max_uncached_tokens`` prompt tokens (its
     uncached suffix; a short prompt counts the same way), reason ``decode_cached``: a KV
     transfer's fixed cost and a second queue outweigh so small a prefill. llm-d's
     ``prefix-based-pd-decider`` (``nonCachedTokens``) and Dynamo's bypass on net-new tokens
     decide on the same quantity; or
   - the prefill worker the policy would choose already has ``prefill_busy_tokens`` prompt
     tokens to compute (routed and queued in this router), reason ``prefill_saturated``, as
     Dynamo's prefill-busy threshold does: its queue would cost more than prefilling on a
     decode worker interleaved with decoding.
   Either way only while the decode worker's own prompt work (routed and queued prefill
   tokens, plus this one's) stays within ``decode_busy_tokens``: decode workers are the
   fewer, and prefills piled on one stall every request decoding there (their time between
   tokens) and then everything behind them, as the simulator showed on Mooncake. Past it the
   prefill hop is taken anyway, reason ``decode_busy``; Dynamo gates its bypass on the decode
   worker's load the same way (``decode_gate_allows_bypass`` in the file above).
3. **The prefill hop** otherwise (reason ``remote_prefill``): the policy picks among the
   prefill workers, KV-aware, since the prefix cache that saves prefill work is theirs.
   SGLang's gateway picks its pair the same way, one policy per role
   (``model_gateway/src/routers/http/pd_router.rs``, ``select_pd_pair``).

``mode: always`` takes the prefill hop whenever a prefill worker is eligible; ``never`` sends
every request to a decode worker to prefill itself (the aggregated baseline on a P/D fleet).
A pool whose prefill workers are all draining routes as an aggregated pool of its decode
workers (no ``pd_reason``).

**Speculative claims** (``speculative.ttl_s > 0``, ``router.speculative``): committing a
disaggregated decision claims the prompt's blocks on both hops' events-mode workers, as an
aggregated one claims them on its worker (``LoadLedger._record_access``): on the prefill
worker, which computes them, under the hop's in-flight id, and on the decode worker under the
request's, since it receives them by transfer and caches them (vLLM's scheduler caches a
request's blocks once its remote KV has arrived, ``_update_waiting_for_remote_kv`` in
``vllm/v1/core/sched/scheduler.py``, and publishes them as any stored block). A follow-up
arriving before either Stored finds its prefix on both: its prefill hop goes back to the
prefill worker computing it, its decode hop stays with the conversation's decode worker. Both
hops' contexts carry the claims (``RoutingContext.claimed``), which place a follow-up but
price as uncached: a decode worker whose KV is still in transfer does not look cached enough
to prefill locally, and the prefill hop is charged what its engine will compute again. A
failed request drops both claims; a prefill hop released early (``prefill_done``) keeps its
claim until its Stored confirms it or the TTL passes.

**A decode worker that publishes no events** (events mode, no batch applied yet) holds, as far
as the index knows, nothing: the cache check cannot see what it holds, so only a short prompt
is prefilled locally. Rather than fail silently (Dynamo's users met exactly that), the reason
then ends in ``+decode_cache_unknown``, ListWorkers shows the worker's ``event_batches``, and
``kvrouter.pd.decode_workers_without_events`` counts such workers.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import NoEligibleWorker
from ..index.workers import MAX_CACHED_LISTS, ListScans, Worker
from ..policies.base import RoutingContext, RoutingPolicy
from ..protocols import CacheMode, Decision, PrefillHop, RouteRequest, WorkerRole
from .shared import Shared
from .speculative import SpeculativeBlocks

__all__ = ["CACHE_UNKNOWN", "PREFILL_HOP_PREFIX", "Disaggregation", "cache_unknown", "prefill_hop_id"]

#: the suffix of a reason whose decode worker's cache could not be read
CACHE_UNKNOWN = "+decode_cache_unknown"

#: in-flight ids of prefill hops start with this (a NUL: request ids are refused that start so)
PREFILL_HOP_PREFIX = "\x00prefill:"


def prefill_hop_id(request_id: str) -> str:
    """The in-flight id the ledger charges a request's prefill hop under."""
    return PREFILL_HOP_PREFIX + request_id


def cache_unknown(worker: Worker) -> bool:
    """The router cannot know what ``worker`` caches: it is to publish events and never has."""
    return worker.mode is CacheMode.EVENTS and not worker.batches_applied


class Disaggregation:
    """Splits a P/D pool into its hops and decides them (see the module docstring)."""

    def __init__(self, shared: Shared, speculative: SpeculativeBlocks) -> None:
        self._shared = shared
        self._speculative = speculative
        self._gen = -1
        self._any_prefill = False
        #: per membership (``_cached``), by the id of the list (kept in the entry, so the id
        #: is not reused while cached): (candidates, pool, hops); and the hop lists' masks and
        #: native slots. Splitting a 1,024-worker pool and masking its hops was 0.5 ms of every Route.
        self._cache_gen = -1
        self._splits: dict[int, tuple[list[Worker], list[Worker], tuple[list[Worker], list[Worker]] | None]] = {}
        self._scans = ListScans()

    def _cached(self) -> None:
        generation = self._shared.workers.generation
        if self._cache_gen != generation:
            self._splits.clear()
            self._cache_gen = generation

    def active(self) -> bool:
        """Some registered worker has the prefill role (else nothing here runs on a Route)."""
        workers = self._shared.workers
        if self._gen != workers.generation:
            self._any_prefill = any(w.spec.role is WorkerRole.PREFILL for w in workers)
            self._gen = workers.generation
        return self._any_prefill

    def split(self, candidates: list[Worker], pool: list[Worker]) -> tuple[list[Worker], list[Worker]] | None:
        """``(prefill, decode)`` workers of a P/D pool, None when neither ``candidates`` nor,
        when those name no prefill worker, the request's whole ``pool`` (before its
        ``candidate_workers``) has one. Raises ``NoEligibleWorker`` when ``candidates`` are all
        prefill workers (none decodes)."""
        self._cached()
        hit = self._splits.get(id(candidates))
        if hit is not None and hit[0] is candidates and hit[1] is pool:
            hops = hit[2]
        else:
            prefill = [w for w in candidates if w.spec.role is WorkerRole.PREFILL]
            if not prefill and pool is not candidates:
                prefill = [w for w in pool if w.spec.role is WorkerRole.PREFILL]
            hops = (prefill, [w for w in candidates if w.spec.role is not WorkerRole.PREFILL]) if prefill else None
            if len(self._splits) >= MAX_CACHED_LISTS:
                self._splits.clear()
            self._splits[id(candidates)] = (candidates, pool, hops)
        if hops is not None and not hops[1]:
            raise NoEligibleWorker(f"no eligible decode worker: the request's {len(hops[0])} eligible worker(s) "
                                   "only prefill (role prefill)")
        return hops

    def decide(self, req: RouteRequest, policy: RoutingPolicy, prefill: list[Worker], decode: list[Worker],
               explain: bool) -> tuple[Decision, RoutingContext]:
        """The decode hop's decision and context, with ``prefill`` / ``pd_reason`` set."""
        shared = self._shared
        s = shared.settings.disaggregation
        now = shared.clock.now()
        ctx = self._context(req, decode, now, explain)
        decision = policy.select(ctx)
        worker = shared.workers.get(decision.worker_id)
        uncached = ctx.uncached_tokens(worker)
        decision.decode_uncached_tokens = uncached
        suffix = CACHE_UNKNOWN if cache_unknown(worker) else ""
        if s.mode == "never":
            decision.pd_reason = "never"
            return decision, ctx
        conditional = s.mode == "conditional"
        room = worker.pending_prefill_tokens + worker.queued_prefill_tokens + uncached <= s.decode_busy_tokens
        if conditional and uncached <= s.local_prefill_max_uncached_tokens and room:
            decision.pd_reason = "decode_cached" + suffix
            return decision, ctx
        pctx = self._context(req, prefill, now, explain)
        chosen = policy.select(pctx)
        pworker = shared.workers.get(chosen.worker_id)
        busy = pworker.pending_prefill_tokens + pworker.queued_prefill_tokens
        if conditional and s.prefill_busy_tokens and busy >= s.prefill_busy_tokens and room:
            decision.pd_reason = "prefill_saturated" + suffix
            return decision, ctx
        decision.prefill = PrefillHop(pworker.id, pctx.overlap(pworker), pctx.uncached_tokens(pworker),
                                      chosen.reason, chosen.candidates if explain else [])
        local_wanted = conditional and (uncached <= s.local_prefill_max_uncached_tokens
                                        or (s.prefill_busy_tokens and busy >= s.prefill_busy_tokens))
        decision.pd_reason = ("decode_busy" if local_wanted else "remote_prefill") + suffix
        return decision, ctx

    def hop_context(self, decision: Decision, ctx: RoutingContext) -> tuple[Worker, RoutingContext]:
        """The prefill worker and a context of it alone, under the hop's in-flight id, for the
        ledger's commit and the policy's ``on_dispatch`` (its match is walked again: cheap for
        one worker, and nothing changed since ``decide``)."""
        assert decision.prefill is not None
        shared = self._shared
        worker = shared.workers.get(decision.prefill.worker_id)
        req = replace(ctx.request, request_id=prefill_hop_id(ctx.request.request_id), candidate_workers=())
        return worker, self._context(req, [worker], ctx.now, False, worker.bit)

    def _context(self, req: RouteRequest, workers: list[Worker], now: float, explain: bool,
                 mask: int = 0) -> RoutingContext:
        shared = self._shared
        slots = None
        if not mask:  # a hop's workers (``split``): their mask and native slots, once per membership
            mask, slots = self._scans.of(workers, shared.workers.generation)
        match = shared.index.match(req.keys, mask)
        claimed = self._speculative.claimed(workers, req.keys, match.overlaps) if self._speculative.live else None
        return RoutingContext(req, workers, match, shared.block_size, now, shared.index, explain, claimed, slots)
