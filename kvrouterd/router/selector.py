"""Deciding: a request checked whole, the eligible workers it may go to, their cached prefixes, and the policy's choice.

The eligible workers are those not draining, then those serving the request's model pool,
then the caller's ``candidate_workers``, then, for a LoRA request, the best tiers of adapter
residency (``pools``: these filters run before the policy, so every policy benefits). When
they form a prefill/decode pool, ``disagg`` decides the decode hop and, if it pays, the
prefill hop, with the same policy.

``candidate_workers`` none of which is registered is the caller's mistake, NOT_FOUND naming
them, as a model no worker serves is (``pools``): a typo must not look like an outage, which
clients fail open on. Known candidates that are all ineligible (draining, or outside the
model's pool), or a fleet with no worker registered yet, are UNAVAILABLE. Unknown ids beside a known one are passed over: a caller's
list may lag a worker that just left, and the request still goes where the caller allowed.

One walk of the index (``RadixIndex.match``) gives every candidate's cached prefix; the
routing policy the request names picks from them (``RoutingPolicy.select``, side-effect free)
and returns a ``Decision`` with each term of its cost; the load ledger commits it afterwards
(``LoadLedger.commit``). Dynamo's kv-router keeps its selector apart from its indexer and its
active-sequence tracker the same way. A request that fails a check raises before anything
changes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from ..bounds import MAX_OUTPUT_TOKENS, check_range
from ..errors import InvalidRequest, NoEligibleWorker, NotFound, Overloaded, quote
from ..index import native
from ..index.keys import ROOT_SEED, chain_keys_array, key_namespace, namespace_seed, tokens_to_bytes
from ..index.workers import MAX_WORKERS, ListScans, Worker, named_among, routing_mask
from ..policies.base import NONE_CLAIMED, RoutingContext, RoutingPolicy, fill_routing_context
from ..protocols import Decision, RouteRequest
from .disagg import PREFILL_HOP_PREFIX, Disaggregation
from .ledger import LoadLedger
from .pools import Pools, placement
from .shared import Shared
from .speculative import SpeculativeBlocks

__all__ = ["MAX_TTFT_SLO_MS", "Selector"]

#: largest TTFT objective a request may set, ms (a day; inf, NaN and 1e308 overflowed policies' maths)
MAX_TTFT_SLO_MS = 86_400_000.0

#: ``Selector._validate_py``'s checks in one native call where the extension is built
_route_checked = None if native.module is None else native.module.route_checked
if native.module is not None:
    native.module.route_check_constants(MAX_TTFT_SLO_MS, MAX_OUTPUT_TOKENS, MAX_WORKERS, PREFILL_HOP_PREFIX)


class Selector:
    """Validates requests and asks the policy; keeps the eligible workers, sorted by slot with
    their routing mask, until the registry's generation changes."""

    def __init__(self, shared: Shared, ledger: LoadLedger, pools: Pools, disagg: Disaggregation,
                 speculative: SpeculativeBlocks) -> None:
        self._shared = shared
        self._ledger = ledger
        self._pools = pools
        self._disagg = disagg
        self._speculative = speculative
        self._candidates_gen = -1
        self._candidates: list[Worker] = []
        self._candidates_mask = 0
        #: their slots as a native CandidateSlots (None in pure Python), for the candidate scan
        self._candidate_slots: object = None
        #: ``Disaggregation.active()`` for this membership: read with the eligible workers
        self._pd_active = False
        #: the masks and native slots of the eligible workers and of the lists a model's pool or
        #: an adapter narrows them to (``Pools`` keeps each per membership)
        self._scans = ListScans()

    def keys_for_tokens(self, tokens: bytes | Sequence[int], model: str = "", lora: str = "", salt: str = "") -> array:
        """Block keys of a prompt given as token ids (a sequence or little-endian uint32 bytes),
        as an ``array('Q')`` (see ``index.keys.chain_keys_array``)."""
        data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
        if model and not lora:  # an adapter named in ``model``: keyed as its engine stores it
            model, lora = key_namespace(model, lora, self._pools.adapter_bases())
        # most prompts are unsalted: their seed without a call per prompt
        seed = namespace_seed(model, lora, salt) if model or lora or salt else ROOT_SEED
        return chain_keys_array(data, self._shared.block_size, seed)

    def _eligible(self) -> tuple[list[Worker], int]:
        workers = self._shared.workers
        if self._candidates_gen != workers.generation:
            self._candidates = sorted((w for w in workers if w.eligible), key=lambda w: w.slot)
            self._candidates_mask, self._candidate_slots = self._scans.of(self._candidates, workers.generation)
            self._pd_active = self._disagg.active()
            self._candidates_gen = workers.generation
        return self._candidates, self._candidates_mask

    def validate_request(self, req: RouteRequest) -> None:
        """The request's own checks (``_validate_py``; natively ``route_checked`` passes what they
        pass), then the ledger's."""
        s = self._shared.settings
        if _route_checked is None or not _route_checked(req, s.max_prompt_tokens, self._shared.block_size,
                                                         s.max_id_length):
            self._validate_py(req)
        self._ledger.check_admissible(req)

    def _validate_py(self, req: RouteRequest) -> None:
        """The request's own checks, in order: the first that fails raises. The reference of
        the native ``route_checked`` (``index/_native.c``)."""
        s = self._shared.settings
        block_size = self._shared.block_size
        if req.prompt_tokens <= 0:
            raise InvalidRequest("the prompt is empty: send token_ids or block_keys")
        if req.prompt_tokens > s.max_prompt_tokens:
            raise Overloaded(
                f"prompt of {req.prompt_tokens} tokens exceeds max_prompt_tokens={s.max_prompt_tokens}"
            )
        if len(req.keys) > req.prompt_tokens // block_size:
            raise InvalidRequest(
                f"{len(req.keys)} block keys but prompt_tokens={req.prompt_tokens} holds at most "
                f"{req.prompt_tokens // block_size} blocks of {block_size}"
            )
        if not 0 <= req.ttft_slo_ms <= MAX_TTFT_SLO_MS:  # also NaN: every policy sees a sane number
            raise InvalidRequest(f"ttft_slo_ms must be in [0, {MAX_TTFT_SLO_MS:.0f}] (0 = default), got {req.ttft_slo_ms}")
        if not 0 <= req.expected_output_tokens <= MAX_OUTPUT_TOKENS:  # the message is check_range's
            check_range("expected_output_tokens", req.expected_output_tokens, 0, MAX_OUTPUT_TOKENS)
        if req.request_id.startswith(PREFILL_HOP_PREFIX[0]):  # the ledger's prefill-hop ids start so
            raise InvalidRequest(f"request_id {quote(req.request_id)} must not start with a NUL character")
        limit = s.max_id_length
        if (len(req.request_id) > limit or len(req.session_id) > limit or len(req.model) > limit
                or len(req.policy) > limit or len(req.lora) > limit):
            for name in ("request_id", "session_id", "model", "lora", "policy"):
                value = getattr(req, name)
                if len(value) > limit:
                    raise InvalidRequest(f"{name} {quote(value)} is longer than limits.max_id_length={limit}")
        if req.candidate_workers:
            if len(req.candidate_workers) > MAX_WORKERS:
                raise InvalidRequest(f"{len(req.candidate_workers)} candidate_workers; at most {MAX_WORKERS} workers exist")
            if max(map(len, req.candidate_workers)) > limit:
                for c in req.candidate_workers:
                    if len(c) > limit:
                        raise InvalidRequest(f"candidate worker {quote(c)} is longer than limits.max_id_length={limit}")

    def _check_some_known(self, candidate_workers: Sequence[str]) -> None:
        workers = self._shared.workers
        # an empty fleet (a router just started or restarted) knows no id yet: UNAVAILABLE
        # below, as for an unknown model (``Pools``), so clients fail open until workers register
        if len(workers) and not any(workers.find(c) is not None for c in candidate_workers):
            raise NotFound(f"candidate_workers names no registered worker: {_shown(candidate_workers)}")

    def decide(self, req: RouteRequest, now: float, explain: bool = True,
               validated: bool = False) -> tuple[Decision, RoutingContext, RoutingPolicy]:
        """Select a worker without committing anything (used by ``Router.route`` and dry runs).

        ``now``: the decision's time, as the router read it to expire speculative blocks (one
        reading of the clock per decision). ``explain=False`` lets policies skip listing every
        candidate (see RoutingContext.explain). ``validated``: as ``Router.decide``'s.
        """
        shared = self._shared
        if not validated:
            self.validate_request(req)
        policy = shared.policies.routing_policy(req.policy)
        candidates, mask = self._eligible()
        if req.candidate_workers or req.model or req.lora or not candidates:
            candidates, mask, pool_prefill, pool, adapter = self._narrow(req)
        else:  # most requests: no filter narrows the eligible workers (``_narrow`` hands them back)
            pool_prefill, pool, adapter = candidates, "", ""
        # candidate_workers that name no prefill worker bound the decode hop alone (admission
        # queues pin the decode worker a request waited for); the pool's prefill workers remain.
        # Whether any worker prefills was read with the eligible workers, at this membership
        hops = self._disagg.split(candidates, pool_prefill) if self._pd_active else None
        if hops is not None:
            decision, ctx = self._disagg.decide(req, policy, hops[0], hops[1], explain)
        else:
            match = shared.index.match(req.keys, mask)
            claimed = self._speculative.claimed(candidates, req.keys, match.overlaps) if self._speculative.live else None
            # the candidates' slots, read once per membership: the eligible workers, or a list
            # a pool or an adapter narrowed them to; a list of named candidates is the Route's
            # own, its slots read for it alone (~7 ns a worker), or the scans and the native
            # passes that take them read each Worker instead, or decline (a reroute past
            # capacity names every worker that meets the SLO: hundreds at 1,024)
            if candidates is self._candidates:
                slots = self._candidate_slots
            elif req.candidate_workers:
                slots = native.module.CandidateSlots(candidates) if native.module is not None else None
            else:
                slots = self._scans.of(candidates, shared.workers.generation)[1]
            if fill_routing_context is None:
                ctx = RoutingContext(req, candidates, match, shared.block_size, now, shared.index, explain, claimed,
                                     slots)
            else:  # the same context, without __init__ (policies.base.fill_routing_context)
                ctx = fill_routing_context(req, candidates, match, shared.block_size, now, shared.index, explain, slots,
                                           claimed or NONE_CLAIMED, match.overlaps)
            decision = policy.select(ctx)
        decision.pool = pool
        decision.candidate_count = len(ctx.candidates)
        if adapter:
            decision.lora_placement = placement(shared.workers.get(decision.worker_id), adapter)
        return decision, ctx, policy

    def destinations(self, req: RouteRequest) -> tuple[list[Worker], str]:
        """``(workers, pool)``: where a request without a prompt may go (ext_proc's GETs and
        bodies it does not read), by the filters ``decide`` applies before its policy: the
        model's pool, ``candidate_workers``, the adapter's residency tiers, and of a P/D pool
        the decode-capable workers (the destination; the caller adds no prefill hop). Raises
        as ``decide`` does: ``UnknownModel`` for a model no worker serves."""
        limit = self._shared.settings.max_id_length
        for name in ("model", "lora"):
            value = getattr(req, name)
            if len(value) > limit:
                raise InvalidRequest(f"{name} {quote(value)} is longer than limits.max_id_length={limit}")
        candidates, _, pool_prefill, pool, _ = self._narrow(req)
        hops = self._disagg.split(candidates, pool_prefill) if self._disagg.active() else None
        return (hops[1] if hops is not None else candidates), pool

    def _narrow(self, req: RouteRequest) -> tuple[list[Worker], int, list[Worker], str, str]:
        """``(candidates, mask, pool_prefill, pool, adapter)``: the eligible workers the
        request may use, their routing mask, its model pool before ``candidate_workers`` (where
        a P/D pool's prefill workers come from), the pool's name and the adapter asked for."""
        if req.candidate_workers:
            self._check_some_known(req.candidate_workers)
        candidates, mask = self._eligible()
        candidates, mask, pool, adapter = self._pools.restrict(req, candidates, mask)
        pool_prefill = candidates
        if req.candidate_workers:
            named = req.candidate_workers
            if len(named) * 8 < len(candidates):
                # a few names in a big pool: each looked up, not every worker of the pool
                # compared with them (8 names took 34 us of a decision at 1,024 workers)
                find = self._shared.workers.find
                picked: dict[int, Worker] = {}
                for c in named:
                    w = find(c)
                    if w is not None and mask >> w.slot & 1:  # one of ``candidates``: their bits are ``mask``
                        picked[w.slot] = w
                candidates = [picked[slot] for slot in sorted(picked)]  # slot order, as policies see candidates
                mask = routing_mask(candidates)
            else:
                candidates, mask = named_among(candidates, set(named))
        if not candidates:
            if req.candidate_workers:
                serving = f" and serves model {quote(req.model)}" if pool else ""
                unknown = [c for c in req.candidate_workers if self._shared.workers.find(c) is None]
                unregistered = f" ({_shown(unknown)} not registered)" if unknown else ""
                raise NoEligibleWorker(f"none of the requested workers ({_shown(req.candidate_workers)}) is eligible"
                                       f"{serving}{unregistered}")
            raise NoEligibleWorker("no eligible worker is registered")
        if adapter:
            candidates, mask = self._pools.lora_stage(adapter, candidates, mask)
        return candidates, mask, pool_prefill, pool, adapter


def _shown(ids: Sequence[str]) -> str:
    """Up to 8 client-sent ids, each quoted (an id may be up to limits.max_id_length long)."""
    return ", ".join(quote(c) for c in ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
