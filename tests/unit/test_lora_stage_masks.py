"""The pool filter and LoRA stage keep their masks (who holds an adapter, who is full, who serves
it by spec) in step with every residency change, so their candidates are exactly what the
per-worker rules of ``kvrouterd.router.pools``' docstring give: checked here against those
rules, written out worker by worker, over random fleets and random histories."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import Worker, WorkerSpec
from kvrouterd.protocols import Completion, RouteRequest
from kvrouterd.router import Router, RouterSettings
from kvrouterd.router.pools import FREE_SLOT, LOADED, placement

BS = 4
MODELS = ("m", "n")
ADAPTERS = ("a", "b", "c", "d")


def _serves(w: Worker, model: str, adapter: str) -> bool:
    """The pool filter's rules for one worker (pools' module docstring, item 1)."""
    spec = w.spec
    if model and spec.models and model not in spec.models:
        return False
    if not adapter:
        return True
    if adapter in spec.loras or adapter in w.loras:
        return True
    return not spec.loras and (bool(model) or not spec.models)


def expected_candidates(r: Router, model: str, adapter: str, cost: float) -> list[str]:
    """The candidates worker by worker: the pool, then the best residency tier whole and the
    lower tiers' workers whose load plus the load cost beats its least load (item 2)."""
    eligible = sorted((w for w in r.workers if w.eligible), key=lambda w: w.slot)
    declared = {m for w in r.workers for m in w.spec.models}
    pool = [w for w in eligible if _serves(w, model if declared else "", adapter)]
    if not adapter or not pool:
        return [w.id for w in pool]
    tiers: list[list[Worker]] = [[], [], []]
    for w in pool:
        p = placement(w, adapter)
        tiers[0 if p == LOADED else 1 if p == FREE_SLOT else 2].append(w)
    best = next(i for i, t in enumerate(tiers) if t)

    def load(w: Worker) -> int:
        return w.inflight_requests + w.queued_requests

    floor = min(load(w) for w in tiers[best]) + best * cost
    kept = [w for i, t in enumerate(tiers) for w in t if i == best or (i > best and load(w) + i * cost < floor)]
    return [w.id for w in sorted(kept, key=lambda w: w.slot)]


specs = st.builds(
    lambda models, loras, max_loras: (models, loras, max_loras),
    st.lists(st.sampled_from(MODELS), max_size=2, unique=True).map(tuple),
    st.lists(st.sampled_from(ADAPTERS), max_size=3, unique=True).map(tuple),
    st.integers(0, 2),
)

# a history: reports of loaded adapters, routes (which load an adapter and add load), completes,
# queued requests, re-registrations, drains, removals and new workers
steps = st.one_of(
    st.tuples(st.just("report"), st.integers(0, 11), st.lists(st.sampled_from(ADAPTERS), max_size=3)),
    st.tuples(st.just("adopt"), st.integers(0, 11), st.lists(st.sampled_from(ADAPTERS), max_size=3)),
    st.tuples(st.just("route"), st.sampled_from(("", *MODELS)), st.sampled_from(("", *ADAPTERS))),
    st.tuples(st.just("complete"), st.integers(0, 50)),
    st.tuples(st.just("queue"), st.integers(0, 11), st.integers(0, 3)),
    st.tuples(st.just("reregister"), st.integers(0, 11), specs),
    st.tuples(st.just("resize"), st.integers(0, 11), st.integers(0, 2)),
    st.tuples(st.just("drain"), st.integers(0, 11), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 11)),
    st.tuples(st.just("add"), specs),
)


@settings(max_examples=200, deadline=None)
@given(fleet=st.lists(specs, min_size=1, max_size=10), history=st.lists(steps, max_size=40),
       cost=st.sampled_from((0.0, 0.5, 1.0, 2.0)))
def test_the_masked_stages_give_the_per_worker_rules_candidates(
        fleet: list[tuple[tuple[str, ...], tuple[str, ...], int]], history: list[tuple], cost: float) -> None:
    r = Router(RouterSettings(block_size=BS, lora_load_cost=cost), ManualClock())
    added = 0

    def add(models: tuple[str, ...], loras: tuple[str, ...], max_loras: int, wid: str | None = None) -> None:
        nonlocal added
        if wid is None:
            wid, added = f"w{added}", added + 1
        r.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", models=models, loras=loras, max_loras=max_loras))

    for models, loras, max_loras in fleet:
        add(models, loras, max_loras)
    routed: list[str] = []

    def worker(n: int) -> Worker | None:
        ws = sorted(r.workers, key=lambda w: w.id)
        return ws[n % len(ws)] if ws else None

    def check() -> None:
        for model in ("", *MODELS):
            for adapter in ("", *ADAPTERS):
                request = RouteRequest("probe", block_keys(list(range(2 * BS)), BS, model, adapter), 2 * BS,
                                       model=model, lora=adapter)
                try:
                    _, ctx, _ = r.decide(request, explain=False)
                    got = [w.id for w in ctx.candidates]
                except KVRouterError:
                    got = []
                assert got == expected_candidates(r, model, adapter, cost), (model, adapter)

    for n, step in enumerate(history):
        kind, w = step[0], worker(step[1]) if isinstance(step[1], int) else None
        if kind == "report" and w is not None:
            r.report_load(w.id, 0, 0, 0.0, loaded_loras=step[2])
        elif kind == "adopt" and w is not None:
            r.adopt_loras(w.id, step[2])
        elif kind == "route":
            request = RouteRequest(f"r{n}", block_keys(list(range(n * 100, n * 100 + 2 * BS)), BS, step[1], step[2]),
                                   2 * BS, model=step[1], lora=step[2])
            try:
                routed.append(r.route(request).request.request_id)
            except KVRouterError:
                pass
        elif kind == "complete" and routed:
            rid = routed.pop(step[1] % len(routed))
            if r.workers.inflight(rid) is not None:
                r.complete(Completion(request_id=rid))
        elif kind == "queue" and w is not None:
            r.note_admission_queue(w.id, step[2], step[2] * BS)
        elif kind == "reregister" and w is not None:
            add(*step[2], wid=w.id)
        elif kind == "resize" and w is not None:  # only its max_loras changes
            add(w.spec.models, w.spec.loras, step[2], wid=w.id)
        elif kind == "drain" and w is not None:
            r.set_draining(w.id, step[2])
        elif kind == "remove" and w is not None and len(r.workers) > 1:
            r.remove_worker(w.id)
        elif kind == "add":
            add(*step[1])
        check()
    check()


def test_a_worker_re_registered_with_more_adapter_slots_is_no_longer_full() -> None:
    r = Router(RouterSettings(block_size=BS, lora_load_cost=2.0), ManualClock())
    for wid, held in (("x", "a"), ("y", "b")):
        r.add_worker(WorkerSpec(id=wid, address=f"{wid}:1", max_loras=1))
        r.report_load(wid, 0, 0, 0.0, loaded_loras=[held])
    probe = RouteRequest("probe", block_keys(list(range(2 * BS)), BS, "", "c"), 2 * BS, lora="c")
    assert [w.id for w in r.decide(probe, explain=False)[1].candidates] == ["x", "y"]  # both would swap
    r.add_worker(WorkerSpec(id="x", address="x:1", max_loras=2))  # a second slot: "c" loads beside "a"
    assert [w.id for w in r.decide(probe, explain=False)[1].candidates] == ["x"]
