"""The registered workers' descriptions together stay small enough for ListWorkers and GetStats to
answer (``limits.max_message_bytes`` / 2): a registration that would pass the bound is refused
(RESOURCE_EXHAUSTED) and changes nothing, whatever was registered, re-registered and removed before."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.clock import ManualClock
from kvrouterd.errors import Overloaded
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server.status import status_code

LIMIT = 160


def described(spec: WorkerSpec) -> int:
    """What a worker's description counts: its id, address, events endpoint, labels, models and adapters."""
    return (len(spec.id) + len(spec.address) + len(spec.kv_events_endpoint)
            + sum(len(k) + len(v) for k, v in spec.labels.items()) + sum(map(len, spec.models))
            + sum(map(len, spec.loras)))


specs = st.builds(
    lambda n, host, label, models: WorkerSpec(id=f"w{n}", address=f"{host}:1", labels={"zone": label} if label else {},
                                              models=models),
    st.integers(0, 7), st.text("abcdefgh", min_size=1, max_size=40), st.text("xyz", max_size=30),
    st.lists(st.sampled_from(("llama", "qwen-long-model-name")), max_size=2, unique=True).map(tuple),
)


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(st.one_of(specs, st.integers(0, 7).map(lambda n: f"w{n}")), max_size=40))
def test_a_registration_past_the_fleets_description_bound_is_refused_and_changes_nothing(steps: list) -> None:
    r = Router(RouterSettings(block_size=4, max_workers_description_length=LIMIT), ManualClock())
    for step in steps:
        if isinstance(step, str):  # a removal
            if step in r.workers:
                r.remove_worker(step)
            continue
        others = sum(described(w.spec) for w in r.workers if w.id != step.id)
        before = {w.id: w.spec for w in r.workers}
        if others + described(step) > LIMIT:
            with pytest.raises(Overloaded, match="would total") as err:
                r.add_worker(step)
            assert status_code(err.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert {w.id: w.spec for w in r.workers} == before
        else:
            r.add_worker(step)
            assert r.workers.get(step.id).spec == step


def test_a_removed_or_re_described_worker_frees_its_share_of_the_bound() -> None:
    r = Router(RouterSettings(block_size=4, max_workers_description_length=LIMIT), ManualClock())
    big = WorkerSpec(id="a", address="a" * 100 + ":1")
    r.add_worker(big)
    with pytest.raises(Overloaded):
        r.add_worker(WorkerSpec(id="b", address="b" * 100 + ":1"))
    r.add_worker(WorkerSpec(id="a", address="a:1"))  # re-registered with a short address
    r.add_worker(WorkerSpec(id="b", address="b" * 100 + ":1"))
    r.remove_worker("b")
    r.remove_worker("a")
    r.add_worker(WorkerSpec(id="c", address="c" * 150 + ":1"))
