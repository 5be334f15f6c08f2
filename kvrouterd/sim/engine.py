"""A simulated inference engine: prefix cache, continuous batching, and the events it publishes.

Each ``SimEngine`` stands in for one vLLM/SGLang worker behind the router:

- **KV cache.** ``capacity_blocks`` blocks (0 = unbounded) holding prompt blocks as a prefix
  tree: the engine's own ``RadixIndex`` (one slot) and its own eviction policy object, which
  the host builds from the same spec the router uses (``policy_specs.build_eviction``: the
  policy registry's, or the simulator's clairvoyant ``belady``, which hears each admission
  through its ``admitting`` hook). Blocks of admitted and
  unfinished requests are pinned. By default generated tokens are not cached and their KV
  does not count against the capacity (the workloads put a turn's answer into the next
  turn's prompt, where it is cached as prompt); with ``cache_decode`` (``--cache-decode``)
  a finished request's generated tokens are cached as vLLM caches them: the full blocks
  they fill (``SimRequest.output_block_ids``, the ids a session's next prompt carries for
  the answer) are stored under the prompt's last full block, marked decode
  (``AccessInfo.decode_from_block``), if the policy can make room. A prompt whose last
  block is partial caches that block too, as the Mooncake trace's hash ids do.
- **Scheduling.** FCFS continuous batching with chunked prefill. A request is *admitted* when
  its uncached blocks fit: the engine looks its prompt up in its own cache, evicts unpinned
  blocks chosen by the policy to make room for the rest, and reserves that room; if the
  policy cannot free enough (everything pinned) the request and those behind it wait. Each
  step prefills up to ``max_batch_tokens`` tokens over the admitted requests in order, at
  most ``max_running`` requests run at once.
- **Time.** A step lasts the prefill time of its tokens, ``policies.latency.PrefillCost``, the
  very function the routers' latency model evaluates: ``power_law`` (the default,
  ``a * batch^b * (tokens / batch)^c``) or ``linear`` (``intercept + ms_per_1k * tokens /
  1000``, ``--prefill-model linear``), plus the attention of each chunk's tokens to the context
  before it (its request's cached prefix, attended but not recomputed, and earlier chunks):
  ``token_ms * sum(chunk * context) / attention_context_tokens``. The power-law defaults are
  UniCache's fit for Llama-3.1-8B on an H100 (``policies.latency.H100_LLAMA31_8B``, appendix
  A.1, Fig. 14: ``3.59e-5 s * BS^0.991 * L^1.018``, ~40.7 ms per 1k tokens at batch 1; the
  linear default of 40 ms per 1k is that fit at batch 1); ``attention_context_tokens`` =
  30,632 is Llama-3.1-8B's from FLOP counts, so a single-chunk prompt with nothing cached costs
  the fit and a 128k-token prompt 2.9x its chunks priced alone (``--attention-context-tokens
  0``: per-chunk pricing, the model before issue #27; calibration and sources in
  ``policies.latency``). ``hardware_speed`` divides every compute time, prefill and decode
  (``--hardware-speed 2``: a GPU twice as fast), so the ratio of an SLO to prefill times can
  match a paper's setup; the routers' profiled model (``latency_fields``) is scaled alike.
  A request's first token comes when its last prefill chunk completes.
- **Decoding** (``decode_model``). ``batched`` (the default) runs it in the engine's own steps,
  as vLLM/Sarathi chunked prefill does: every step generates one token for each request past
  its first token and lasts the prefill time of its chunk plus ``tpot_ms * (1 +
  decode_batch_slope * (D - 1))`` for its D decoding requests, so decodes slow prefill (TTFT)
  and prefill chunks slow decodes (TPOT). ``tpot_ms`` = 20 ms is our assumption for an 8B
  model (UniCache section 3 models TPOT as a constant measured mean it does not publish). The
  slope is not in the papers; 0.02 is derived from memory traffic: a decode step reads the
  weights once (16 GB for Llama-3.1-8B in bf16) and each request's KV (2 x 32 layers x 8 KV
  heads x 128 dims x 2 bytes = 128 KiB per token, 1 GiB at an 8k-token context): at H100's
  3.35 TB/s one more request at 8k context adds ~0.32 ms, 0.02 x tpot_ms after the ~20%
  bandwidth real kernels leave unused. ``constant`` (``--decode-model constant``, UniCache's
  model) charges ``tpot_ms`` per output token beside the engine, never slowing prefill.
- **KV memory pressure from decoding** (``decode_kv``, on by default, batched only:
  ``--no-decode-kv`` turns it off): each request's
  generated tokens take KV blocks as they fill them (counted in ``reserved``); before a step,
  a decoding request whose next token starts a block claims one, evicting an unpinned cached
  block through the policy if the cache is full, else **preempting** the newest decoding
  request as vLLM's scheduler does (recompute mode): its KV is freed and it goes back to the
  head of the waiting queue, to prefill its prompt's missing part plus what it had generated
  before decoding on (its first token, and TTFT, stay as they were). Without it a full cache
  only makes new requests wait (running requests' KV never grows).
- **Events.** Evictions publish ``Removed`` (at admission, when memory is claimed); a
  finished prefill publishes ``Stored`` for the request's new blocks, with our block keys
  as engine hashes, exactly what a real engine using the kvrouterd SDK sends. The host
  (``cluster``) numbers them into ``EventBatch``es and delivers, delays or drops them.

Parameters (``EngineParams``): ``capacity_blocks`` = 0, ``max_batch_tokens`` = 8192 (vLLM's
chunked-prefill default budget), ``max_running`` = 256 (vLLM's max_num_seqs),
``prefill_model`` = "power_law", ``prefill_ms_per_1k_tokens`` = 40.0, ``prefill_intercept_ms`` =
0.0, ``power_a_ms`` = 0.0359, ``power_b`` = 0.991, ``power_c`` = 1.018,
``attention_context_tokens`` = 30632 (``LLAMA31_8B_ATTENTION_TOKENS``), ``hardware_speed`` =
1.0, ``tpot_ms`` = 20.0, ``cache_decode`` = False, ``decode_model`` = "batched",
``decode_batch_slope`` = 0.02, ``decode_kv`` = True. ``PER_CHUNK`` holds the pricing before
issue #27 (no attention to earlier context, constant decoding, no decode KV), for tests and
results that pin it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from ..index.radix import RadixIndex
from ..policies.base import AccessInfo, EvictionContext, EvictionPolicy, drop_blocks
from ..policies.latency import H100_LLAMA31_8B, LATENCY_FIELDS, LLAMA31_8B_ATTENTION_TOKENS, PrefillCost
from ..protocols import CacheEvent, Removed, Stored
from .workloads import SimRequest

__all__ = ["PER_CHUNK", "EngineParams", "FleetMemory", "Job", "PooledEngine", "SimEngine"]


@dataclass(frozen=True)
class EngineParams:
    capacity_blocks: int = field(default=0, metadata={"help": "KV cache size in blocks (0 = unbounded)"})
    max_batch_tokens: int = field(default=8192, metadata={"help": "prefill tokens per step (chunked prefill budget)"})
    max_running: int = field(default=256, metadata={"help": "requests admitted at once (prefilling or decoding)"})
    prefill_model: Literal["linear", "power_law"] = field(default="power_law", metadata={"help": "step time model"})
    prefill_ms_per_1k_tokens: float = field(default=40.0, metadata={"help": "linear: ms per 1,000 prefill tokens"})
    prefill_intercept_ms: float = field(default=0.0, metadata={"help": "linear: fixed ms per step"})
    power_a_ms: float = field(default=H100_LLAMA31_8B.a_ms, metadata={"help": "power law: a, in ms"})
    power_b: float = field(default=H100_LLAMA31_8B.b, metadata={"help": "power law: batch exponent b"})
    power_c: float = field(default=H100_LLAMA31_8B.c, metadata={"help": "power law: length exponent c"})
    attention_context_tokens: float = field(default=LLAMA31_8B_ATTENTION_TOKENS, metadata={
        "help": "context at which a token's attention to earlier context costs as much as its linear layers "
                "(0 = per-chunk pricing)"})
    hardware_speed: float = field(default=1.0, metadata={"help": "divides every compute time (2 = twice as fast)"})
    tpot_ms: float = field(default=20.0, metadata={"help": "ms per output token after the first"})
    cache_decode: bool = field(default=False, metadata={
        "help": "cache a finished request's generated tokens (the full blocks they fill), as vLLM does"})
    decode_model: Literal["constant", "batched"] = field(default="batched", metadata={
        "help": "constant: tpot_ms per token beside the engine, never slowing prefill; batched: decode runs in the "
                "engine's steps, one token per decoding request per step, and shares each step with prefill"})
    decode_batch_slope: float = field(default=0.02, metadata={
        "help": "batched: a decode step of D requests lasts tpot_ms * (1 + slope * (D - 1))"})
    decode_kv: bool = field(default=True, metadata={
        "help": "batched: generated tokens take KV blocks; a decode step that finds no room evicts, else "
                "preempts the newest decoding request (vLLM's recompute) instead of waiting"})

    def validate(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {self.capacity_blocks}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.prefill_model not in ("linear", "power_law"):
            raise ValueError(f"prefill_model must be linear or power_law, got {self.prefill_model!r}")
        if self.prefill_ms_per_1k_tokens <= 0:
            raise ValueError(f"prefill_ms_per_1k_tokens must be > 0, got {self.prefill_ms_per_1k_tokens}")
        if self.prefill_intercept_ms < 0:
            raise ValueError(f"prefill_intercept_ms must be >= 0, got {self.prefill_intercept_ms}")
        if self.power_a_ms <= 0 or self.power_c <= 0:
            raise ValueError("power_a_ms and power_c must be > 0")
        if self.attention_context_tokens < 0:
            raise ValueError(f"attention_context_tokens must be >= 0, got {self.attention_context_tokens}")
        if not self.hardware_speed > 0:
            raise ValueError(f"hardware_speed must be > 0, got {self.hardware_speed}")
        if self.tpot_ms < 0:
            raise ValueError(f"tpot_ms must be >= 0, got {self.tpot_ms}")
        if self.decode_model not in ("constant", "batched"):
            raise ValueError(f"decode_model must be constant or batched, got {self.decode_model!r}")
        if self.decode_batch_slope < 0:
            raise ValueError(f"decode_batch_slope must be >= 0, got {self.decode_batch_slope}")
        if self.decode_model == "batched" and self.tpot_ms <= 0:
            raise ValueError("decode_model batched needs tpot_ms > 0 (a decode step must take time)")
        # decode_kv with constant decoding does nothing: its generated tokens never enter the engine

    def step_seconds(self, tokens: int, batch: int, attended: float = 0.0) -> float:
        """Duration of one prefill step of ``tokens`` tokens over ``batch`` requests whose tokens
        attend to ``attended`` (new token, earlier-context token) pairs outside their chunks."""
        return self.prefill_cost.ms(tokens, batch, attended) / 1000.0

    @cached_property
    def prefill_cost(self) -> PrefillCost:
        """The step-time function, built from ``latency_fields`` so that a router profiling
        these engines evaluates the very same one."""
        f = self.latency_fields()
        return PrefillCost(f["prefill_model"], f["prefill_ms_per_1k_tokens"], f["prefill_intercept_ms"],
                           f["power_a_ms"], f["power_b"], f["power_c"], f["attention_context_tokens"])

    def latency_fields(self) -> dict[str, Any]:
        """This engine's cost model as ``LatencyParams`` fields: what a router that profiled
        it would configure (``sim.policy_specs.profiled_spec``), its times scaled by ``hardware_speed``."""
        fields = {name: getattr(self, name) for name in LATENCY_FIELDS if name != "prefill_chunk_tokens"}
        for name in ("prefill_ms_per_1k_tokens", "prefill_intercept_ms", "power_a_ms"):
            fields[name] /= self.hardware_speed  # a power law's a scales every time it gives
        fields["prefill_chunk_tokens"] = self.max_batch_tokens
        return fields

    def decode_step_seconds(self, decoding: int) -> float:
        """Decode share of one step generating a token for each of ``decoding`` requests (with
        ``decoding`` = 1, the constant model's time per token)."""
        if decoding <= 0:
            return 0.0
        return self.tpot_ms * (1.0 + self.decode_batch_slope * (decoding - 1)) / 1000.0 / self.hardware_speed


#: the engines' pricing before issue #27: chunks priced alone (no attention to earlier
#: context), decoding beside the engine at a constant tpot, generated tokens taking no KV
PER_CHUNK: dict[str, Any] = {"attention_context_tokens": 0.0, "decode_model": "constant", "decode_batch_slope": 0.0,
                             "decode_kv": False}


class Job:
    """One request on an engine, from routing to its last token."""

    __slots__ = (
        "admitted_at",
        "cached",
        "context_end",
        "decode_blocks",
        "first_hit_blocks",
        "preemptions",
        "est_uncached",
        "first_token_at",
        "hit_blocks",
        "index",
        "keys",
        "output_keys",
        "pinned",
        "remaining",
        "req",
        "reserved",
        "route_overlap",
        "tokens_left",
    )

    def __init__(self, index: int, req: SimRequest, keys: list[int], est_uncached: int, route_overlap: int,
                 output_keys: list[int] | None = None) -> None:
        self.index = index
        self.req = req
        self.keys = keys
        #: keys of the full blocks the request's generated tokens fill (cached with ``cache_decode``)
        self.output_keys = output_keys or []
        self.est_uncached = est_uncached
        self.route_overlap = route_overlap
        self.hit_blocks = 0
        #: prefix-hit blocks at the first admission (what the request's metrics report)
        self.first_hit_blocks = 0
        self.remaining = 0
        #: tokens in the request's context once its prefill completes (its prompt, and what a
        #: preempted request had generated): a chunk follows ``context_end - remaining`` of them
        self.context_end = 0
        self.reserved = 0
        self.pinned: list[int] = []
        self.cached = True
        self.admitted_at = -1.0
        self.first_token_at = -1.0
        #: batched decoding: output tokens still to generate
        self.tokens_left = 0
        #: decode_kv: blocks the generated tokens hold (counted in the engine's ``reserved``)
        self.decode_blocks = 0
        self.preemptions = 0


class SimEngine:
    """One simulated worker. The host calls ``enqueue``, ``start_step``, ``finish_step`` and
    ``finish`` at the right simulated times and drains ``outbox`` after each call."""

    def __init__(self, worker_id: str, params: EngineParams, policy: EvictionPolicy, block_tokens: int,
                 block_bytes: Callable[[int], bytes]) -> None:
        params.validate()
        self.worker_id = worker_id
        self.params = params
        self.block_tokens = block_tokens
        self._block_bytes = block_bytes
        self.index = RadixIndex()
        self.index.add_slot(0)
        self.policy = policy
        #: a clairvoyant policy's hook (``sim.belady``): the workload index of each request admitted
        self._admitting: Callable[[int], None] | None = getattr(policy, "admitting", None)
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []
        self.running = 0
        self.reserved = 0
        self.pins: dict[int, int] = {}
        self.busy = False
        self._step: list[tuple[Job, int]] = []
        #: batched decoding: requests past their first token, and those the last step finished
        self.decoding: list[Job] = []
        self._step_decodes = 0
        self.finished: list[Job] = []
        #: prefill tokens queued or in progress (router's estimate for those not yet admitted)
        self.pending_tokens = 0
        self.outbox: list[CacheEvent] = []
        self.hit_blocks = 0
        self.prompt_blocks = 0
        self.evicted_blocks = 0
        self.rank_calls = 0
        self.rank_seconds = 0.0
        self.peak_blocks = 0
        self.uncacheable = 0
        self.preempted = 0

    # ---- what the host calls -----------------------------------------------------------
    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.pending_tokens += job.est_uncached

    def start_step(self, now: float) -> float | None:
        """Admit what fits and start a prefill step; its duration, or None if idle."""
        budget = self.params.max_batch_tokens
        step: list[tuple[Job, int]] = []
        attended = 0  # (new token, earlier-context token) pairs: each chunk attends to what precedes it
        for job in self.prefilling:
            if budget <= 0:
                break
            chunk = min(job.remaining, budget)
            step.append((job, chunk))
            attended += chunk * max(job.context_end - job.remaining, 0)
            budget -= chunk
        while budget > 0 and self.waiting and self.running < self.params.max_running:
            job = self.waiting[0]
            if not self._admit(job, now):
                break
            self.waiting.popleft()
            self.prefilling.append(job)
            chunk = min(job.remaining, budget)
            step.append((job, chunk))
            attended += chunk * max(job.context_end - job.remaining, 0)
            budget -= chunk
        if self.params.decode_kv and self.decoding:
            self._claim_decode_blocks(now)
        decodes = len(self.decoding)
        if not step and not decodes:
            return None
        self._step = step
        self._step_decodes = decodes
        self.busy = True
        prefill = self.params.step_seconds(self.params.max_batch_tokens - budget, len(step), attended) if step else 0.0
        # a mixed step (Sarathi/vLLM chunked prefill) carries the decodes and the prefill chunk
        return prefill + self.params.decode_step_seconds(decodes)

    def finish_step(self, now: float) -> list[Job]:
        """The running step ended at ``now``: the requests whose prefill completed."""
        done: list[Job] = []
        for job, chunk in self._step:
            job.remaining -= chunk
            self.pending_tokens -= chunk
            if job.remaining == 0:
                if not job.preemptions:
                    job.first_token_at = now
                done.append(job)
                self._store(job, now)
        if done:
            self.prefilling = [j for j in self.prefilling if j.remaining > 0]
        if self.params.decode_model == "batched":
            # the requests decoding when the step began got one token each
            still = []
            for job in self.decoding[:self._step_decodes]:
                job.tokens_left -= 1
                (still if job.tokens_left > 0 else self.finished).append(job)
            still += self.decoding[self._step_decodes:]
            for job in done:
                # the first token; after a preemption, the recompute's prefill yields the next one
                job.tokens_left = max(job.req.output_tokens - 1, 0) if not job.preemptions else job.tokens_left - 1
                (still if job.tokens_left > 0 else self.finished).append(job)
            self.decoding = still
        self._step = []
        self._step_decodes = 0
        self.busy = False
        return done

    def finish(self, job: Job, now: float | None = None) -> None:
        """The request's last token is out: with ``cache_decode`` the blocks its generated
        tokens filled join the cache (as decode blocks, if room can be made), then its blocks
        are no longer pinned."""
        self.reserved -= job.decode_blocks
        job.decode_blocks = 0
        if self.params.cache_decode and job.output_keys and job.cached and now is not None:
            self._store_output(job, now)
        pins = self.pins
        for k in job.pinned:
            n = pins[k] - 1
            if n:
                pins[k] = n
            else:
                del pins[k]
        job.pinned = []
        self.running -= 1

    def receive(self, req: SimRequest, keys: list[int], now: float) -> None:
        """A prefill engine sent the KV of ``req``'s prompt (``sim.pd``): the blocks this engine
        lacks are cached as if prefilled here (evicting to make room) and published as Stored,
        as vLLM's decode instances publish the blocks they receive. No room: nothing is cached
        and the request prefills here when admitted."""
        index = self.index
        hit = index.match(keys, 1).overlap(0)
        cap = self.params.capacity_blocks
        if hit == len(keys) or (cap and len(keys) > cap):
            return
        if cap and (need := index.count(0) + self.reserved + len(keys) - hit - cap) > 0 and not self._evict(need, keys, now):
            return
        parent = keys[hit - 1] if hit else None
        blocks = index.store(0, parent, keys[hit:], now)
        self.policy.on_stored(index, 0, blocks, AccessInfo(req.session_id, int(req.task), req.input_tokens, hit), now)
        bb = self._block_bytes
        self.outbox.append(Stored(b"".join(bb(h) for h in req.block_ids[hit:]), None, parent, self.block_tokens))
        self.peak_blocks = max(self.peak_blocks, index.count(0))

    def held_keys(self) -> set[int]:
        return {b.key for b in self.index.blocks_of(0)}

    @property
    def cached_blocks(self) -> int:
        return self.index.count(0)

    @property
    def used_blocks(self) -> int:
        """Blocks requests hold: cached blocks pinned by admitted requests, plus the room reserved
        for their prompt blocks not yet stored and their generated tokens. Cached blocks no request
        holds are not counted: vLLM keeps them in its free queue, evicted lazily, so its KV usage
        (``vllm/v1/core/block_pool.py``, ``BlockPool.get_usage``: 1 - free / total) leaves them out."""
        holds = self.index.holds
        return sum(1 for k in self.pins if holds(0, k)) + self.reserved

    # ---- internals ---------------------------------------------------------------------
    def _admit(self, job: Job, now: float) -> bool:
        keys = job.keys
        index = self.index
        match = index.match(keys, 1)
        hit = match.overlap(0)
        new = len(keys) - hit
        cap = self.params.capacity_blocks
        cached = not cap or len(keys) <= cap
        if cached and cap:
            need = index.count(0) + self.reserved + new - cap
            if need > 0 and not self._evict(need, keys, now):
                return False
        if self._admitting is not None:
            self._admitting(job.index)  # before the touch, so the prefix is scored past this use
        req = job.req
        matched = match.path[:hit]
        if matched:
            index.touch_path(0, matched, now)
            self.policy.on_accessed(index, 0, matched, AccessInfo(req.session_id, int(req.task), req.input_tokens), now)
        if not job.preemptions:
            job.first_hit_blocks = hit
        job.hit_blocks = hit
        job.cached = cached
        job.reserved = new if cached else 0
        self.reserved += job.reserved
        job.pinned = keys if cached else keys[:hit]
        pins = self.pins
        for k in job.pinned:
            pins[k] = pins.get(k, 0) + 1
        # a preempted request recomputes its prompt's missing part and what it had generated
        generated = req.output_tokens - job.tokens_left if job.preemptions else 0
        job.remaining = max(1, req.input_tokens - hit * self.block_tokens) + generated
        job.context_end = max(req.input_tokens, 1) + generated
        job.admitted_at = now
        self.pending_tokens += job.remaining - job.est_uncached
        self.running += 1
        self.hit_blocks += hit
        self.prompt_blocks += len(keys)
        if not cached:
            self.uncacheable += 1
        return True

    def _claim_decode_blocks(self, now: float) -> None:
        """decode_kv: every decoding request whose next token starts a block gets one, evicting
        unpinned cached blocks if needed; when none can go, the newest decoding request is
        preempted (its KV freed, it recomputes later) until the rest fit, as vLLM does."""
        bs, cap = self.block_tokens, self.params.capacity_blocks
        for job in list(self.decoding):
            if job not in self.decoding:
                continue  # preempted below for an older request
            generated = job.req.output_tokens - job.tokens_left  # tokens out so far, the next included
            want = -(-(job.req.input_tokens + generated) // bs) - -(-job.req.input_tokens // bs)
            while want > job.decode_blocks:
                if not cap or self.index.count(0) + self.reserved < cap or self._evict(1, job.keys, now):
                    job.decode_blocks += 1
                    self.reserved += 1
                    continue
                victim = max(self.decoding, key=lambda j: (j.admitted_at, j.index))
                self._preempt(victim)
                if victim is job:
                    break

    def _preempt(self, job: Job) -> None:
        self.decoding.remove(job)
        self.reserved -= job.decode_blocks
        job.decode_blocks = 0
        pins = self.pins
        for k in job.pinned:
            n = pins[k] - 1
            if n:
                pins[k] = n
            else:
                del pins[k]
        job.pinned = []
        job.preemptions += 1
        job.est_uncached = 0
        self.running -= 1
        self.preempted += 1
        self.waiting.appendleft(job)  # vLLM puts a preempted request at the head of the queue

    def _evict(self, need: int, keys: list[int], now: float) -> bool:
        pinned = frozenset(self.pins).union(keys)
        started = time.perf_counter()
        victims = self.policy.rank(EvictionContext(self.index, 0, now, self.worker_id), need, pinned)
        self.rank_seconds += time.perf_counter() - started
        self.rank_calls += 1
        if len(victims) < need:
            return False
        drop_blocks(self.policy, self.index, 0, victims)
        self.evicted_blocks += len(victims)
        self.outbox.append(Removed(tuple(b.key for b in victims)))
        return True

    def _store_output(self, job: Job, now: float) -> None:
        req = job.req
        full = req.input_tokens // self.block_tokens  # the prompt's full blocks; its partial tail is not reused
        if full == 0 or not self.index.holds(0, job.keys[full - 1]):
            return
        keys = job.output_keys
        cap = self.params.capacity_blocks
        if cap:
            new = sum(not self.index.holds(0, k) for k in keys)  # a session's next turn may have stored them
            need = self.index.count(0) + self.reserved + new - cap
            if need > 0 and not self._evict(need, job.keys, now):
                return  # no room: the answer is simply not cached
        parent = job.keys[full - 1]
        blocks = self.index.store(0, parent, keys, now)
        self.policy.on_stored(self.index, 0, blocks, AccessInfo(req.session_id, int(req.task), req.input_tokens, full,
                                                                 decode_from_block=full), now)
        bb = self._block_bytes
        self.outbox.append(Stored(b"".join(bb(h) for h in req.output_block_ids), None, parent, self.block_tokens))
        self.peak_blocks = max(self.peak_blocks, self.index.count(0))

    def _store(self, job: Job, now: float) -> None:
        self.reserved -= job.reserved
        job.reserved = 0
        if not job.cached:
            return
        hit, keys = job.hit_blocks, job.keys
        if hit == len(keys):
            return
        parent = keys[hit - 1] if hit else None
        req = job.req
        blocks = self.index.store(0, parent, keys[hit:], now)
        self.policy.on_stored(self.index, 0, blocks, AccessInfo(req.session_id, int(req.task), req.input_tokens, hit), now)
        bb = self._block_bytes
        self.outbox.append(Stored(b"".join(bb(h) for h in req.block_ids[hit:]), None, parent, self.block_tokens))
        count = self.index.count(0)
        self.peak_blocks = max(self.peak_blocks, count)


class FleetMemory:
    """One KV memory for a whole fleet: a bound, not a fleet (``ClusterSettings.shared_cache``).

    Every engine reads and fills one prefix cache of the fleet's summed capacity, and its
    requests pin and reserve room in it. So any prefix any engine computed is a hit on all of
    them, no block is held twice, and no engine runs out of room while another has some:
    the most reuse and the best memory balance any routing of separate engines could reach.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.index = RadixIndex()
        self.index.add_slot(0)
        self.policy = policy
        self.pins: dict[int, int] = {}
        self.reserved = 0


class PooledEngine(SimEngine):
    """An engine whose KV memory is the fleet's ``FleetMemory``: its cache, its pins and its
    reserved room are the pool's (``params.capacity_blocks`` is the pool's size); its queue,
    its batches and its compute stay its own."""

    def __init__(self, worker_id: str, params: EngineParams, memory: FleetMemory, block_tokens: int,
                 block_bytes: Callable[[int], bytes]) -> None:
        self._memory = memory  # before the base class sets ``reserved``
        super().__init__(worker_id, params, memory.policy, block_tokens, block_bytes)
        self.index = memory.index
        self.pins = memory.pins

    @property  # type: ignore[override]
    def reserved(self) -> int:
        return self._memory.reserved

    @reserved.setter
    def reserved(self, value: int) -> None:
        self._memory.reserved = value
