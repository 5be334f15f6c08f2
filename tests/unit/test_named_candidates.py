"""A Route's ``candidate_workers`` narrow its candidates to the eligible workers of its pool it
names, in slot order, whether it names a few (each looked up) or many (the pool filtered):
checked against that rule over random fleets and random lists of names."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import RouteRequest
from kvrouterd.router import Router, RouterSettings

BS = 4
FLEET = 48


@settings(max_examples=150, deadline=None)
@given(models=st.lists(st.sampled_from(("", "m", "n")), min_size=FLEET, max_size=FLEET),
       draining=st.sets(st.integers(0, FLEET - 1), max_size=12),
       removed=st.sets(st.integers(0, FLEET - 1), max_size=6),
       named=st.lists(st.one_of(st.integers(0, FLEET - 1).map(lambda i: f"w{i}"), st.sampled_from(("ghost", "w99"))),
                      min_size=1, max_size=70),
       model=st.sampled_from(("", "m", "n")))
def test_named_candidates_are_the_eligible_pool_workers_named_in_slot_order(
        models: list[str], draining: set[int], removed: set[int], named: list[str], model: str) -> None:
    r = Router(RouterSettings(block_size=BS), ManualClock())
    for i, served in enumerate(models):
        r.add_worker(WorkerSpec(id=f"w{i}", address=f"w{i}:1", models=(served,) if served else ()))
    for i in removed:
        r.remove_worker(f"w{i}")
    for i in draining - removed:
        r.set_draining(f"w{i}", True)
    if removed:  # a new worker takes the lowest free slot: slot order is not id order
        r.add_worker(WorkerSpec(id="late", address="late:1"))
        named.append("late")
    req = RouteRequest("probe", block_keys(list(range(2 * BS)), BS, model), 2 * BS, model=model,
                       candidate_workers=tuple(named))
    wanted = set(named)
    expected = [w.id for w in sorted(r.workers, key=lambda w: w.slot)
                if w.eligible and w.id in wanted and (not model or not w.spec.models or model in w.spec.models)]
    try:
        _, ctx, _ = r.decide(req, explain=False)
    except KVRouterError:
        assert not expected
        return
    assert [w.id for w in ctx.candidates] == expected
