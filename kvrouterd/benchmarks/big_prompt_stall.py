"""Small-Route latency while another client sends huge prompts (issue #16 item 1).

    python -m kvrouterd.benchmarks.big_prompt_stall --tokens 1048576 --probes 300 [--via stream]

Runs ``kvrouterd serve`` in its own process (as in production) with ``--workers`` workers
(event mode, or approximate with ``--mode approximate``), then a probe client sends a small Route
(+ its Complete) every ``--interval-ms`` and times each Route's round trip: first with nothing
else running (quiet), then while a second client sends ``--tokens``-token Routes back to back
(each completed), packed (``token_ids_le32``, as the SDK sends them), repeated, or unpacked
(``token_ids`` with a field per id, as no encoder writes them: a huge one is refused), as unary
Routes or (``--via stream``) as RouteStream messages on one stream per client (``--batch N``:
each message a batch of N items sharing the tokens). ``--malformed tail`` appends a field upb
refuses (a length past the end) to each huge Route, ``--malformed ids`` (``--form repeated``)
cuts its last token id short: each is then refused with INVALID_ARGUMENT (on a stream of its
own for ``--via stream``, as the refusal ends the stream). ``answers`` counts how the huge
messages were answered (routed, or refused: the status's name). The huge messages are serialized once
up front so the client spends no CPU building them. Then the hog alone sends ``--cpu-messages``
more, and the daemon's event-loop thread's CPU time (its main thread's
``/proc/PID/task/PID/schedstat``, less its idle rate) per huge message is reported as
``loop_ms_per_huge``: what one such message costs every other call, free of the machine's noise.
Prints p50 / p99 / max of the probes per phase as JSON; reports, never asserts (the machine is
shared).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import statistics
import time
from typing import Any

import grpc

from .._generated.kvrouter.v1 import router_pb2 as pb
from ..server.wire import length_delimited, varint
from . import harness
from .stats import latency_summary


def config_yaml(off_loop_prompt_bytes: int | None = None) -> str:
    """The daemon's config: 16 MiB messages, ``limits.off_loop_prompt_bytes`` when given."""
    extra = "" if off_loop_prompt_bytes is None else f", off_loop_prompt_bytes: {off_loop_prompt_bytes}"
    return "listen: 127.0.0.1:0\nlimits: {max_message_bytes: 16777216%s}\n" % extra


def _route(tokens: int, packed: bool, seed: int) -> pb.RouteRequest:
    if packed:
        return harness.packed_route(tokens, seed)
    rng = random.Random(seed)
    return pb.RouteRequest(token_ids=[rng.getrandbits(17) for _ in range(tokens)])


def _unpacked_route(tokens: int, seed: int) -> bytes:
    """A Route whose token ids are unpacked, a ``token_ids`` field (number 2, varint) per id."""
    rng = random.Random(seed)
    return b"".join(b"\x10" + varint(rng.getrandbits(17)) for _ in range(tokens))


#: a field upb refuses, whatever follows: session_id (7) with a length past the end
_REFUSED_TAIL = b"\x3a\x05ab"


def _route_bytes(tokens: int, packed: bool, seed: int, malformed: str = "", unpacked: bool = False) -> bytes:
    """A Route of ``tokens`` tokens (``unpacked``: its ids a field each); ``malformed``: "tail" (a
    field upb refuses after the prompt), "ids" (its last token id cut short: a repeated prompt's
    last varint byte continues)."""
    data = _unpacked_route(tokens, seed) if unpacked else _route(tokens, packed, seed).SerializeToString()
    if malformed == "tail":
        return data + _REFUSED_TAIL
    if malformed == "ids":
        if packed:
            raise ValueError("--malformed ids needs --form repeated (packed ids are any bytes)")
        return data[:-1] + bytes([data[-1] | 0x80])  # token_ids is the Route's only field: it ends the message
    return data


def _stream_id(value: int) -> bytes:
    return pb.RouteStreamRequest(id=value).SerializeToString()  # RouteStreamRequest.id alone


def _stream_bytes(tokens: int, packed: bool, batch: int, malformed: str = "", unpacked: bool = False) -> bytes:
    """One RouteStream message carrying ``tokens`` tokens: a Route, or a batch of ``batch`` Routes
    (``malformed``: the last Route as ``_route_bytes`` makes it; ``unpacked``: every Route's ids a field each)."""
    if unpacked:
        if batch <= 1:
            return _stream_id(1) + length_delimited(2, _route_bytes(tokens, packed, 2, malformed, True))
        items = [_stream_id(1 + i) + length_delimited(2, _route_bytes(tokens // batch, packed, 2 + i, "", True))
                 for i in range(batch - 1)]
        items.append(_stream_id(batch) + length_delimited(2, _route_bytes(tokens // batch, packed, 1 + batch,
                                                                          malformed, True)))
        return length_delimited(5, b"".join(length_delimited(1, item) for item in items))
    if not malformed:
        if batch <= 1:
            return pb.RouteStreamRequest(id=1, route=_route(tokens, packed, 2)).SerializeToString()
        items = [pb.RouteStreamRequest(id=1 + i, route=_route(tokens // batch, packed, 2 + i)) for i in range(batch)]
        return pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=items)).SerializeToString()
    if batch <= 1:
        return length_delimited(2, _route_bytes(tokens, packed, 2, malformed))  # RouteStreamRequest.route
    items = [pb.RouteStreamRequest(id=1 + i, route=_route(tokens // batch, packed, 2 + i)).SerializeToString()
             for i in range(batch - 1)]
    items.append(length_delimited(2, _route_bytes(tokens // batch, packed, 1 + batch, malformed)))
    return length_delimited(5, b"".join(length_delimited(1, item) for item in items))  # RouteStreamRequest.batch.items


#: how an unpacked prompt may be refused: its encoding, or (a router that parses it whole, then
#: counts it) its size over max_prompt_tokens
_REFUSALS = {code.value[0]: code.name for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)}


class _StreamHog:
    """Huge RouteStream messages on one stream, each answered, its Routes then completed on it."""

    def __init__(self, channel: grpc.aio.Channel, message: bytes, answers: collections.Counter[str]) -> None:
        self.call = channel.stream_stream(harness.ROUTE_STREAM, request_serializer=None,
                                          response_deserializer=pb.RouteStreamResponse.FromString)()
        self.message = message
        self.answers = answers

    async def send(self) -> None:
        await self.call.write(self.message)
        reply = await self.call.read()
        answers = reply.batch.items if reply.WhichOneof("kind") == "batch" else (reply,)
        errors = {a.error.code for a in answers if a.WhichOneof("kind") == "error"}
        if errors:  # refused (an unpacked prompt, or one over max_prompt_tokens): nothing to complete
            assert errors <= set(_REFUSALS), answers
            self.answers[_REFUSALS[min(errors)]] += 1
            return
        self.answers["routed"] += 1
        done = [pb.RouteStreamRequest(id=a.id, complete=harness.complete_message(a.route.request_id)) for a in answers]
        message = done[0] if len(done) == 1 else pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=done))
        await self.call.write(message.SerializeToString())
        await self.call.read()

    async def close(self) -> None:
        await self.call.done_writing()
        await self.call.read()


async def _run(port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    channel, hog_channel = harness.channel(port), harness.channel(port)
    route, complete = harness.route_calls(channel)
    hog_route, hog_complete = harness.route_calls(hog_channel)
    mode = pb.CACHE_STATE_MODE_EVENTS if args.mode == "events" else pb.CACHE_STATE_MODE_APPROXIMATE
    await harness.register_workers(channel, args.workers, mode=mode, capacity_blocks=args.capacity_blocks)
    probe_msg = _route_bytes(args.probe_tokens, True, 1)
    packed = args.form == "packed"
    unpacked = args.form == "unpacked"
    malformed = args.malformed if args.malformed != "none" else ""
    huge = (_route_bytes(args.tokens, packed, 2, malformed, unpacked) if args.via == "unary"
            else _stream_bytes(args.tokens, packed, args.batch, malformed, unpacked))
    answers: collections.Counter[str] = collections.Counter()

    async def probes(n: int) -> list[float]:
        return await harness.probe_routes(route, complete, probe_msg, n, args.interval_ms)

    huge_times: list[float] = []

    async def refused_one() -> None:
        answers["INVALID_ARGUMENT"] += 1
        try:
            if args.via == "stream":  # the refusal ends the stream: one of its own each
                call = hog_channel.stream_stream(harness.ROUTE_STREAM, request_serializer=None)()
                await call.write(huge)
                await call.read()
            else:
                await hog_route(huge)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            return
        raise AssertionError("a malformed huge message was answered")

    async def huge_one(stream: _StreamHog | None) -> None:
        started = time.perf_counter()
        if malformed:
            await refused_one()
            huge_times.append(time.perf_counter() - started)
            return
        if stream is not None:
            await stream.send()  # the answer's round trip and its Completes'
            huge_times.append(time.perf_counter() - started)
            return
        try:
            reply = await hog_route(huge)
        except grpc.aio.AioRpcError as exc:  # an unpacked prompt, refused (or over max_prompt_tokens)
            if exc.code().value[0] not in _REFUSALS or not unpacked:
                raise
            answers[exc.code().name] += 1
            huge_times.append(time.perf_counter() - started)
            return
        answers["routed"] += 1
        huge_times.append(time.perf_counter() - started)
        await hog_complete(harness.complete_message(reply.request_id))

    async def hog(stop: asyncio.Event) -> None:
        stream = _StreamHog(hog_channel, huge, answers) if args.via == "stream" and not malformed else None
        while not stop.is_set():
            await huge_one(stream)
        if stream is not None:
            await stream.close()

    quiet, loaded = await harness.quiet_then_loaded(probes, hog, args.hogs, args.probes)
    during = list(huge_times)
    # the loop's CPU per huge message, nothing else running: its idle rate first, then the hog alone
    idle_from, idle_cpu = time.perf_counter(), harness.loop_cpu_s(pid)
    await asyncio.sleep(1.0)
    idle_rate = (harness.loop_cpu_s(pid) - idle_cpu) / (time.perf_counter() - idle_from)
    stream = _StreamHog(hog_channel, huge, answers) if args.via == "stream" and not malformed else None
    await huge_one(stream)  # the stream opened, its first message out of the way
    started, cpu = time.perf_counter(), harness.loop_cpu_s(pid)
    for _ in range(args.cpu_messages):
        await huge_one(stream)
    loop_s = harness.loop_cpu_s(pid) - cpu - idle_rate * (time.perf_counter() - started)
    if stream is not None:
        await stream.close()
    await channel.close()
    await hog_channel.close()
    return {
        "tokens": args.tokens, "form": args.form, "via": args.via, "batch": args.batch, "mode": args.mode,
        "malformed": args.malformed,
        "workers": args.workers, "hogs": args.hogs,
        "quiet": latency_summary(quiet), "during_huge_routes": latency_summary(loaded),
        "huge_route_ms_median": round(statistics.median(during) * 1e3, 2), "huge_routes": len(during),
        "answers": dict(answers),
        "loop_ms_per_huge": round(loop_s / args.cpu_messages * 1e3, 2),
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=1_048_576, help="tokens per huge prompt")
    parser.add_argument("--form", choices=("packed", "repeated", "unpacked"), default="packed",
                        help="the huge prompts' token ids: token_ids_le32, token_ids packed, or token_ids a field per id")
    parser.add_argument("--mode", choices=("events", "approximate"), default="events")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--capacity-blocks", type=int, default=0)
    parser.add_argument("--hogs", type=int, default=1, help="clients sending huge prompts back to back")
    harness.add_probe_arguments(parser)
    parser.add_argument("--via", choices=("unary", "stream"), default="unary",
                        help="how huge prompts come: unary Routes, or RouteStream messages (probes are unary)")
    parser.add_argument("--batch", type=int, default=1,
                        help="--via stream: items per huge message (a batch sharing --tokens), 1 = a plain Route")
    parser.add_argument("--malformed", choices=("none", "tail", "ids"), default="none",
                        help="huge messages upb refuses: a bad field after the prompt, or (repeated) its last id cut short")
    parser.add_argument("--cpu-messages", type=int, default=30,
                        help="huge messages sent alone at the end to measure the loop's CPU per message")
    parser.add_argument("--off-loop-prompt-bytes", type=int, default=None,
                        help="the daemon's limits.off_loop_prompt_bytes (default: its default; 0 = hash on the loop)")
    args = parser.parse_args(argv)
    with harness.daemon(config_yaml(args.off_loop_prompt_bytes), "big-prompt") as daemon:
        result = asyncio.run(_run(daemon.port, daemon.pid, args))
    result["pid_note"] = f"daemon pid {daemon.pid}, client pid {os.getpid()}"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
