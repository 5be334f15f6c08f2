"""Observable-instrument callbacks that read the daemon's live state, run on its event loop.

A metrics collection runs on whichever thread asks for it: the Prometheus endpoint's HTTP
thread for a scrape, the OTLP exporter's thread every export interval. The callbacks of the
observable instruments read router state that the event loop changes (the workers, their
counters, the policies' rule counts), so they must read it between the loop's updates, never
during one. Everything else a collection does, the SDK's aggregation of what the callbacks
observed, its snapshot of the histograms (the SDK's instruments take locks for that) and the
exporter's translation, reads nothing the loop changes.

Collecting wholly on the loop, as the endpoint did, held it for the whole collection: with
1,024 workers reporting TTFTs (a 3.6 MB scrape) the loop stalled 250 ms per scrape (the SDK's
collection 86-129 ms, the exporter's translation 99-149 ms). Each callback wrapped here runs
alone on the loop (``wrap``) and hands its observations back: 5.6 ms of the loop per scrape in
all, the rest of the collection on the collecting thread. That thread still shares the GIL with
the loop, which then waits up to the 5 ms switch interval whenever it takes the GIL back: the
longest stall a 1 ms timer on the loop saw fell from 250 to 38 ms (70 to 11 at 256 workers).

A loop that does not answer within ``COLLECT_TIMEOUT_S`` (hung, or stopping) gives the
callbacks no observations for the next ``COLLECT_TIMEOUT_S``: the collection still returns
what the SDK's own instruments hold (the event-loop lag histogram among them, which says why),
after one wait rather than one per instrument. The wait is well inside the SDK's own deadline
for a whole collection (10 s), past which it fails the collection, the scrape with it.

The collecting thread holds the SDK's collection lock while it waits for the loop, so the loop
must not take that lock meanwhile: it does only to create an observable instrument, so the
daemon attaches once its instruments are all created.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

__all__ = ["COLLECT_TIMEOUT_S", "LoopReads"]

log = logging.getLogger("kvrouterd.telemetry")

#: seconds a collection waits for the event loop to run one callback (the loop warns of a stall
#: at 100 ms), and for which it then does not wait again
COLLECT_TIMEOUT_S = 2.0

Callback = Callable[[CallbackOptions], Iterable[Observation]]


class LoopReads:
    """Runs observable callbacks on the event loop ``attach`` names, for collections on other
    threads; on the loop's own thread, and while no loop is attached, they run where called."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        #: monotonic time until which callbacks give nothing: the loop missed a deadline
        self._unanswered_until = 0.0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run callbacks on ``loop``; called on that loop's thread."""
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._unanswered_until = 0.0

    def detach(self) -> None:
        """The loop is stopping: callbacks run where they are called again."""
        self._loop = None

    def wrap(self, callback: Callback) -> Callback:
        """``callback`` run on the attached loop when called from another thread."""

        def on_loop(options: CallbackOptions) -> Sequence[Observation]:
            loop = self._loop
            if loop is None or threading.get_ident() == self._loop_thread:
                return list(callback(options))
            if time.monotonic() < self._unanswered_until:
                return []
            answer: concurrent.futures.Future[list[Observation]] = concurrent.futures.Future()

            def run() -> None:
                if answer.set_running_or_notify_cancel():
                    try:
                        answer.set_result(list(callback(options)))
                    except BaseException as exc:  # noqa: BLE001 - the collecting thread raises it
                        answer.set_exception(exc)

            wait = COLLECT_TIMEOUT_S
            left_ms = getattr(options, "timeout_millis", 0)  # the SDK's time left for the whole collection
            if left_ms:
                wait = min(wait, left_ms / 1000.0)
            try:
                loop.call_soon_threadsafe(run)
            except RuntimeError:  # the loop closed under us
                return []
            try:
                return answer.result(wait)
            except concurrent.futures.TimeoutError:
                answer.cancel()
                self._unanswered_until = time.monotonic() + COLLECT_TIMEOUT_S
                log.warning("the event loop did not run a metrics callback within %ss: metrics read from "
                            "router state are left out of collections for the next %ss",
                            COLLECT_TIMEOUT_S, COLLECT_TIMEOUT_S)
                return []

        return on_loop

    def meter(self, meter: Meter) -> Meter:
        """``meter``, its observable instruments' callbacks wrapped (``wrap``)."""
        return _LoopMeter(meter, self)  # type: ignore[return-value]


class _LoopMeter:
    """A Meter whose ``create_observable_*`` wrap their callbacks; everything else is ``meter``'s."""

    def __init__(self, meter: Meter, reads: LoopReads) -> None:
        self._meter, self._reads = meter, reads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)

    def create_observable_counter(self, name: str, callbacks: Sequence[Callback] | None = None,
                                  **kwargs: Any) -> Any:
        return self._meter.create_observable_counter(name, self._wrapped(callbacks), **kwargs)

    def create_observable_gauge(self, name: str, callbacks: Sequence[Callback] | None = None, **kwargs: Any) -> Any:
        return self._meter.create_observable_gauge(name, self._wrapped(callbacks), **kwargs)

    def create_observable_up_down_counter(self, name: str, callbacks: Sequence[Callback] | None = None,
                                          **kwargs: Any) -> Any:
        return self._meter.create_observable_up_down_counter(name, self._wrapped(callbacks), **kwargs)

    def _wrapped(self, callbacks: Sequence[Callback] | None) -> list[Callback]:
        return [self._reads.wrap(callback) for callback in callbacks or ()]
