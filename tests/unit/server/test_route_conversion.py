"""A Route's message made a RouteRequest: the native conversion gives the reference's request.

``convert.route_request`` converts a prompt sent packed (``token_ids_le32``: the SDK's and
ext_proc's form) that passes every check in one native call (``route_request_packed``,
``index/_native.c``); everything else, and every error, is ``_route_request_py``'s, its reference.
Over random messages (every prompt form, sizes that are no multiple of 4, unknown tasks, ids past
the limit, adapters named in ``model`` with and without a known base, salts, candidates) the two
must give equal requests (keys, types and all) or the same error.
"""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.clock import ManualClock
from kvrouterd.errors import KVRouterError
from kvrouterd.index import native
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.router import Router, RouterSettings
from kvrouterd.server import convert

pytestmark = pytest.mark.skipif(native.module is None, reason=native.status)

BS = 16
LIMIT = 24
MAX_PROMPT = 3_000


def router() -> Router:
    r = Router(RouterSettings(block_size=BS, max_prompt_tokens=MAX_PROMPT, max_id_length=LIMIT), ManualClock())
    r.add_worker(WorkerSpec(id="w1", address="w1:1", models=("base-m",), loras=("ad-1", "ad-2")))
    r.add_worker(WorkerSpec(id="w2", address="w2:1", models=("other",), loras=("ad-3",)))
    return r


def random_message(rng: random.Random) -> pb.RouteRequest:
    msg = pb.RouteRequest()
    n = rng.choice((0, 1, 15, 16, 17, 64, 250, 1_000, MAX_PROMPT, MAX_PROMPT + 1))
    tokens = [rng.randrange(2**32) for _ in range(n)]
    form = rng.random()
    if form < 0.7:
        data = array("I", tokens).tobytes()
        if rng.random() < 0.05:
            data += b"\x01"  # no multiple of 4
        msg.token_ids_le32 = data
        if rng.random() < 0.04:
            msg.token_ids.extend([1, 2])  # two forms at once
        if rng.random() < 0.04:
            msg.block_keys.extend([7])
    elif form < 0.85:
        msg.token_ids.extend(tokens)
    else:
        msg.block_keys.extend(rng.getrandbits(64) for _ in range(rng.randrange(0, 9)))
        msg.prompt_tokens = rng.choice((0, 16, 200))
    msg.task = rng.choice((0, 1, 2, 3, 4, 4, 9))
    msg.model = rng.choice(("", "", "base-m", "ad-1", "ad-3", "unknown", "m" * (LIMIT + 1), "modèle"))
    msg.lora = rng.choice(("", "", "", "ad-2", "l" * (LIMIT + 1)))
    msg.cache_salt = rng.choice(("", "", "salt", "s" * (LIMIT + 1), "sél"))
    msg.request_id = rng.choice(("", "r1", "req-é"))
    msg.session_id = rng.choice(("", "s1"))
    msg.ttft_slo_ms = rng.choice((0.0, 250.0, 1e9))
    msg.expected_output_tokens = rng.choice((0, 300))
    msg.policy = rng.choice(("", "lbgr"))
    msg.candidate_workers.extend(rng.sample(["w1", "w2", "w3"], rng.randrange(0, 3)))
    return msg


def outcome(convert_: Any, msg: pb.RouteRequest, r: Router, client: str) -> Any:
    try:
        req = convert_(msg, r, client=client)
    except KVRouterError as exc:
        return f"{type(exc).__name__}: {exc}"
    fields = {name: getattr(req, name) for name in req.__slots__}
    fields["keys"] = (type(req.keys), req.keys.typecode, req.keys.tolist())
    return fields, [type(v) for v in fields.values()]


@pytest.mark.parametrize("seed", range(3))
def test_the_native_conversion_gives_the_reference_request(seed: int, read_as: str) -> None:
    rng, r = random.Random(seed), router()
    native_answers = 0
    for _ in range(600):
        msg = random_message(rng)
        client = rng.choice(("", "ipv4:10.0.0.1:5000"))
        answer = native.module.route_request_packed(msg, convert._new_route_request, convert._TASKS, r.adapter_bases,
                                                    LIMIT, MAX_PROMPT, BS, client)
        native_answers += answer is not NotImplemented
        assert outcome(convert.route_request, msg, r, client) == outcome(convert._route_request_py, msg, r, client)
    assert native_answers > 100


def test_an_adapter_named_in_model_is_keyed_under_its_base() -> None:
    r = router()
    tokens = list(range(64))
    msg = pb.RouteRequest(token_ids_le32=array("I", tokens).tobytes(), model="ad-1")
    req = native.module.route_request_packed(msg, convert._new_route_request, convert._TASKS, r.adapter_bases,
                                             LIMIT, MAX_PROMPT, BS, "")
    assert (req.model, req.lora) == ("ad-1", "")  # the request as sent
    assert req.keys.tolist() == r.keys_for_tokens(tokens, "base-m", "ad-1").tolist() != r.keys_for_tokens(tokens).tolist()


def test_the_native_conversion_raises_what_building_the_request_raises() -> None:
    r = router()
    msg = pb.RouteRequest(token_ids_le32=b"\x00" * 64, model="ad-1")

    def broken() -> dict[str, str]:
        raise RuntimeError("no bases")

    with pytest.raises(RuntimeError, match="no bases"):
        native.module.route_request_packed(msg, convert._new_route_request, convert._TASKS, broken, LIMIT,
                                           MAX_PROMPT, BS, "")
    with pytest.raises(TypeError, match="route_request_packed"):
        native.module.route_request_packed(msg, convert._new_route_request, convert._TASKS, r.adapter_bases)
