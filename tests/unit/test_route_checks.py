"""A Route's own checks: the native pass says a request passes only where the reference does.

``Selector.validate_request`` checks the request itself (prompt size, SLO, output, ids, candidates)
before the ledger's checks. Where the extension is built ``route_checked`` (``index/_native.c``)
answers whether a request passes them all with fields of their exact types; anything else goes to
``Selector._validate_py``, the reference, which raises the first failing check's error. Over random
requests, valid and invalid in each way the reference knows: the native pass never passes one the
reference refuses, passes every valid request of exact types, and the answer a caller sees (the
error, or none) is the reference's.
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

from kvrouterd.bounds import MAX_OUTPUT_TOKENS
from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.index import native
from kvrouterd.index.workers import MAX_WORKERS
from kvrouterd.protocols import RouteRequest
from kvrouterd.router import Router, RouterSettings
from kvrouterd.router.selector import MAX_TTFT_SLO_MS

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

BS = 16
LIMIT = 40
MAX_PROMPT = 4_000


class StrId(str):
    """A str subclass: read by the reference only."""


def selector() -> Any:
    router = Router(RouterSettings(block_size=BS, max_prompt_tokens=MAX_PROMPT, max_id_length=LIMIT), ManualClock())
    return router._selector


def valid(rng: random.Random, n: int) -> RouteRequest:
    prompt = rng.randrange(1, MAX_PROMPT + 1)
    keys: Any = array("Q", range(rng.randrange(0, prompt // BS + 1)))
    if rng.random() < 0.3:
        keys = list(keys)
    return RouteRequest(rng.choice((f"r{n}", "", "é" * LIMIT)), keys, prompt, rng.choice(("", "s" * LIMIT)),
                        ttft_slo_ms=rng.choice((0.0, 250.0, MAX_TTFT_SLO_MS, 3)),
                        expected_output_tokens=rng.choice((0, 512, MAX_OUTPUT_TOKENS)),
                        policy=rng.choice(("", "lbgr")), model=rng.choice(("", "m" * LIMIT)),
                        lora=rng.choice(("", "ad")),
                        candidate_workers=rng.choice(((), ("w1",), tuple(f"w{i}" for i in range(9)), ("x" * LIMIT,))))


#: one way to break (or merely retype) a valid request each
MUTATIONS: list[tuple[str, Any]] = [
    ("prompt_tokens", 0), ("prompt_tokens", -3), ("prompt_tokens", MAX_PROMPT + 1), ("prompt_tokens", 2**70),
    ("prompt_tokens", 12.0), ("keys", array("Q", range(MAX_PROMPT // BS + 1))),
    ("ttft_slo_ms", -0.5), ("ttft_slo_ms", MAX_TTFT_SLO_MS * 2), ("ttft_slo_ms", float("nan")),
    ("ttft_slo_ms", float("inf")), ("ttft_slo_ms", 2**80), ("ttft_slo_ms", True),
    ("expected_output_tokens", -1), ("expected_output_tokens", MAX_OUTPUT_TOKENS + 1),
    ("expected_output_tokens", 7.0), ("request_id", "\x00prefill:r"), ("request_id", "r" * (LIMIT + 1)),
    ("request_id", StrId("r1")), ("session_id", "s" * (LIMIT + 1)), ("model", "m" * (LIMIT + 1)),
    ("policy", "p" * (LIMIT + 1)), ("lora", "l" * (LIMIT + 1)),
    ("candidate_workers", tuple(f"w{i}" for i in range(MAX_WORKERS + 1))),
    ("candidate_workers", ("w1", "w" * (LIMIT + 1))), ("candidate_workers", ["w1"]),
    ("candidate_workers", ("w1", StrId("w2"))), ("keys", range(3)),
]


def reference_error(sel: Any, req: RouteRequest) -> str | None:
    try:
        sel._validate_py(req)
    except (KVRouterError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("seed", range(3))
def test_the_native_check_passes_only_what_the_reference_passes(seed: int) -> None:
    rng, sel = random.Random(seed), selector()
    passed = refused = retyped = 0
    for n in range(2_000):
        req = valid(rng, n)
        exact = type(req.ttft_slo_ms) is float or type(req.ttft_slo_ms) is int
        if rng.random() < 0.6:
            name, value = rng.choice(MUTATIONS)
            setattr(req, name, value)
            exact = False
        checked = native.module.route_checked(req, MAX_PROMPT, BS, LIMIT)
        error = reference_error(sel, req)
        if checked:
            assert error is None, (req, error)
            passed += 1
        elif error is None:
            assert not exact, f"a valid request of exact types went to the reference: {req}"
            retyped += 1
        else:
            refused += 1
        # what a caller sees: validate_request's answer is the reference's
        try:
            sel.validate_request(req)
            seen = None
        except (KVRouterError, TypeError) as exc:
            seen = f"{type(exc).__name__}: {exc}"
        assert seen == error
    assert passed > 500 and refused > 500 and retyped > 20


def test_each_broken_field_is_refused_natively() -> None:
    rng = random.Random(9)
    for name, value in MUTATIONS:
        req = valid(rng, 0)
        setattr(req, name, value)
        assert native.module.route_checked(req, MAX_PROMPT, BS, LIMIT) is False, (name, value)


def test_the_native_check_raises_what_reading_the_request_raises() -> None:
    class Unreadable:
        """A request whose model cannot be read."""

        request_id, session_id, policy, lora, prompt_tokens, keys = "r", "", "", "", 16, [1]
        ttft_slo_ms, expected_output_tokens, candidate_workers = 0.0, 0, ()

        @property
        def model(self) -> str:
            raise RuntimeError("model unreadable")

    with pytest.raises(RuntimeError, match="model unreadable"):
        native.module.route_checked(Unreadable(), MAX_PROMPT, BS, LIMIT)
    with pytest.raises(TypeError, match="ints"):
        native.module.route_checked(valid(random.Random(1), 1), MAX_PROMPT, "16", LIMIT)
