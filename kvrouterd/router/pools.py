"""Model pools and LoRA adapters: which workers may serve a request's model, which of them to prefer for its adapter, and which adapters each has loaded.

Two stages run in the selector before the routing policy, each narrowing ``ctx.candidates``:

1. **The pool filter** keeps the workers that serve the request's model. A worker declares
   the base models it serves (``WorkerSpec.models``) and the adapters it can load
   (``WorkerSpec.loras``); one that declares no models serves any model, so fleets
   configured before pools existed route as they did. A model no registered worker serves,
   draining or not, is ``UnknownModel`` (NOT_FOUND) naming it; one whose workers are all
   draining is ``NoEligibleWorker`` (UNAVAILABLE). A ``model`` no worker declares as a base
   model but one declares or holds as an adapter, with ``lora`` empty, asks for that adapter:
   OpenAI-style bodies name the adapter in ``model`` (the Gateway API Inference Extension's
   model-server protocol requires servers to accept that).

   A worker serves adapter ``A`` when it declares ``A``, holds it loaded, or declares no
   adapters and the request names a base model it serves (an engine that loads adapters at
   run time, which the inference extension assumes of every pool member).

2. **The LoRA stage** splits the pool into three tiers, as the inference extension's
   ``lora-affinity-scorer`` scores them (loaded 1.0, free adapter slot 0.8, full 0): workers
   with ``A`` loaded, workers with a free slot (fewer than ``max_loras`` adapters loaded, or
   no limit declared), and full workers, which would have to evict an adapter. The best
   non-empty tier is kept whole; a worker of a lower tier joins it only when its load plus
   the tier's cost (``lora_load_cost`` requests for a load, twice that for a swap, which also
   costs the evicted adapter's next reload) is below the least loaded worker of the best
   tier. So an adapter's traffic stays on the workers that hold it, and spills to one more
   worker only when all of those are busier than loading it elsewhere costs; that worker
   then holds it too, and the adapter's share grows by load, not by chance. The inference
   extension's older ``loraAffinity`` filter spills by a coin (keeps the loaded group with
   probability 0.999) and AIBrix's ``lora-affinity`` router does the same; a load-triggered
   spill is deterministic, which the simulator's parity tests need, and spills exactly when
   the loaded workers are busy. Load here is the router's own: requests in flight plus those
   waiting in its admission queue for the worker.

Why stages before the policy and not a scorer inside each: every policy (cache_aware,
dynamo, lbgr, dualmap, latency, ...) benefits unchanged, each keeps the cost terms its paper
states, and the balance within the kept tier is the policy's own KV- and load-aware choice,
which is what spreads an adapter's traffic over the workers holding it. The inference
extension's scheduler is built the same way: filters narrow, then scorers pick.

**Residency** (``Worker.loras``, least recently used first) is learned from three sources:
ReportLoad's ``loaded_loras`` (the engine's own list, e.g. vLLM's ``running_lora_adapters``;
it replaces what the router believed), KV events (vLLM's ``BlockStored`` names the adapter
whose blocks it stored: a worker storing an adapter's blocks has it loaded) and the router's
own routing (an engine loads the adapter of a request it serves). Like vLLM's adapter cache
it is an LRU of ``max_loras`` entries (``MAX_TRACKED_LORAS`` when none is declared). A
replica warmed from a peer (``warm_from``) or restored from a snapshot adopts the residency
the peer or snapshot carries (``Worker.loaded_loras`` of each exported worker), so its LoRA
stage does not start blind.

**At fleet scale** both stages work on routing masks (``Worker.bit``), not worker by worker:
which workers serve an adapter by their spec is kept per membership, which hold it loaded
and which are full is kept as residency changes, and a mask's workers are listed once per
membership. So an adapter's Route costs about what a base model's does however many workers
there are; worker by worker the two stages took 0.65 ms of every adapter's Route at 1,024
workers. Only a spill (a lower tier's worker less loaded than the best tier by more than the
load cost) still looks at that tier's workers one by one, after a native scan of their
in-flight counts found one that might join.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..errors import InvalidRequest, NoEligibleWorker, UnknownModel, quote
from ..index.workers import MAX_POOL_NAMES, Worker, routing_mask
from ..policies._scan import scan_candidates
from ..protocols import EventBatch, RouteRequest, Stored
from .shared import Shared

__all__ = ["LOADED", "MAX_TRACKED_LORAS", "Pools", "placement"]

#: adapters remembered per worker that declares no ``max_loras`` (vLLM's CPU adapter cache
#: defaults to max_loras; 32 bounds what a worker's ListWorkers entry carries)
MAX_TRACKED_LORAS = 32

#: most model names whose pool the filter caches between membership changes (names come from clients),
#: and most adapters whose serving workers and masks' worker lists are cached
MAX_CACHED_POOLS = 1024

LOADED, FREE_SLOT, SWAP = "loaded", "free_slot", "swap"


def _load(w: Worker) -> int:
    return w.inflight_requests + w.queued_requests


def placement(worker: Worker, adapter: str) -> str:
    """How ``adapter`` stands on ``worker``: loaded, a free slot to load it into, or a swap."""
    if adapter in worker.loras:
        return LOADED
    limit = worker.spec.max_loras
    return FREE_SLOT if not limit or len(worker.loras) < limit else SWAP


def _serves_adapter(w: Worker, adapter: str, model_named: bool) -> bool:
    spec = w.spec
    if adapter in spec.loras or adapter in w.loras:
        return True
    return not spec.loras and (model_named or not spec.models)


class Pools:
    """The pool filter, the LoRA stage and adapter residency (see the module docstring)."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._gen = -1
        self._models: frozenset[str] = frozenset()
        self._adapters: frozenset[str] = frozenset()
        self._adapter_bases: Mapping[str, str] = {}
        self._pools: dict[str, tuple[list[Worker], int]] = {}
        #: adapter -> mask of the workers holding it loaded (``Worker.loras``), kept as residency changes
        self._holders: dict[str, int] = {}
        #: mask of the workers whose ``max_loras`` adapters are all taken (a load there is a swap)
        self._full = 0
        #: (adapter, model named) -> mask of the workers whose spec lets them serve it (``_serves_adapter``)
        self._by_spec: dict[tuple[str, bool], int] = {}
        #: mask -> its workers in slot order, per membership
        self._listed: dict[int, list[Worker]] = {}

    def _refresh(self) -> None:
        workers = self._shared.workers
        if self._gen != workers.generation:
            self._models = frozenset(m for w in workers for m in w.spec.models)
            self._adapters = frozenset(a for w in workers for a in w.spec.loras)
            bases: dict[str, set[str]] = {}
            for w in workers:
                for a in w.spec.loras:
                    if a not in self._models:
                        bases.setdefault(a, set()).update(w.spec.models)
            # a new mapping, never one changed in place: hashing threads read the one they were given
            self._adapter_bases = {a: next(iter(b)) for a, b in bases.items() if len(b) == 1}
            self._pools.clear()
            # masks are by slot, and a membership change may move slots: residency is read afresh
            self._holders = {}
            self._full = 0
            for w in workers:
                self._note_residency(w, (), w.loras)
            self._by_spec.clear()
            self._listed.clear()
            self._gen = workers.generation

    def _note_residency(self, worker: Worker, before: Iterable[str], after: Iterable[str]) -> None:
        """``worker``'s loaded adapters went from ``before`` to ``after`` (now ``worker.loras``):
        the holders' masks and the full workers' follow."""
        bit = worker.bit
        holders = self._holders
        for adapter in before:
            left = holders.get(adapter, 0) & ~bit
            if left:
                holders[adapter] = left
            else:
                holders.pop(adapter, None)
        for adapter in after:
            holders[adapter] = holders.get(adapter, 0) | bit
        limit = worker.spec.max_loras
        self._full = self._full | bit if limit and len(worker.loras) >= limit else self._full & ~bit

    def _workers_of(self, mask: int, among: list[Worker]) -> list[Worker]:
        """The workers of ``mask`` in slot order, all of them in ``among`` (a list in slot order)."""
        listed = self._listed.get(mask)
        if listed is None:
            if len(self._listed) >= MAX_CACHED_POOLS:
                self._listed.clear()
            listed = self._listed[mask] = [w for w in among if w.bit & mask]
        return listed

    def adapter_bases(self) -> Mapping[str, str]:
        """Adapter -> the one base model the workers declaring it serve: an OpenAI-style request
        naming the adapter in ``model`` is keyed under (base, adapter), as its engine stores it
        (vLLM events: the endpoint's model and the request's ``lora_name``). An adapter whose
        workers declare several base models, or none, is left out (its base is unknown), and so
        are adapters only loaded at run time (``loaded_loras``), which no membership change
        announces. Read-only: a membership change builds a new one."""
        self._refresh()
        return self._adapter_bases

    @property
    def declared_models(self) -> frozenset[str]:
        """Every base model some registered worker declares."""
        self._refresh()
        return self._models

    def wanted(self, req: RouteRequest) -> tuple[str, str]:
        """``(model, adapter)`` the request asks for: ``model`` naming an adapter, with ``lora``
        empty, asks for the adapter (see the module docstring)."""
        model, lora = req.model, req.lora
        if model and not lora:
            self._refresh()
            if model not in self._models and (model in self._adapters or model in self._holders):
                return "", model
        return model, lora

    def pool_label(self, req: RouteRequest) -> str:
        """The pool a request is counted under in metrics: its model when a worker declares it,
        else "" (the names clients send are unbounded; declared ones are not)."""
        model = req.model
        return model if model and model in self.declared_models else ""

    def restrict(self, req: RouteRequest, candidates: list[Worker], mask: int) -> tuple[list[Worker], int, str, str]:
        """``(candidates, mask, pool, adapter)``: the eligible ``candidates`` that serve the
        request's model and adapter. Raises ``UnknownModel`` when no registered worker serves
        them, ``NoEligibleWorker`` when those that do are all draining."""
        if not req.model and not req.lora:
            return candidates, mask, "", ""
        model, adapter = self.wanted(req)
        self._refresh()
        if not self._models and not adapter:
            return candidates, mask, "", ""  # nobody declares models: everyone serves every model
        pool = model if model in self._models else ""
        if model and self._models:
            candidates, mask = self._model_pool(model, candidates)
        if adapter:
            serving = mask & (self._spec_serving(adapter, bool(model)) | self._holders.get(adapter, 0))
            if serving != mask:
                candidates, mask = self._workers_of(serving, candidates), serving
        if not candidates:
            self._explain_empty(model, adapter)
        return candidates, mask, pool, adapter

    def _spec_serving(self, adapter: str, model_named: bool) -> int:
        """Mask of the workers whose spec lets them serve ``adapter`` (``_serves_adapter`` less
        what they hold loaded), per membership."""
        key = (adapter, model_named)
        mask = self._by_spec.get(key)
        if mask is None:
            mask = 0
            for w in self._shared.workers:
                spec = w.spec
                if adapter in spec.loras or (not spec.loras and (model_named or not spec.models)):
                    mask |= w.bit
            if len(self._by_spec) >= MAX_CACHED_POOLS:
                self._by_spec.clear()
            self._by_spec[key] = mask
        return mask

    def _model_pool(self, model: str, eligible: list[Worker]) -> tuple[list[Worker], int]:
        cached = self._pools.get(model)
        if cached is None:
            kept = [w for w in eligible if not w.spec.models or model in w.spec.models]
            mask = routing_mask(kept)
            if len(self._pools) >= MAX_CACHED_POOLS:
                self._pools.clear()
            cached = self._pools[model] = (kept, mask)
        return cached

    def _explain_empty(self, model: str, adapter: str) -> None:
        workers = self._shared.workers
        if not len(workers):
            return  # an empty fleet: the selector says so
        serving = [w for w in workers if (not model or not w.spec.models or model in w.spec.models)
                   and (not adapter or _serves_adapter(w, adapter, bool(model)))]
        what = " ".join(part for part in (f"model {quote(model)}" if model else "",
                                          f"LoRA adapter {quote(adapter)}" if adapter else "") if part)
        if not serving:
            known = sorted(self._models)[:8]
            raise UnknownModel(f"no registered worker serves {what}; workers serve "
                               + (", ".join(map(repr, known)) if known else "no declared models"))
        raise NoEligibleWorker(f"no eligible worker serves {what}: its {len(serving)} worker(s) are draining")

    def lora_stage(self, adapter: str, candidates: list[Worker], mask: int) -> tuple[list[Worker], int]:
        """The candidates a request for ``adapter`` keeps: the best residency tier whole, and
        workers of lower tiers whose load plus loading cost beats that tier's least load."""
        self._refresh()
        loaded = mask & self._holders.get(adapter, 0)
        if loaded == mask:
            return candidates, mask
        rest = mask & ~loaded
        tiers = (loaded, rest & ~self._full, rest & self._full)  # placement's: loaded, free slot, swap
        best = next(i for i, bits in enumerate(tiers) if bits)
        cost = self._shared.settings.lora_load_cost
        floor = min(map(_load, self._workers_of(tiers[best], candidates))) + best * cost
        kept = tiers[best]
        for i in range(best + 1, 3):
            if not tiers[i] or not i * cost < floor:  # not even an idle worker of the tier would join
                continue
            tier = self._workers_of(tiers[i], candidates)
            # the in-flight count is the load less what waits in an admission queue: when the
            # least of it does not join, no one does (the scan is native, the look at each is not)
            if not scan_candidates(tier, {}, "inflight_requests")[3] + i * cost < floor:
                continue
            for w in tier:
                if _load(w) + i * cost < floor:
                    kept |= w.bit
        return self._workers_of(kept, candidates), kept

    # ---- residency ---------------------------------------------------------------------
    def note_loaded(self, worker: Worker, adapter: str) -> None:
        """``adapter`` was used on ``worker`` just now: most recently used, evicting the least
        recently used one past the worker's ``max_loras``."""
        self._refresh()
        loras = worker.loras
        held = adapter in loras
        if held:
            del loras[adapter]
        loras[adapter] = None
        limit = worker.spec.max_loras or MAX_TRACKED_LORAS
        evicted = []
        while len(loras) > limit:
            oldest = next(iter(loras))
            del loras[oldest]
            evicted.append(oldest)
        if evicted or not held:
            self._note_residency(worker, evicted, () if held else (adapter,))

    def report(self, worker: Worker, adapters: Sequence[str]) -> None:
        """The engine's own list of loaded adapters replaces what the router believed; those it
        knew keep their recency order, new ones count as most recent."""
        reported = set(adapters)
        kept = [a for a in worker.loras if a in reported]
        kept += [a for a in dict.fromkeys(adapters) if a not in worker.loras]
        limit = worker.spec.max_loras or MAX_TRACKED_LORAS
        self._replace_residency(worker, kept[-limit:])

    def adopt(self, worker: Worker, adapters: Sequence[str]) -> None:
        """Residency another router learned (a peer's export, a snapshot; least recently used
        first) joins what this one knows as older than it: this router's own reports and
        routing, if any came first, are the newer news and stay the most recent."""
        known = worker.loras
        kept = [a for a in dict.fromkeys(adapters) if a not in known] + list(known)
        limit = worker.spec.max_loras or MAX_TRACKED_LORAS
        self._replace_residency(worker, kept[-limit:])

    def _replace_residency(self, worker: Worker, adapters: list[str]) -> None:
        """``worker`` holds ``adapters`` loaded now (least recently used first), nothing else."""
        self._refresh()
        before = worker.loras
        worker.loras = dict.fromkeys(adapters)
        self._note_residency(worker, before, worker.loras)

    def note_events(self, batch: EventBatch) -> None:
        """Adapters whose blocks an applied batch stored are loaded on its worker."""
        worker = None
        for ev in batch.events:
            if type(ev) is Stored and ev.lora:
                worker = worker or self._shared.workers.find(batch.worker_id)
                if worker is None:
                    return
                self.note_loaded(worker, ev.lora)

    def check_names(self, names: Iterable[str], what: str, limit: int) -> list[str]:
        """``names`` as a list of at most ``MAX_POOL_NAMES``, each 1 to ``limit`` characters."""
        out = list(names)
        if len(out) > MAX_POOL_NAMES:
            raise InvalidRequest(f"{what}: {len(out)} adapters, at most {MAX_POOL_NAMES}")
        for name in out:
            if not name or len(name) > limit:
                raise InvalidRequest(f"{what}: adapter name {quote(name)} must be 1 to {limit} characters")
        return out
