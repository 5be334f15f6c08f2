"""A RouteStream batch answer made as wire bytes is the message upb would have written.

``stream_answers`` writes each batch item as bytes, a Route's natively (``route_answer`` in
``index/_native.c``) where the result has the common shape; a gateway parses them with the
generated classes, so every answer must be, byte for byte, what serialising the message the
handler used to build gives (``_route_answer_py``: ``convert.route_response`` into a
``RouteStreamResponse``). Over random results (ids and names empty, long and non-ASCII, counts
at the uint32 edges, TTFTs zero, negative zero, NaN, infinite, alternatives and prefill/decode
hops present or not) the two give the same bytes, or raise the same error.
"""

from __future__ import annotations

import math
import random
from array import array
from typing import Any

import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.index import native
from kvrouterd.index.workers import Worker, WorkerSpec
from kvrouterd.protocols import Decision, PrefillHop, RouteRequest
from kvrouterd.router import RouteResult
from kvrouterd.server import stream_answers
from kvrouterd.server.convert import route_response
from kvrouterd.server.stream_answers import (
    _complete_answer_py,
    _route_answer_py,
    batch_answer,
    complete_answer,
    message_answer,
    route_answer,
)

NAMES = ("", "w", "worker-17", "ünïcödé-wörker", "x" * 300, "10.0.0.1:8000", "[::1]:9000")
COUNTS = (0, 1, 127, 128, 16_383, 16_384, 2**32 - 1, 2**32, 2**40)
TTFTS = (0.0, -0.0, 1.5, 120.25, 1e300, math.inf, -math.inf, math.nan, 5e-324)


def _worker(rng: random.Random, slot: int) -> Worker:
    return Worker(WorkerSpec(id=rng.choice(NAMES[1:]) + str(slot), address=rng.choice(NAMES)), slot=slot, now=0.0)


def random_result(rng: random.Random) -> tuple[RouteResult, int]:
    block_size = rng.choice((1, 16, 64, 2**20))
    overlap = rng.choice(COUNTS) if rng.random() < 0.3 else rng.randrange(0, 300)
    pd = rng.random() < 0.15
    decision = Decision(
        worker_id="w", policy=rng.choice(("cache_aware", "dualmap", "", "pölicy")),
        reason=rng.choice(("prefix_match", "no_overlap", "", "imbalanced")), candidates=[],
        overlap_blocks=overlap, estimated_ttft_ms=rng.choice(TTFTS),
        prefill=PrefillHop("p", rng.randrange(0, 50), rng.choice(COUNTS)) if pd and rng.random() < 0.8 else None,
        pd_reason=rng.choice(("remote_prefill", "local_prefill")) if pd else "",
        decode_uncached_tokens=rng.choice(COUNTS) if pd else 0,
    )
    keys: Any = array("Q", range(rng.choice((0, 1, 250, 4_096)))) if rng.random() < 0.8 else list(range(rng.randrange(9)))
    request = RouteRequest(request_id=rng.choice(NAMES), keys=keys, prompt_tokens=len(keys) * block_size)
    alternative = _worker(rng, 2) if rng.random() < 0.3 else None
    prefill = _worker(rng, 3) if pd and rng.random() < 0.8 else None
    return RouteResult(decision, _worker(rng, 1), request, alternative, prefill_worker=prefill), block_size


def _outcome(make: Any, *args: Any) -> bytes | type[BaseException]:
    try:
        return make(*args)  # type: ignore[no-any-return]
    except (ValueError, TypeError, OverflowError) as exc:
        return type(exc)


@pytest.mark.parametrize("seed", range(4))
def test_a_route_answer_is_the_bytes_upb_writes_for_it(seed: int) -> None:
    rng = random.Random(seed)
    answered = refused = 0
    for _ in range(1_500):
        result, block_size = random_result(rng)
        item_id = rng.choice((0, 1, 127, 128, 2**35, 2**64 - 1))
        expected = _outcome(_route_answer_py, item_id, result, block_size)
        assert _outcome(route_answer, item_id, result, block_size) == expected
        if isinstance(expected, bytes):
            answered += 1
            reply = pb.RouteStreamResponse.FromString(batch_answer([expected]))
            assert [item.id for item in reply.batch.items] == [item_id]
            assert reply.batch.items[0].route.request_id == result.request.request_id
        else:
            refused += 1  # a count past uint32: upb refuses it, and so does the answer
    assert answered > 1_000 and refused > 50


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_the_common_route_answer_is_made_natively() -> None:
    """The default policy's answer (no prefill/decode hop) never falls back to the message path."""
    rng = random.Random(7)
    for _ in range(200):
        result, block_size = random_result(rng)
        result.decision.pd_reason = ""
        result.decision.overlap_blocks %= 300
        made = native.module.route_answer(17, result, block_size)
        assert made is not NotImplemented
        assert made == _route_answer_py(17, result, block_size)


@pytest.mark.parametrize("item_id", [0, 1, 127, 128, 300, 2**35, 2**63, 2**64 - 1])
def test_a_complete_answer_is_the_bytes_upb_writes_for_it(item_id: int) -> None:
    assert complete_answer(item_id) == _complete_answer_py(item_id)


def test_a_batch_answer_is_the_message_the_handler_used_to_build() -> None:
    rng = random.Random(3)
    expected = pb.RouteStreamResponse()
    items: list[bytes] = []
    for n in range(1, 12):
        if n % 3:
            result, block_size = random_result(rng)
            result.decision.overlap_blocks %= 300
            result.decision.pd_reason = ""
            answer = expected.batch.items.add()
            answer.id = n
            route_response(result, block_size, into=answer.route)
            items.append(route_answer(n, result, block_size))
        elif n % 2:
            expected.batch.items.add(id=n).complete.SetInParent()
            items.append(complete_answer(n))
        else:
            refused = pb.RouteStreamResponse(id=n, error=pb.StreamError(code=3, message="no"))
            expected.batch.items.add().CopyFrom(refused)
            items.append(message_answer(refused))
    assert batch_answer(items) == expected.SerializeToString()


def test_bytes_go_out_as_they_are_and_messages_serialised() -> None:
    serialize = stream_answers.passes_bytes(pb.RouteStreamResponse.SerializeToString)
    made = batch_answer([complete_answer(5)])
    assert serialize(made) is made
    message = pb.RouteStreamResponse(id=9)
    message.complete.SetInParent()
    assert serialize(message) == message.SerializeToString()
