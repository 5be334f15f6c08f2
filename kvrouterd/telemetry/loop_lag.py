"""Event-loop lag and garbage-collector pauses: what held routing up, and for how long.

Every RPC runs on the daemon's one event loop, so anything that holds the loop (a slow
handler, a C call on a large message, a full garbage collection) delays every Route behind
it (issue #16: no call may block Route for more than a few ms). Two instruments make that
visible in production:

* ``kvrouter_event_loop_lag_seconds``: a heartbeat coroutine sleeps ``HEARTBEAT_S`` and
  records how late it woke. A blocked loop wakes it late by the length of the block, so the
  histogram's tail is the stalls the loop's callbacks saw (as Node's ``monitorEventLoopDelay``
  measures it). Ten wake-ups a second: idle, the daemon's CPU went from 0.73% to 1.07% of
  a core with the monitor (its heartbeat, watchdog and gc callback; medians of 3 x 30 s).
* ``kvrouter_gc_pause_seconds{generation}``: ``gc.callbacks`` time every collection. The
  callback only queues the pause (the SDK's locks must not be entered from inside a
  collection, which can start while one of them is held); the heartbeat records the queue.

When the loop stays blocked past ``telemetry.loop_stall_warn_ms``, a watchdog thread samples
the loop thread's stack (``sys._current_frames``) every ``min(warn/2, HEARTBEAT_S)`` from
``warn - period`` into the stall on, so any stall long enough to be warned about spans at least
one sample, and when the loop runs again the heartbeat logs one WARNING naming what it was running, how long it was held, how much of that was
garbage collection, and how much CPU the loop thread used meanwhile: a stall the thread spent
off the CPU was the machine (no core free) or another thread holding the GIL, not the code
the stack names. The watchdog is a Python thread: while one C call holds the GIL (a huge
protobuf parse, say) it cannot run, and a stall made of a single such call is reported as not
sampled, saying so. A loop held for ``HUNG_S`` is logged by the watchdog at once, since it may
never run again to say so. Warnings are coalesced to one per ``WARN_EVERY_S``; the
histogram counts every stall.

A stall the loop thread spent mostly *waiting for a CPU* (runnable, not running: the
kernel's run-queue wait in ``/proc/thread-self/schedstat``, which a CPU-throttled pod's
threads accumulate too) is the machine, not the code: it is counted in
``kvrouter_event_loop_starved_stalls_total`` and ``kvrouter_event_loop_cpu_wait_seconds_total``
and logged at INFO at most once per ``STARVED_LOG_EVERY_S``, so a busy node does not fill the
log with warnings. A loop that blocked (a slow call, a blocking syscall, the GIL held
elsewhere) still gets its WARNING. Where the kernel does not report run-queue waits, every
stall is a WARNING as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import sys
import threading
import time
from collections import Counter, deque
from types import FrameType
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import Histogram
from opentelemetry.sdk.metrics import MeterProvider

from ..tasks import stop_task

__all__ = ["LoopMonitor", "describe_stack", "freeze_heap", "unfreeze_heap"]

log = logging.getLogger("kvrouterd.telemetry")

#: how often the heartbeat wakes, seconds
HEARTBEAT_S = 0.1
#: a loop held this long is logged by the watchdog without waiting for it to run again
HUNG_S = 5.0
#: at most one stall warning per this many seconds (the rest are counted into the next one)
WARN_EVERY_S = 1.0
#: at most one INFO line about CPU-starved stalls per this many seconds (the metric counts each)
STARVED_LOG_EVERY_S = 60.0
#: a stall is CPU-starved when the loop thread waited for a CPU at least this share of it
STARVED_SHARE = 0.5
#: the calling thread's scheduler statistics: ns on a CPU, ns waiting on a run queue, time slices
_SCHEDSTAT = "/proc/thread-self/schedstat"
#: frames of the loop thread's stack quoted in a warning, innermost first
STACK_DEPTH = 6
#: gc pauses queued between two heartbeats before the oldest are dropped (and counted)
MAX_PENDING_PAUSES = 65536

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


_freeze_lock = threading.Lock()
#: daemons in this process whose start-up heap is frozen (``freeze_heap`` / ``unfreeze_heap``)
_freeze_holders = 0


def _thread_frame(thread_id: int) -> FrameType | None:
    """The frame ``thread_id`` is running, with no collection inside ``sys._current_frames``:
    one started there (allocating its dict) deadlocks the whole process on a lock the call
    already holds (CPython gh-106883, fixed in 3.11.9; this daemon supports 3.11.0 on), and a
    watchdog that samples a stalled loop is exactly where that would strike. The snapshot
    child's own ``gc.disable()`` runs after fork, in a process without this thread."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        return sys._current_frames().get(thread_id)
    finally:
        if enabled:
            gc.enable()


def freeze_heap() -> None:
    """``gc.freeze()`` for one holder (a daemon's start-up heap, issue #16): what is alive now
    leaves every later collection. Freezing is process-wide and ``gc.unfreeze()`` thaws every
    holder's objects at once, so a daemon stopping must not thaw another's: the heap is
    thawed when its last holder calls ``unfreeze_heap``."""
    global _freeze_holders
    with _freeze_lock:
        gc.freeze()
        _freeze_holders += 1


def unfreeze_heap() -> None:
    """Give up one ``freeze_heap``; the last holder's call thaws the heap (``gc.unfreeze()``)."""
    global _freeze_holders
    with _freeze_lock:
        if _freeze_holders <= 0:
            raise RuntimeError("unfreeze_heap() without a matching freeze_heap()")
        _freeze_holders -= 1
        if _freeze_holders == 0:
            gc.unfreeze()


def describe_stack(frame: FrameType | None, depth: int = STACK_DEPTH) -> str:
    """``func (file:line) <- caller (file:line) ...``, innermost first, paths from the package dir."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        path = code.co_filename
        for root in sys.path:  # a path relative to where it was imported from reads shorter
            if root and path.startswith(root + os.sep):
                path = path[len(root) + 1:]
                break
        parts.append(f"{code.co_qualname} ({path}:{frame.f_lineno})")
        frame = frame.f_back
    return " <- ".join(parts) or "(no Python frame)"


class LoopMonitor:
    """The heartbeat, the watchdog thread and the gc callback of one event loop.

    ``start()`` on the loop to watch; ``stop()`` removes the callback and ends the thread.
    ``warn_after_s`` 0 keeps the metrics and turns the watchdog and its warnings off.
    """

    def __init__(self, provider: MeterProvider, warn_after_s: float) -> None:
        meter = provider.get_meter("kvrouterd.loop")
        self.lag: Histogram = meter.create_histogram(
            "kvrouter.event_loop.lag", unit="s",
            description="how late the event loop ran a 100 ms heartbeat: the time it was held by something else",
            explicit_bucket_boundaries_advisory=LAG_BUCKETS,
        )
        self.gc_pause: Histogram = meter.create_histogram(
            "kvrouter.gc.pause", unit="s", description="garbage collection pauses, by generation",
            explicit_bucket_boundaries_advisory=GC_BUCKETS,
        )
        self.warn_after_s = warn_after_s
        #: stalls at or past warn_after_s, and the gc pauses lost to a full queue (for tests and logs)
        self.stalls = 0
        self.pauses_dropped = 0
        self._attributes = [{"generation": str(g)} for g in range(3)]
        self._gc_started = 0.0
        self._pauses: deque[tuple[int, float]] = deque(maxlen=MAX_PENDING_PAUSES)
        #: when the heartbeat is due next (perf_counter); read by the watchdog
        self._due = 0.0
        self._samples: list[str] = []
        self._sampled_due = 0.0
        #: the watchdog's sampling period, and how late the heartbeat must be before it samples:
        #: early enough that any stall reaching warn_after_s spans a whole period of sampling
        self._period = min(warn_after_s / 2, HEARTBEAT_S) if warn_after_s > 0 else 0.0
        self._sample_after_s = max(0.0, warn_after_s - self._period)
        self._hung_logged_due = 0.0
        self._lock = threading.Lock()
        self._loop_thread = 0
        self._beat: asyncio.Task[None] | None = None
        self._watchdog: threading.Thread | None = None
        self._stopping = threading.Event()
        self._last_warning = 0.0
        self._unwarned = 0
        self.starved_stalls: metrics.Counter = meter.create_counter(
            "kvrouter.event_loop.starved_stalls",
            description="event loop stalls past telemetry.loop_stall_warn_ms spent mostly waiting for a CPU",
        )
        self.cpu_wait: metrics.Counter = meter.create_counter(
            "kvrouter.event_loop.cpu_wait", unit="s",
            description="seconds the event loop thread waited for a CPU during those stalls",
        )
        #: CPU-starved stalls (logged at INFO), and those since the last INFO line
        self.starved = 0
        self._starved_unlogged = 0
        self._last_starved_log = -math.inf
        self._schedstat = -1
        self._waited_before = 0.0

    def start(self) -> None:
        """Watch the running loop (call from a coroutine on it)."""
        self._loop_thread = threading.get_ident()
        try:  # opened on the loop thread, so it keeps reading that thread's statistics
            self._schedstat = os.open(_SCHEDSTAT, os.O_RDONLY)
        except OSError:
            self._schedstat = -1
        self._due = time.perf_counter() + HEARTBEAT_S
        gc.callbacks.append(self._on_gc)
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat(), name="kvrouterd-loop-monitor")
        if self.warn_after_s > 0:
            self._stopping.clear()
            self._watchdog = threading.Thread(target=self._watch, name="kvrouterd-loop-watchdog", daemon=True)
            self._watchdog.start()

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        self._stopping.set()
        await stop_task(self._beat)
        self._beat = None
        if self._watchdog is not None:
            await asyncio.to_thread(self._watchdog.join, 5)
            self._watchdog = None
        if self._schedstat >= 0:
            os.close(self._schedstat)
            self._schedstat = -1
        self._record_pauses()

    def _cpu_wait_s(self) -> float | None:
        """Seconds the loop thread has waited on a run queue (runnable, no CPU), or None if unknown."""
        if self._schedstat < 0:
            return None
        try:
            return int(os.pread(self._schedstat, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    # ---- on the loop ------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        clock, cpu = time.perf_counter, time.thread_time  # the heartbeat runs on the loop thread
        while True:
            started_cpu = cpu()
            if self.warn_after_s > 0:
                self._waited_before = self._cpu_wait_s() or 0.0
            self._due = due = clock() + HEARTBEAT_S
            await asyncio.sleep(HEARTBEAT_S)
            lag = max(0.0, clock() - due)
            # the loop runs again: nothing to sample until the next sleep (a sample taken now
            # would name this bookkeeping instead of what held the loop)
            self._due = math.inf
            self.lag.record(lag)
            gc_s, collections = self._record_pauses()
            if self.warn_after_s > 0 and lag >= self.warn_after_s:
                self._stalled(lag, cpu() - started_cpu, gc_s, collections, due)

    def _record_pauses(self) -> tuple[float, Counter[int]]:
        """Record the queued gc pauses; their total seconds and count per generation."""
        total, collections = 0.0, Counter[int]()
        record, attributes, pauses = self.gc_pause.record, self._attributes, self._pauses
        while pauses:
            generation, seconds = pauses.popleft()
            record(seconds, attributes[generation])
            total += seconds
            collections[generation] += 1
        return total, collections

    def _stalled(self, lag: float, cpu_s: float, gc_s: float, collections: Counter[int], due: float) -> None:
        self.stalls += 1
        with self._lock:
            # only this stall's samples: an earlier, shorter one may have left some
            samples = self._samples if self._sampled_due == due else []
            self._samples = []
        waited = self._cpu_wait_s()
        if waited is not None and waited - self._waited_before >= STARVED_SHARE * lag:
            self._starved(lag, waited - self._waited_before, cpu_s)
            return
        now = time.monotonic()
        if now - self._last_warning < WARN_EVERY_S:
            self._unwarned += 1
            return
        self._last_warning = now
        # the watchdog samples every period from sample_after_s into the stall, so it misses one
        # that reached warn_after_s only if it did not run: one C call held the GIL throughout
        # (nothing else runs Python meanwhile) or no CPU was free for its thread
        running = Counter(samples).most_common(1)[0][0] if samples else (
            f"(not sampled: the watchdog thread did not run from {self._sample_after_s * 1000:.0f} ms into "
            "the stall to its end, so one C call held the GIL throughout or no CPU was free)")
        gcs = ", ".join(f"{n} gen-{g}" for g, n in sorted(collections.items())) or "none"
        more = f"; {self._unwarned} more stalls since the last warning" if self._unwarned else ""
        self._unwarned = 0
        log.warning(
            "event loop blocked for %.0f ms (warn at %.0f ms): running %s; garbage collection %.0f ms of it (%s); "
            "the loop thread was on a CPU %.0f ms of the last %.0f%s",
            lag * 1000, self.warn_after_s * 1000, running, gc_s * 1000, gcs, cpu_s * 1000,
            (lag + HEARTBEAT_S) * 1000, more,
            extra={"blocked_ms": round(lag * 1000, 1), "gc_ms": round(gc_s * 1000, 1), "cpu_ms": round(cpu_s * 1000, 1)},
        )

    def _starved(self, lag: float, waited_s: float, cpu_s: float) -> None:
        """The loop thread was runnable but got no CPU for most of the stall: count it, say so at INFO now and then."""
        self.starved += 1
        self.starved_stalls.add(1)
        self.cpu_wait.add(waited_s)
        now = time.monotonic()
        if now - self._last_starved_log < STARVED_LOG_EVERY_S:
            self._starved_unlogged += 1
            return
        self._last_starved_log = now
        more = f"; {self._starved_unlogged} more such stalls since the last report" if self._starved_unlogged else ""
        self._starved_unlogged = 0
        log.info(
            "event loop delayed %.0f ms waiting for a CPU (%.0f ms of it runnable with no CPU free, %.0f ms on a CPU): "
            "the node or the pod's CPU limit, not a blocking call%s",
            lag * 1000, waited_s * 1000, cpu_s * 1000, more,
            extra={"blocked_ms": round(lag * 1000, 1), "cpu_wait_ms": round(waited_s * 1000, 1)},
        )

    # ---- elsewhere ------------------------------------------------------------------------

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # runs inside the collection, on whichever thread triggered it: only queue (deque
        # appends are atomic), never enter the metrics SDK
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            if len(self._pauses) == MAX_PENDING_PAUSES:
                self.pauses_dropped += 1
            self._pauses.append((info["generation"], time.perf_counter() - self._gc_started))

    def _watch(self) -> None:
        """Sample the loop thread's stack while it is held past ``warn_after_s``."""
        period, sample_after = self._period, self._sample_after_s
        while not self._stopping.wait(period):
            due = self._due
            late = time.perf_counter() - due
            if late < sample_after:
                continue
            frame = _thread_frame(self._loop_thread)
            stack = describe_stack(frame)
            with self._lock:
                if self._sampled_due != due:
                    self._sampled_due, self._samples = due, []
                self._samples.append(stack)
            if late >= HUNG_S and self._hung_logged_due != due:
                self._hung_logged_due = due
                log.warning("event loop blocked for %.1f s so far: running %s", late, stack,
                            extra={"blocked_ms": round(late * 1000, 1)})
