"""Deciding: a request checked whole, the eligible workers it may go to, their cached prefixes, and the policy's choice.

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
from ..errors import InvalidRequest, NoEligibleWorker, Overloaded, quote
from ..index.keys import chain_keys_array, namespace_seed, tokens_to_bytes
from ..index.workers import MAX_WORKERS, Worker
from ..policies.base import RoutingContext, RoutingPolicy
from ..protocols import Decision, RouteRequest
from .ledger import LoadLedger
from .shared import Shared
from .speculative import SpeculativeBlocks

__all__ = ["MAX_TTFT_SLO_MS", "Selector"]

#: largest TTFT objective a request may set, ms (a day; inf, NaN and 1e308 overflowed policies' maths)
MAX_TTFT_SLO_MS = 86_400_000.0


class Selector:
    """Validates requests and asks the policy; keeps the eligible workers, sorted by slot with
    their routing mask, until the registry's generation changes."""

    def __init__(self, shared: Shared, ledger: LoadLedger, speculative: SpeculativeBlocks) -> None:
        self._shared = shared
        self._ledger = ledger
        self._speculative = speculative
        self._candidates_gen = -1
        self._candidates: list[Worker] = []
        self._candidates_mask = 0

    def keys_for_tokens(self, tokens: bytes | Sequence[int], model: str = "", lora: str = "", salt: str = "") -> array:
        """Block keys of a prompt given as token ids (a sequence or little-endian uint32 bytes),
        as an ``array('Q')`` (see ``index.keys.chain_keys_array``)."""
        data = tokens if isinstance(tokens, bytes) else tokens_to_bytes(tokens)
        return chain_keys_array(data, self._shared.block_size, namespace_seed(model, lora, salt))

    def _eligible(self) -> tuple[list[Worker], int]:
        workers = self._shared.workers
        if self._candidates_gen != workers.generation:
            self._candidates = sorted((w for w in workers if w.eligible), key=lambda w: w.slot)
            mask = 0
            for w in self._candidates:
                mask |= w.bit
            self._candidates_mask = mask
            self._candidates_gen = workers.generation
        return self._candidates, self._candidates_mask

    def validate_request(self, req: RouteRequest) -> None:
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
        check_range("expected_output_tokens", req.expected_output_tokens, 0, MAX_OUTPUT_TOKENS)
        limit = s.max_id_length
        if (len(req.request_id) > limit or len(req.session_id) > limit or len(req.model) > limit
                or len(req.policy) > limit):
            for name in ("request_id", "session_id", "model", "policy"):
                value = getattr(req, name)
                if len(value) > limit:
                    raise InvalidRequest(f"{name} {quote(value)} is longer than limits.max_id_length={limit}")
        if req.candidate_workers:
            if len(req.candidate_workers) > MAX_WORKERS:
                raise InvalidRequest(f"{len(req.candidate_workers)} candidate_workers; at most {MAX_WORKERS} workers exist")
            for c in req.candidate_workers:
                if len(c) > limit:
                    raise InvalidRequest(f"candidate worker {quote(c)} is longer than limits.max_id_length={limit}")
        self._ledger.check_admissible(req)

    def decide(self, req: RouteRequest, explain: bool = True) -> tuple[Decision, RoutingContext, RoutingPolicy]:
        """Select a worker without committing anything (used by ``Router.route`` and dry runs).

        ``explain=False`` lets policies skip listing every candidate (see RoutingContext.explain).
        """
        shared = self._shared
        self.validate_request(req)
        policy = shared.policies.routing_policy(req.policy)
        candidates, mask = self._eligible()
        if req.candidate_workers:
            wanted = set(req.candidate_workers)
            candidates = [w for w in candidates if w.id in wanted]
            mask = 0
            for w in candidates:
                mask |= w.bit
        if not candidates:
            if req.candidate_workers:
                shown = ", ".join(map(repr, req.candidate_workers[:8])) + (", ..." if len(req.candidate_workers) > 8 else "")
                raise NoEligibleWorker(f"none of the requested workers ({shown}) is registered and eligible")
            raise NoEligibleWorker("no eligible worker is registered")
        now = shared.clock.now()
        match = shared.index.match(req.keys, mask)
        claimed = self._speculative.claimed(candidates, req.keys, match.overlaps) if self._speculative.live else None
        ctx = RoutingContext(req, candidates, match, shared.block_size, now, shared.index, explain, claimed)
        decision = policy.select(ctx)
        return decision, ctx, policy
