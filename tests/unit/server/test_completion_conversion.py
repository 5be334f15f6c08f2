"""A Complete's message made a Completion: the native conversion gives the reference's answer.

``convert.completion`` builds the Completion of a Complete that passes every check (an id within
``max_id_length``, each reported number within its bound) in one native call (``completion_of``,
``index/_native.c``); anything else is ``_completion_py``'s, its reference, which raises the first
failing check's error. Over random messages at and past every bound the two answer alike.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.bounds import MAX_CACHED_TOKENS, MAX_LATENCY_MS, MAX_OUTPUT_TOKENS
from kvrouterd.errors import KVRouterError
from kvrouterd.index import native
from kvrouterd.server import convert

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

LIMIT = 20
LATENCIES = (0.0, 12.5, MAX_LATENCY_MS, -0.001, MAX_LATENCY_MS * 2, float("nan"), float("inf"), -0.0)


def random_message(rng: random.Random) -> pb.CompleteRequest:
    return pb.CompleteRequest(
        request_id=rng.choice(("r1", "", "é" * LIMIT, "x" * (LIMIT + 1))),
        ttft_ms=rng.choice(LATENCIES[:3] * 4 + LATENCIES), e2e_ms=rng.choice(LATENCIES[:3] * 4 + LATENCIES),
        prefill_ms=rng.choice(LATENCIES[:3] * 4 + LATENCIES), kv_transfer_ms=rng.choice(LATENCIES[:3] * 4 + LATENCIES),
        cached_tokens=rng.choice((-1, 0, 300, MAX_CACHED_TOKENS, -2, MAX_CACHED_TOKENS + 1)),
        output_tokens=rng.choice((0, 17, MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS + 1)),
        success=rng.random() < 0.8, session_ended=rng.random() < 0.2, prefill_done=rng.random() < 0.1,
    )


def outcome(convert_: Any, msg: pb.CompleteRequest, limit: int) -> Any:
    try:
        done = convert_(msg, limit)
    except KVRouterError as exc:
        return f"{type(exc).__name__}: {exc}"
    return done, [type(getattr(done, name)) for name in done.__slots__]


@pytest.mark.parametrize("seed", range(3))
def test_the_native_conversion_gives_the_reference_completion(seed: int, read_as: str) -> None:
    rng = random.Random(seed)
    answered = 0
    for _ in range(1_000):
        msg, limit = random_message(rng), rng.choice((LIMIT, 0))
        answered += native.module.completion_of(msg, convert._new_completion, limit,
                                                convert._COMPLETION_LIMITS) is not NotImplemented
        assert outcome(convert.completion, msg, limit) == outcome(convert._completion_py, msg, limit)
    assert answered > 100


def test_the_native_conversion_refuses_bad_arguments_and_raises_what_reading_raises() -> None:
    class Unreadable:
        """A message whose e2e time cannot be read."""

        request_id, ttft_ms = "r1", 1.0

        @property
        def e2e_ms(self) -> float:
            raise RuntimeError("e2e unreadable")

    with pytest.raises(RuntimeError, match="e2e unreadable"):
        native.module.completion_of(Unreadable(), convert._new_completion, LIMIT, convert._COMPLETION_LIMITS)
    with pytest.raises(TypeError, match="completion_of"):
        native.module.completion_of(pb.CompleteRequest(request_id="r"), convert._new_completion, LIMIT, (1.0, 2))
