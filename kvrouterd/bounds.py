"""Physical bounds on every number a client reports, and the checks that hold the core to them.

A client's numbers feed online fits every later decision reads (the latency model, LBGR's
residuals): one ``ttft_ms=1e308`` accepted once made every min-TTFT Route fail from then on
(issue #28 item 1). So each reported number is checked here, in the core, where the daemon's
conversions, the Router and the simulator all meet, and a value that is not finite or lies
beyond what any real deployment produces is INVALID_ARGUMENT naming its field. The bounds are
generous on purpose: they refuse nonsense, not slow hardware.
"""

from __future__ import annotations

from .errors import InvalidRequest, quote
from .protocols import Completion

__all__ = [
    "COMPLETION_BOUNDS",
    "MAX_CACHED_TOKENS",
    "MAX_CAPACITY_BLOCKS",
    "MAX_LATENCY_MS",
    "MAX_OUTPUT_TOKENS",
    "MAX_REPORTED_REQUESTS",
    "check_completion",
    "check_range",
]

#: a day: no first token or whole request of a served LLM takes longer (requests in flight
#: expire after limits.inflight_timeout_s, 300 s by default, long before)
MAX_LATENCY_MS = 86_400_000.0
#: generated tokens of one request: 16.7M, far past any model's context window
MAX_OUTPUT_TOKENS = 1 << 24
#: prompt tokens an engine reports as served from its cache (4.3G: past any context window)
MAX_CACHED_TOKENS = 1 << 32
#: requests one engine reports queued or running (a million: past any engine's batch and queue)
MAX_REPORTED_REQUESTS = 1 << 20
#: a worker's KV-cache capacity in blocks (1.1T blocks: petabytes of KV cache)
MAX_CAPACITY_BLOCKS = 1 << 40


def check_range(name: str, value: float, low: float, high: float) -> None:
    """InvalidRequest naming ``name`` unless ``low <= value <= high`` (NaN is never in range)."""
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be a finite number in [{low:g}, {high:g}], got {quote(value)}")


#: a completion's reported numbers and their bounds, in the order a refusal names the first
#: out of range (``check_completion``)
COMPLETION_BOUNDS: tuple[tuple[str, float, float], ...] = (
    ("ttft_ms", 0.0, MAX_LATENCY_MS),
    ("e2e_ms", 0.0, MAX_LATENCY_MS),
    ("prefill_ms", 0.0, MAX_LATENCY_MS),
    ("kv_transfer_ms", 0.0, MAX_LATENCY_MS),
    ("output_tokens", 0, MAX_OUTPUT_TOKENS),
    ("cached_tokens", -1, MAX_CACHED_TOKENS),
)


def check_completion(done: Completion) -> None:
    """A completion's reported numbers, each within its bound (``COMPLETION_BOUNDS``;
    ``cached_tokens`` -1 = unknown)."""
    # every Complete is checked, at the edge (``convert.completion``) or in the Router: all in
    # range is one test, written out (a loop over the table cost as much as the six calls did),
    # and only a completion that fails it pays for finding which field to name.
    # tests/unit/test_bounds.py holds this test to the table at every edge.
    if (0.0 <= done.ttft_ms <= MAX_LATENCY_MS and 0.0 <= done.e2e_ms <= MAX_LATENCY_MS
            and 0.0 <= done.prefill_ms <= MAX_LATENCY_MS and 0.0 <= done.kv_transfer_ms <= MAX_LATENCY_MS
            and 0 <= done.output_tokens <= MAX_OUTPUT_TOKENS and -1 <= done.cached_tokens <= MAX_CACHED_TOKENS):
        return
    for name, low, high in COMPLETION_BOUNDS:
        check_range(name, getattr(done, name), low, high)
