"""least_loaded's choice in one native pass (``least_loaded_pick``) against its reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.policies._scan import least_loaded_index, least_loaded_index_py
from kvrouterd.protocols import CacheMode, RouteRequest
from kvrouterd.router import Router, RouterSettings

BS = 16


def _fleet(size: int) -> tuple[Router, RouteRequest]:
    router = Router(RouterSettings(block_size=BS, routing={"name": "least_loaded"}), ManualClock(), random.Random(0))
    for i in range(size):
        router.add_worker(WorkerSpec(f"w{i}", f"w{i}:1", mode=CacheMode.EVENTS))
    return router, RouteRequest("", router.keys_for_tokens(list(range(2 * BS))), 2 * BS)


@pytest.mark.skipif(native.module is None, reason=native.status)
@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 40), data=st.data())
def test_the_native_pick_is_the_reference_over_any_loads(size, data):
    router, req = _fleet(size)
    small = st.integers(0, 3)  # few values: ties on every key, down to the slot
    for w in router.workers:
        w.pending_prefill_tokens = data.draw(small)
        w.inflight_requests = data.draw(small)
        w.reported_queue = data.draw(small | st.integers(-(2**63), 2**63 - 1))
    removed = data.draw(st.integers(0, size - 1)) if size > 2 and data.draw(st.booleans()) else None
    if removed is not None:  # a freed slot, then a worker that takes it: slots out of registration order
        router.remove_worker(f"w{removed}")
        router.add_worker(WorkerSpec("late", "late:1", mode=CacheMode.EVENTS))
    _, ctx, _ = router.decide(req, explain=False)
    expected = least_loaded_index_py(ctx.candidates)
    assert native.module.least_loaded_pick(ctx.candidates, ctx.candidate_slots) == expected
    assert least_loaded_index(ctx.candidates, ctx.candidate_slots) == expected
    assert router.decide(req, explain=False)[0].worker_id == ctx.candidates[expected].id


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_the_native_pick_declines_what_it_cannot_read_exactly():
    router, req = _fleet(4)
    _, ctx, _ = router.decide(req, explain=False)
    pick = native.module.least_loaded_pick
    candidates, slots = ctx.candidates, ctx.candidate_slots
    assert pick(candidates, slots) == 0  # all idle: the lowest slot
    twice = [candidates[1], candidates[1]]  # equal in every key, slot included: the first of equals
    assert pick(twice, native.module.CandidateSlots(twice)) == least_loaded_index_py(twice) == 0
    candidates[0].pending_prefill_tokens = 5
    candidates[1].reported_queue = 2
    assert pick(candidates, slots) == 2  # w0 has prefill pending, w1 a queue
    candidates[2].reported_queue = 2**64  # an int past 64 bits: the reference compares it
    assert pick(candidates, slots) is NotImplemented
    assert least_loaded_index(candidates, slots) == least_loaded_index_py(candidates) == 3
    candidates[2].reported_queue = True  # not an exact int
    assert pick(candidates, slots) is NotImplemented
    assert pick(candidates, None) is NotImplemented and pick(candidates[:3], slots) is NotImplemented
    with pytest.raises(TypeError):
        pick(candidates)
