"""Small-request latency at the Envoy endpoint picker while huge bodies arrive (issue #16 item 1).

    python -m kvrouterd.benchmarks.ext_proc_stall --form ids --probes 300
    python -m kvrouterd.benchmarks.ext_proc_stall --form chat --tokenizer tokenizer.json
    python -m kvrouterd.benchmarks.ext_proc_stall --loop-held --form ids

Runs ``kvrouterd serve`` in its own process with ``--workers`` event-mode workers, then a probe
client plays Envoy for one small chat request every ``--interval-ms`` (a Process stream:
headers, a ~2 KB body, the destination answer and the echoed body, then the stream's close,
which completes the request) and times each until its destination arrives: first with nothing
else running (quiet), then while a second client sends huge bodies back to back in 64 KiB
chunks, as Envoy streams them: ``ids``, a ``/v1/completions`` body whose ``prompt`` is
``--tokens`` token ids; or ``batch``, the same ids as the first of a batched ``prompt`` (which
the native reader leaves to ``json.loads``: such a huge body is routed unread); or ``chat``, a
``/v1/chat/completions`` body of two messages holding ``--mib`` MiB of text (tokenized when
``--tokenizer`` is given, else approximate text keys); or ``image``, a chat body whose message
holds a ``--mib`` MiB base64 image part (rendered natively as canonical JSON).
Prints p50 / p99 / max of the probes per phase as JSON; reports, never asserts.

``--loop-held`` instead measures in this process how long reading and keying one such body
(``openai_prompt.body_keys``) keeps another thread from running Python, the way the event loop
would be kept: the body is keyed on a worker thread while this thread wakes every 0.2 ms and
records its gaps. ``on_loop_ms`` is the keying's own duration (what the loop waits when it
keys on the loop); ``max_gap_ms`` / ``held_ms`` the longest gap and the sum of gaps over 1 ms
when it keys on a thread; ``control_*`` the same gaps while the thread runs GIL-free work
(sha256) of the same length, which is what a busy machine alone costs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import random
import statistics
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from kvrouterd._generated.envoy.config.core.v3 import base_pb2
from kvrouterd._generated.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from . import harness
from .stats import latency_summary

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHUNK = 64 * 1024


def config_yaml(off_loop_prompt_bytes: int | None, tokenizer: str) -> str:
    """The daemon's config: ``limits.off_loop_prompt_bytes`` and ``ext_proc.tokenizer`` when given."""
    limits = "" if off_loop_prompt_bytes is None else f"limits: {{off_loop_prompt_bytes: {off_loop_prompt_bytes}}}\n"
    ext = f"ext_proc: {{tokenizer: {json.dumps(tokenizer)}}}\n" if tokenizer else ""
    return "listen: 127.0.0.1:0\n" + limits + ext


def _words(rng: random.Random) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(20_000)]


def huge_body(form: str, tokens: int, mib: float, seed: int) -> tuple[str, bytes]:
    rng = random.Random(seed)
    if form == "ids":
        ids = [rng.randrange(128_000) for _ in range(tokens)]
        return "/v1/completions", json.dumps({"model": "m", "prompt": ids}).encode()
    if form == "batch":  # a batched prompt: the native reader leaves it to json.loads
        ids = [rng.randrange(128_000) for _ in range(tokens)]
        return "/v1/completions", json.dumps({"model": "m", "prompt": [ids, ids[:16]]}).encode()
    if form == "image":  # a content part the native reader leaves to Python (rendered as canonical JSON)
        image = base64.b64encode(rng.randbytes(int(mib * (1 << 20)) * 3 // 4)).decode()
        return "/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe this"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}]}).encode()
    words, size, out = _words(rng), int(mib * (1 << 20)), []
    while size > 0:
        out.append(rng.choice(words))
        size -= len(out[-1]) + 1
    text = " ".join(out)
    half = len(text) // 2
    messages = [{"role": "system", "content": text[:half]}, {"role": "user", "content": text[half:]}]
    return "/v1/chat/completions", json.dumps({"model": "m", "messages": messages}).encode()


def _messages(path: str, body: bytes) -> list[ep.ProcessingRequest]:
    headers = [(":method", "POST"), (":path", path), (":authority", "gw"), ("content-type", "application/json")]
    out = [ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])))]
    for start in range(0, len(body), CHUNK):
        out.append(ep.ProcessingRequest(request_body=ep.HttpBody(
            body=body[start : start + CHUNK], end_of_stream=start + CHUNK >= len(body))))
    return out


async def _exchange(process: Any, messages: list[ep.ProcessingRequest]) -> float:
    """One request through the picker: seconds until its destination answer."""
    async def requests() -> AsyncIterator[ep.ProcessingRequest]:
        for m in messages:
            yield m

    started = time.perf_counter()
    call = process(requests())
    answered = 0.0
    async for reply in call:
        if not answered:
            if reply.WhichOneof("response") != "request_headers":
                raise RuntimeError(f"the picker answered {reply}")
            answered = time.perf_counter() - started
    return answered


async def _run(port: int, args: argparse.Namespace) -> dict[str, Any]:
    channel, hog_channel = harness.channel(port), harness.channel(port)
    process = channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                    response_deserializer=ep.ProcessingResponse.FromString)
    hog_process = hog_channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                            response_deserializer=ep.ProcessingResponse.FromString)
    await harness.register_workers(channel, args.workers)
    rng = random.Random(1)
    words = _words(rng)
    probe = _messages("/v1/chat/completions", json.dumps({"model": "m", "messages": [
        {"role": "user", "content": " ".join(rng.choice(words) for _ in range(300))}]}).encode())
    path, body = huge_body(args.form, args.tokens, args.mib, 2)
    huge = _messages(path, body)

    async def probes(n: int) -> list[float]:
        return await harness.probe_loop(lambda: _exchange(process, probe), n, args.interval_ms)

    huge_times: list[float] = []

    async def hog(stop: asyncio.Event) -> None:
        while not stop.is_set():
            huge_times.append(await _exchange(hog_process, huge))

    quiet, loaded = await harness.quiet_then_loaded(probes, hog, args.hogs, args.probes)
    await channel.close()
    await hog_channel.close()
    return {
        "form": args.form, "body_mib": round(len(body) / (1 << 20), 2), "tokenizer": bool(args.tokenizer),
        "workers": args.workers, "hogs": args.hogs,
        "quiet": latency_summary(quiet), "during_huge_bodies": latency_summary(loaded),
        "huge_answer_ms_median": round(statistics.median(huge_times) * 1e3, 2) if huge_times else None,
        "huge_bodies": len(huge_times), "loadavg": os.getloadavg()[0],
    }


def _gaps_while(work: Any) -> tuple[float, float]:
    """(longest gap, sum of gaps over 1 ms) of this thread's 0.2 ms wake-ups while ``work`` runs
    on another thread: how long the event loop would have waited for the GIL, or for a core."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (work(), done.set()))
    gaps = []
    last = time.perf_counter()
    worker.start()
    while not done.is_set():
        time.sleep(0.0002)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    return max(gaps, default=0.0), sum(g for g in gaps if g > 0.001)


def loop_held(args: argparse.Namespace) -> dict[str, Any]:
    from ..server.openai_prompt import PromptKeyer, body_keys, load_tokenizer

    keyer = PromptKeyer(16, load_tokenizer(args.tokenizer) if args.tokenizer else None)
    path, body = huge_body(args.form, args.tokens, args.mib, 2)
    filler = os.urandom(16 << 20)
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        body_keys(path, body, keyer)
        on_loop = time.perf_counter() - started
        max_gap, held = _gaps_while(lambda: body_keys(path, body, keyer))
        # the control: GIL-free work of the same length (sha256 releases the GIL), so the gaps
        # it leaves are the machine's (no core free), not the GIL's
        started = time.perf_counter()
        hashlib.sha256(filler).digest()
        per_pass = time.perf_counter() - started
        passes = max(1, round(on_loop / per_pass))
        control_max_gap, control_held = _gaps_while(lambda: [hashlib.sha256(filler).digest() for _ in range(passes)])
        rounds.append({"on_loop_ms": on_loop * 1e3, "max_gap_ms": max_gap * 1e3, "held_ms": held * 1e3,
                       "control_max_gap_ms": control_max_gap * 1e3, "control_held_ms": control_held * 1e3})
    return {
        "form": args.form, "body_mib": round(len(body) / (1 << 20), 2), "tokenizer": bool(args.tokenizer),
        **harness.medians(rounds, digits=1), "rounds": args.rounds, "loadavg": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--form", choices=("ids", "batch", "chat", "image"), default="ids")
    parser.add_argument("--tokens", type=int, default=1_048_576, help="token ids in an ids body")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB of text in a chat body")
    parser.add_argument("--tokenizer", default="", help="a tokenizer.json for the daemon's ext_proc.tokenizer")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hogs", type=int, default=1, help="clients sending huge bodies back to back")
    harness.add_probe_arguments(parser, probe_tokens=False)
    parser.add_argument("--off-loop-prompt-bytes", type=int, default=None,
                        help="the daemon's limits.off_loop_prompt_bytes (default: its default; 0 = key on the loop)")
    parser.add_argument("--loop-held", action="store_true", help="measure body_keys in this process instead")
    parser.add_argument("--rounds", type=int, default=5, help="--loop-held rounds (medians reported)")
    args = parser.parse_args(argv)
    if args.loop_held:
        print(json.dumps(loop_held(args)))
        return
    with harness.daemon(config_yaml(args.off_loop_prompt_bytes, args.tokenizer), "ext-proc-stall") as daemon:
        result = asyncio.run(_run(daemon.port, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
