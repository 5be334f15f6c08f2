"""A huge ext_proc request body does not hold up routing (issue #16 item 1), over real grpc.aio.

A body of ``limits.off_loop_prompt_bytes`` or more is read, tokenized and hashed on a worker
thread. The probe test proves another request was routed while a huge body was being keyed
(structure, not timing: the keying waits until the probe is answered, which could never happen
if it held the loop); the others hold the off-loop path to the on-loop path's decisions, limits
and statuses.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.index import native
from kvrouterd.server import openai_prompt
from kvrouterd.server.app import Daemon

from .test_ext_proc import (  # noqa: F401 - the fixtures the envoy fixture is built from
    POOLED,
    WORKERS,
    Envoy,
    body_msg,
    chat_body,
    daemon_extra,
    destination,
    envoy,
    ext_config,
    headers_msg,
    immediate_status,
    streamed,
    worker_list,
)

#: small enough that the test's bodies are read off the loop without being large
OFF_LOOP_BYTES = 4096
MAX_TOKENS = 50_000
LIMITS = {"limits": {"off_loop_prompt_bytes": OFF_LOOP_BYTES, "max_prompt_tokens": MAX_TOKENS}}
#: the native reader reads bodies with the GIL released; without it, json.loads reads them all
NATIVE = native.module is not None


def ids_body(tokens: list[int], model: str = "m") -> bytes:
    return json.dumps({"model": model, "prompt": tokens}).encode()


async def route_body(envoy: Envoy, path: str, body: bytes, request_id: str) -> tuple[object, str]:
    """Sends one request's headers and body; (its stream, left open, and the destination)."""
    s = envoy.open()
    await s.send(headers_msg(path, extra=[("x-request-id", request_id)]))
    replies = await s.send(body_msg(body, True), expect=1 + -(-len(body) // 62_000))
    header, md = destination(replies[0])
    assert header == md and streamed(replies[1:])[0] == body
    return s, header


@asynccontextmanager
async def started(extra: dict, ext: dict | None = None) -> AsyncIterator[Envoy]:
    cfg = parse_config({"listen": "127.0.0.1:0", "workers": WORKERS, "ext_proc": ext or {}, **extra})
    clock = ManualClock(100.0)
    daemon = Daemon(cfg, clock=clock, seed=3)
    port = await daemon.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Envoy(daemon, channel, clock, InMemorySpanExporter())
    finally:
        await channel.close()
        await daemon.stop(grace=0.5)


@pytest.mark.parametrize("daemon_extra", [LIMITS])
async def test_small_request_routed_while_a_huge_body_is_keyed(envoy):
    ext = envoy.daemon.ext_proc
    real_key_body = ext.key_body
    keying = threading.Event()
    probe_answered = threading.Event()

    def key_after_probe(path: str, body: bytes):  # type: ignore[no-untyped-def]
        if len(body) < OFF_LOOP_BYTES:
            return real_key_body(path, body)
        keying.set()
        # the probe below must be routed while this body is being keyed: were the keying on
        # the loop, the probe could not run and this wait would time out
        assert probe_answered.wait(30), "no request was routed while a huge body was being keyed"
        return real_key_body(path, body)

    ext.key_body = key_after_probe
    huge = ids_body(list(range(40_000)))
    task = asyncio.ensure_future(route_body(envoy, "/v1/completions", huge, "huge"))
    assert await asyncio.to_thread(keying.wait, 30)
    probe, probe_dest = await route_body(envoy, "/v1/chat/completions", chat_body("probe " * 20), "probe")
    probe_answered.set()
    assert envoy.router.request("probe") is not None and envoy.router.request("huge") is None
    s, dest = await task
    assert envoy.router.request("huge").prompt_tokens == 40_000
    for stream in (probe, s):
        await stream.close()


async def test_huge_bodies_are_routed_as_on_the_loop():
    """Two daemons, one keying every body on the loop, see the same requests in the same order:
    every decision, every key and the state they leave must agree."""
    shared = list(range(1000, 1000 + 3000))
    text = "a long shared system prompt " * 400
    sequence = [
        ("/v1/completions", ids_body(shared + list(range(9000, 9100)))),
        ("/v1/chat/completions", chat_body(text + "first question")),
        ("/v1/completions", ids_body(shared + list(range(7000, 7300)))),
        ("/v1/completions", ids_body(shared[:100], model="other")),  # small: on the loop in both
        ("/v1/chat/completions", chat_body(text + "second question")),
        ("/v1/completions", json.dumps({"model": "m", "prompt": text + "completion"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "m", "messages": [
            {"role": "system", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": "é third question"},
        ]}).encode()),
    ]
    assert sum(len(b) >= OFF_LOOP_BYTES for _, b in sequence) == 6
    answers = []
    for limits in (LIMITS, {"limits": {"off_loop_prompt_bytes": 0, "max_prompt_tokens": MAX_TOKENS}}):
        async with started(limits) as env:
            got = []
            for i, (path, body) in enumerate(sequence):
                s, dest = await route_body(env, path, body, f"r{i}")
                req = env.router.request(f"r{i}")
                got.append((dest, list(req.keys), req.prompt_tokens, req.model))
                if i % 2:
                    await s.close()  # completes: some load released, some held
            r = env.router
            got.append(sorted(
                (w.id, w.inflight_requests, w.pending_prefill_tokens, r.index.count(w.slot)) for w in r.workers
            ))
            answers.append(got)
    assert answers[0] == answers[1]
    # cache-aware routing did follow the shared prefixes (the equality is not of empty answers)
    assert answers[0][2][0] == answers[0][0][0] and answers[0][4][0] == answers[0][1][0]


@pytest.mark.parametrize("daemon_extra", [LIMITS])
@pytest.mark.parametrize("ext_config", [{"max_body_bytes": 300_000}])
async def test_huge_bodies_are_rejected_as_on_the_loop_and_change_nothing(envoy):
    cases = [
        # over ext_proc.max_body_bytes while it arrives: 429 before any reading
        ("/v1/completions", [ids_body(list(range(40_000)))[:200_000], b"1" * 200_000], 429),
        # over limits.max_prompt_tokens (approximate text keys: 4 bytes a token)
        ("/v1/completions", [json.dumps({"model": "m", "prompt": "abcd" * (MAX_TOKENS + 1)}).encode()], 429),
        # not JSON; a bad token id at the end of a valid list; a message without a role
        ("/v1/completions", [ids_body(list(range(5000)))[:-1] + b",]}"], 400),
        ("/v1/completions", [ids_body(list(range(5000)) + [-1])], 400),
        ("/v1/chat/completions",
         [json.dumps({"model": "m", "messages": [{"role": "", "content": "x" * 9000}]}).encode()], 400),
    ]
    for path, chunks, status in cases:
        assert sum(map(len, chunks)) >= OFF_LOOP_BYTES
        s = envoy.open()
        await s.send(headers_msg(path))
        for chunk in chunks[:-1]:
            assert await s.send(body_msg(chunk, False)) == []
        if status == 400 and NATIVE:
            # only json.loads could say what is wrong, holding the GIL: passed on unread, for the
            # engine to refuse, rather than stall routing (test below)
            replies = await s.send(body_msg(chunks[-1], True), expect=1 + -(-len(chunks[-1]) // 62_000))
            destination(replies[0])
            assert streamed(replies[1:])[0] == chunks[-1]
            continue
        replies = await s.send(body_msg(chunks[-1], True), expect=1)
        assert immediate_status(replies) == status, (path, status)
        assert b"kvrouterd:" in replies[0].immediate_response.body
    r = envoy.router
    assert r.counters["decisions"] == 0 and len(r.index) == 0
    assert sum(w.inflight_requests for w in r.workers) == 0


@pytest.mark.parametrize("daemon_extra", [LIMITS])
async def test_a_huge_body_only_json_loads_could_read_is_routed_unread(envoy, monkeypatch):
    """A batched prompt is valid, but the native reader leaves it to ``json.loads``, which holds
    the GIL (~70 ms per MiB of ids): read off the loop it would stall routing all the same, so a
    huge one goes to the least loaded worker without a prompt (reason ``body_not_read``). Below
    ``limits.off_loop_prompt_bytes`` it is read, as are all bodies without the extension."""
    parsed: list[int] = []
    real_parse_body = openai_prompt.parse_body

    def counting_parse_body(path: str, body: bytes):  # type: ignore[no-untyped-def]
        parsed.append(len(body))
        return real_parse_body(path, body)

    monkeypatch.setattr(openai_prompt, "parse_body", counting_parse_body)
    small = json.dumps({"model": "m", "prompt": [list(range(100)), list(range(50))]}).encode()
    huge = json.dumps({"model": "m", "prompt": [list(range(5000)), list(range(50))]}).encode()
    assert len(small) < OFF_LOOP_BYTES <= len(huge)
    streams = [(await route_body(envoy, "/v1/completions", body, rid))[0]
               for rid, body in (("small", small), ("huge", huge))]
    assert envoy.router.request("small").prompt_tokens == 150
    assert parsed[0] == len(small)
    if NATIVE:
        assert parsed == [len(small)]
        assert envoy.router.request("huge") is None  # routed unread: nothing committed
        spans = [sp.attributes for sp in envoy.spans.get_finished_spans() if sp.name == "kvrouter.ext_proc.route"]
        assert [a["kvrouter.ext_proc.key_source"] for a in spans] == ["token_ids", "unread"]
    else:
        assert parsed == [len(small), len(huge)]
        assert envoy.router.request("huge").prompt_tokens == 5050
    for stream in streams:
        await stream.close()


@pytest.mark.parametrize("worker_list", [POOLED])
@pytest.mark.parametrize("daemon_extra", [LIMITS])
async def test_a_huge_body_routed_unread_keeps_to_the_model_its_header_names(envoy):
    """A body routed unread is not parsed for its ``model`` either (json.loads would hold the
    GIL): the inference extension's ``x-gateway-model-name`` header names its pool, here B, not
    the least loaded worker of the fleet (A's, registered first)."""
    huge = json.dumps({"model": "B", "prompt": [list(range(5000)), list(range(50))]}).encode()
    assert len(huge) >= OFF_LOOP_BYTES
    s = envoy.open()
    await s.send(headers_msg("/v1/completions", extra=[("x-request-id", "huge"), ("x-gateway-model-name", "B")]))
    replies = await s.send(body_msg(huge, True), expect=1 + -(-len(huge) // 62_000))
    assert destination(replies[0])[0] == "10.0.1.2:8000"
    await s.close()
