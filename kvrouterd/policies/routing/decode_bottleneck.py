"""DualMap's decode-bottleneck detector (appendix A.7): which workers have stopped prefilling.

A.7 flags a worker that has completed no prefill for ``T`` seconds while requests wait for
it: the paper's cause is memory exhaustion under vLLM, whose scheduler then runs only
decodes until sequences finish and free KV blocks. The router learns prefill completions
from ``Complete`` (its TTFT dates the first token), so it sees them late.

``gate="paper"`` is that rule as written. It misfires on long prompts: a worker prefilling
one 70k-token prompt (several seconds even on an H100) finishes no prefill meanwhile and
looks stuck, although it is computing exactly what it was given. ``gate="guarded"`` adds
two conditions, each from what the paper says the state is:

- **KV saturation**: a worker whose engine reports load (``ReportLoad``) is flagged only
  while its reported KV use is at least ``kv_saturation``; the memory exhaustion A.7
  describes cannot happen below it. A worker that reports nothing is judged without it.
- **The longest prefill in flight**: the interval must exceed ``T`` plus the modelled
  prefill time of the longest prompt routed to the worker and not yet completed. That
  prompt may still be prefilling, and its own compute is not a stall. A prompt that already
  finished its prefill (the router cannot tell until ``Complete``) delays detection by at
  most its own prefill time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from ...index.workers import Worker

__all__ = ["DecodeBottleneck"]

# in-flight prompts remembered per worker; a caller that never completes must not grow memory
_MAX_TRACKED_PER_WORKER = 4096


class DecodeBottleneck:
    """Per-worker A.7 state: when it went busy, its last prefill, its prompts in flight."""

    def __init__(self, limit_s: float, gate: Literal["paper", "guarded"], kv_saturation: float,
                 prefill_ms: Callable[[int, int], float]) -> None:
        #: A.7's T, seconds; 0 disables the rule
        self.limit_s = limit_s
        self.gate = gate
        self.kv_saturation = kv_saturation
        #: modelled prefill time of (uncached tokens, cached tokens) on an idle worker, ms
        self._prefill_ms = prefill_ms
        self._last_prefill: dict[str, float] = {}
        self._busy_since: dict[str, float] = {}
        #: worker -> request id -> (uncached, cached) tokens of prompts routed and not completed
        self._inflight: dict[str, dict[str, tuple[int, int]]] = {}

    def stall_ms(self, worker: Worker, now: float, queued: bool | None = None) -> float:
        """The prefill interval of a decode-bottlenecked worker, else 0.

        The rule needs a non-empty queue of requests waiting for prefill: ``queued`` when the
        caller knows (the admission queue), else the engine's reported queue (ReportLoad) or
        the router's admission queue. In-flight requests alone do not count: most of them are
        decoding, and ``Complete`` reports their prefill only when they finish.
        """
        waiting = (worker.reported_queue > 0 or worker.queued_requests > 0) if queued is None else queued
        if self.limit_s <= 0 or not waiting or worker.inflight_requests <= 0:
            return 0.0
        # the clock starts when the worker last went busy or last finished a prefill
        since = max(self._last_prefill.get(worker.id, float("-inf")), self._busy_since.get(worker.id, now))
        interval = now - since
        if interval <= self.limit_s:
            return 0.0
        if self.gate == "guarded":
            reports = worker.reported_queue > 0 or worker.reported_running > 0 or worker.kv_utilization > 0
            if reports and worker.kv_utilization < self.kv_saturation:
                return 0.0
            if interval <= self.limit_s + self.longest_prefill_ms(worker.id) / 1000.0:
                return 0.0
        return interval * 1000.0

    def longest_prefill_ms(self, worker_id: str) -> float:
        """Modelled prefill time of the longest prompt in flight on ``worker_id``, ms."""
        prompts = self._inflight.get(worker_id)
        if not prompts:
            return 0.0
        uncached, cached = max(prompts.values())
        return self._prefill_ms(uncached, cached)

    def on_dispatch(self, worker: Worker, request_id: str, uncached: int, cached: int, now: float) -> None:
        if worker.inflight_requests <= 1:  # the host committed this one: the worker was idle
            self._busy_since[worker.id] = now
        if not request_id:
            return
        prompts = self._inflight.setdefault(worker.id, {})
        prompts[request_id] = (uncached, cached)
        if len(prompts) > _MAX_TRACKED_PER_WORKER:
            del prompts[next(iter(prompts))]

    def on_complete(self, worker_id: str, request_id: str, first_token_at: float) -> None:
        prompts = self._inflight.get(worker_id)
        if prompts is not None:
            prompts.pop(request_id, None)
        if first_token_at > self._last_prefill.get(worker_id, float("-inf")):
            self._last_prefill[worker_id] = first_token_at

    def forget_worker(self, worker_id: str) -> None:
        self._last_prefill.pop(worker_id, None)
        self._busy_since.pop(worker_id, None)
        self._inflight.pop(worker_id, None)
