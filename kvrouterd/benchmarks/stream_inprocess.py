"""The daemon's RouteStream handler driven in process: its CPU per streamed Route + Complete
without gRPC's transport.

``grpc_stream_route_server_cpu_us`` is the daemon process's CPU under the streamed load. On a
2-core machine that the load shares (with whatever else runs there) it swings 10% or more from
run to run, and it includes the transport every gRPC server pays (the trivial server's
``server_cpu_us_per_call``). This drives the daemon's own ``RouteStream`` handler, fed through its
registered deserializer, with the streamed load's messages: ``STREAMS`` streams each keeping
``PER_STREAM`` Routes in flight, every answer sending its Complete and the next Route in one
batch message cut by the SDK's own ``wire_messages``. What it counts is this thread's CPU
(``time.thread_time``) over a run less the client side's share (cutting messages, reading the
answers): the deserializing, the handler, the answers serialised as gRPC's response serializer
would, and the loop's turns between messages (the maintenance tick's included, and the turn each
stream yields to the others, which a gRPC server spends in its own callbacks). It is the part of
the server's CPU the project's own code decides, with no client sharing the cores: steadier
than the live figures, though a noisy host still moves it. The gRPC server's threads are idle,
and other threads are not counted.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from .._generated.kvrouter.v1 import router_pb2 as pb
from ..config import parse_config
from ..server.app import Daemon
from ..server.stream_answers import passes_bytes
from .grpc_bench import daemon_settings, stream_items
from .workload import populate

#: the streamed load's shape (``grpc_bench._stream_load``'s ``stream_8x8``)
STREAMS = 8
PER_STREAM = 8
#: measured runs (the figure is the median run's), after one run as warm-up
RUNS = 5


class _Call:
    """What the handler uses of grpc.aio's context for one RouteStream call."""

    def __init__(self) -> None:
        self.replies: list[bytes] = []
        self._serialize = passes_bytes(pb.RouteStreamResponse.SerializeToString)  # the daemon registers it

    async def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        pass

    async def write(self, reply: pb.RouteStreamResponse | bytes) -> None:
        self.replies.append(self._serialize(reply))  # gRPC serialises on the handler's thread

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


async def _one_stream(service: Any, route_item: Callable[[int], bytes], complete_item: Callable[[int, str], bytes],
                      messages: int, client_cpu: list[float]) -> int:
    """One closed-loop stream of ``messages`` messages, the last completing what is still in
    flight; adds the CPU its client side took to ``client_cpu`` and returns the Routes it sent."""
    from kvrouter_client._streams import answers, wire_messages  # the SDK's framing, as the live load's

    call = _Call()
    limit = service.stream_batch_bytes
    routes = 0

    async def requests() -> AsyncIterator[pb.RouteStreamRequest]:
        nonlocal routes
        deserialize, clock = service.route_stream_message, time.thread_time
        out = [route_item(n) for n in range(PER_STREAM)]
        next_id = PER_STREAM
        for step in range(messages + 1):  # the last message completes the last Routes
            started = clock()
            wires = [wire for wire, _ in wire_messages(out, limit)]
            client_cpu[0] += clock() - started
            for wire in wires:
                yield deserialize(wire)  # the deserializer the daemon registers for RouteStream
            if step == messages:
                return
            started = clock()
            out = []
            for reply in call.replies:
                for item in answers(pb.RouteStreamResponse.FromString(reply)):
                    kind = item.WhichOneof("kind")
                    if kind == "route":
                        routes += 1
                        out.append(complete_item(next_id, item.route.request_id))
                        next_id += 1
                        if step < messages - 1:
                            out.append(route_item(next_id))
                            next_id += 1
                    elif kind != "complete":
                        raise RuntimeError(f"the handler answered a streamed item with {item}")
            call.replies.clear()
            client_cpu[0] += clock() - started
            await asyncio.sleep(0)  # the other streams' turn

    await service.RouteStream(requests(), call)
    return routes


async def _measure(mode: str, workers: int, blocks: int, prompt: Sequence[int], messages: int,
                   timed_runs: int = RUNS) -> list[float]:
    """``timed_runs`` timed runs after one warming up (0: the warm-up alone, as ``instructions`` counts it)."""
    daemon = Daemon(parse_config(daemon_settings(mode)))
    populate(daemon.router, workers, blocks)
    await daemon.start()
    runs: list[float] = []
    try:
        request = pb.RouteRequest(token_ids_le32=array("I", prompt).tobytes())
        route_item, complete_item = stream_items(request, reported=mode == "observed")
        for run in range(timed_runs + 1):
            client_cpu = [0.0]
            started = time.thread_time()
            routes = await asyncio.gather(*(_one_stream(daemon.service, route_item, complete_item, messages, client_cpu)
                                            for _ in range(STREAMS)))
            handler = time.thread_time() - started - client_cpu[0]
            if run:  # the first warms up
                runs.append(handler / sum(routes) * 1e6)
    finally:
        await daemon.stop(0)
    return runs


def stream_handler_cost(mode: str, workers: int, blocks: int, prompt: Sequence[int],
                        messages: int = 200) -> dict[str, float]:
    """Microseconds of the daemon's CPU per streamed Route + Complete in process, against the
    daemon in ``mode`` (``grpc_bench.daemon_settings``: "daemon", "observed", "deadline_off"):
    the median and the least of ``RUNS`` runs of ``messages`` messages per stream."""
    import uvloop

    runs = uvloop.run(_measure(mode, workers, blocks, prompt, messages))
    return {"us_median": statistics.median(runs), "us_min": min(runs)}
