"""Scrape-time metrics of a replica's event-bus consumer (``events.nats_bus.BusStats``).

``kvrouter_bus_pending_messages`` is the replica's lag behind the stream: alert on it staying
high (a slow or paused replica; the server's flow control holds the rest of the stream back
until it catches up). The counters say what the consumer saw: messages, the batches the
router found missing (gaps), holes in the stream itself (stream_skips: messages aged out
before this replica read them), messages refused, reconnects, lag episodes and stream resets
(NATS lost the stream, e.g. a server restarted without its store, or it was deleted and made
again: followed anew from its start).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from ..events.nats_bus import BusStats
from .loop_reads import LoopReads

__all__ = ["register_bus_metrics"]

_COUNTERS = {
    "messages": "event-bus messages consumed",
    "gaps": "batches the router found missing between two of a worker's batches on the bus",
    "stream_skips": "holes in the stream sequence this replica was handed (messages aged out unread)",
    "rejected": "bus messages that did not decode or that the router refused",
    "reconnects": "reconnections to NATS",
    "lag_episodes": "times this replica fell behind the stream by LAG_WARN_MESSAGES or more",
    "stream_resets": "times the stream was found made again (NATS lost it, or it was deleted) and followed anew",
}


def register_bus_metrics(provider: MeterProvider, stats: BusStats, loop_reads: LoopReads | None = None) -> None:
    """``loop_reads``: the daemon's, which runs the callbacks on its event loop."""
    meter = provider.get_meter("kvrouterd.bus")
    if loop_reads is not None:
        meter = loop_reads.meter(meter)

    def observe(attr: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(getattr(stats, attr))

        return callback

    for attr, description in _COUNTERS.items():
        meter.create_observable_counter(f"kvrouter.bus.{attr}", [observe(attr)], description=description)
    meter.create_observable_gauge("kvrouter.bus.pending_messages", [observe("pending")],
                                  description="messages in the event stream after the last one this replica applied")
