"""Replay a Mooncake-format trace into one cache and report its prefix hit ratio.

    kvrouterd sim cache --trace FILE --eviction lru --capacity-blocks 10000 [--json]
    kvrouterd sim cache --trace FILE --eviction lru --capacity-blocks 100,1000,10000 --out DIR

With several capacities each is replayed in turn; ``--out DIR`` writes ``cache.md`` (the
table), ``results.json`` and ``hit_ratio_vs_capacity.png``.

The cache is the daemon's own: a ``Router`` with one approximate-mode worker of
``--capacity-blocks`` blocks, whose cache model is the real ``RadixIndex`` plus the named
eviction policy built by the policy registry (``LoadLedger._record_access``). Each trace line is
one request, replayed in file order:

1. look up: the request's leading blocks already cached are its hits (a prefix hit: a block
   counts only if every block before it hit too);
2. insert: the hits are touched and the missing blocks stored, all at the request's time;
3. evict: while the worker holds more than its capacity, the policy's victims are removed;
   the request's own blocks are never victims, so a request longer than the cache leaves it
   over capacity until the next one arrives.

Hit ratio = prefix-hit blocks / all prompt blocks. One block per hash id: the id is the
block's key and its parent is the previous id of the same request (Mooncake ids form a
prefix tree; see docs/simulator.md, "The Mooncake trace"). Time is the trace timestamp in seconds,
nudged forward by 1 us where requests share a timestamp so that file order is also recency
order. With these rules LRU reproduces the systematic study's Table 3 (conversation trace:
4.18%, 4.45%, 11.18%, 21.16%, 36.37% at 100, 1k, 5k, 10k, 100k blocks).

The trace has no session ids or task labels. ``--session-block K`` names each request's
session after its K-th hash id (in the conversation trace, block 1 identifies the
conversation, since block 0 is a prompt every request shares); ``--task`` labels every
request. Unlabelled requests are treated as the router treats them (``TaskCategory.resolve``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..clock import ManualClock
from ..errors import ConfigError, KVRouterError
from ..index.workers import WorkerSpec
from ..policies import registry
from ..protocols import CacheMode, Completion, RouteRequest, TaskCategory
from ..router import Router, RouterSettings

__all__ = ["CacheResult", "TraceRequest", "add_arguments", "read_trace", "replay", "run"]

#: Mooncake blocks hold 512 tokens
MOONCAKE_BLOCK_TOKENS = 512
_TIE_STEP_S = 1e-6


@dataclass(slots=True, frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Requests of a Mooncake-format JSONL trace, in file order. Raises ValueError naming the
    line of the first malformed record."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
                    raise ValueError("hash_ids must be a list of non-negative integers")
                yield TraceRequest(float(rec.get("timestamp", 0)), int(rec.get("input_length", 0)),
                                   int(rec.get("output_length", 0)), tuple(ids))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None


@dataclass(slots=True)
class CacheResult:
    eviction: str
    capacity_blocks: int
    #: tokens per block (per hash id): the unit of every block count here
    block_tokens: int
    requests: int
    blocks: int
    hit_blocks: int
    evicted_blocks: int
    elapsed_s: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "eviction": self.eviction, "capacity_blocks": self.capacity_blocks, "block_tokens": self.block_tokens,
            "requests": self.requests, "blocks": self.blocks, "hit_blocks": self.hit_blocks,
            "hit_ratio": self.hit_ratio, "hit_ratio_percent": round(100 * self.hit_ratio, 4),
            "evicted_blocks": self.evicted_blocks, "elapsed_s": round(self.elapsed_s, 3),
        }


def replay(
    trace: Iterator[TraceRequest] | list[TraceRequest],
    eviction: str | Mapping[str, Any],
    capacity_blocks: int,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    session_block: int | None = None,
    task: TaskCategory = TaskCategory.UNSPECIFIED,
    progress: Callable[[int], None] | None = None,
) -> CacheResult:
    """Replay ``trace`` into one cache of ``capacity_blocks`` blocks (0 = unbounded)."""
    if capacity_blocks < 0:
        raise ConfigError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    clock = ManualClock()
    router = Router(
        RouterSettings(block_size=block_tokens, routing={"name": "round_robin"},
                       eviction={"name": eviction} if isinstance(eviction, str) else eviction,
                       max_prompt_tokens=1 << 40),
        clock,
    )
    router.add_worker(WorkerSpec(id="cache", address="sim", capacity_blocks=capacity_blocks,
                                          mode=CacheMode.APPROXIMATE))
    started = time.monotonic()
    requests = blocks = hits = 0
    now = 0.0
    for n, rec in enumerate(trace):
        if not rec.hash_ids:
            continue
        t = rec.timestamp_ms / 1000.0
        now = t if t > now else now + _TIE_STEP_S
        clock.set(now)
        session = ""
        if session_block is not None and len(rec.hash_ids) > session_block:
            session = str(rec.hash_ids[session_block])
        req = RouteRequest(
            request_id=f"r{n}", keys=list(rec.hash_ids), prompt_tokens=len(rec.hash_ids) * block_tokens,
            session_id=session, task=task, expected_output_tokens=rec.output_length,
        )
        result = router.route(req)
        router.complete(Completion(request_id=req.request_id, output_tokens=rec.output_length))
        requests += 1
        blocks += len(rec.hash_ids)
        hits += result.decision.overlap_blocks
        if progress is not None and not requests % 500:
            progress(requests)
    return CacheResult(
        eviction=router.eviction.name, capacity_blocks=capacity_blocks, block_tokens=block_tokens,
        requests=requests, blocks=blocks,
        hit_blocks=hits, evicted_blocks=router.counters["approx_evicted"], elapsed_s=time.monotonic() - started,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, type=Path, metavar="FILE", help="Mooncake-format JSONL trace")
    parser.add_argument("--eviction", required=True, metavar="NAME",
                        help="eviction policy name (see `kvrouterd policies --kind eviction`)")
    parser.add_argument("--eviction-param", action="append", default=[], metavar="KEY=VALUE",
                        help="override one policy parameter with a JSON value (repeatable)")
    parser.add_argument("--capacity-blocks", required=True, type=_capacities, metavar="N[,N..]",
                        help="cache size in blocks (0 = unbounded); a list replays each")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, metavar="N",
                        help=f"tokens per hash id (default {MOONCAKE_BLOCK_TOKENS}, Mooncake's block)")
    parser.add_argument("--session-block", type=int, default=None, metavar="K",
                        help="session id = the K-th hash id of each request (default: no sessions)")
    parser.add_argument("--task", choices=[t.name.lower() for t in TaskCategory], default="unspecified",
                        help="task category of every request")
    parser.add_argument("--json", action="store_true", help="print one JSON object (a list with several capacities)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write cache.md (table), results.json and hit_ratio_vs_capacity.png here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


def _capacities(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block counts like 100,1000, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"capacities must be >= 0, got {text!r}")
    return values


def _eviction_spec(name: str, overrides: list[str]) -> str | dict[str, Any]:
    if not overrides:
        return name
    spec: dict[str, Any] = {"name": name}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--eviction-param expects KEY=VALUE, got {item!r}")
        try:
            spec[key] = json.loads(raw)
        except json.JSONDecodeError:
            spec[key] = raw
    return spec


def _progress_bar(total: int, label: str, out: TextIO) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A tqdm bar on ``out`` (off when it is not a terminal): (update to n done, close)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=label, unit="req", file=out, disable=not out.isatty(), leave=False,
               dynamic_ncols=True)

    def update(done: int) -> None:
        bar.update(done - bar.n)

    return update, bar.close


def run(args: argparse.Namespace) -> int:
    try:
        spec = _eviction_spec(args.eviction, args.eviction_param)
        registry.build("eviction", spec)  # fail on a bad name or parameter before reading the trace
        if args.block_tokens <= 0:
            raise ConfigError(f"--block-tokens must be > 0, got {args.block_tokens}")
        trace = list(read_trace(args.trace))
        results = []
        for capacity in args.capacity_blocks:
            update, close = _progress_bar(len(trace), f"{args.eviction} @ {capacity} blocks",
                                          sys.stderr if not args.quiet else _Silent())
            try:
                results.append(replay(trace, spec, capacity, block_tokens=args.block_tokens,
                                      session_block=args.session_block, task=TaskCategory[args.task.upper()],
                                      progress=update))
            finally:
                close()
    except (KVRouterError, ValueError, OSError) as exc:
        print(f"kvrouterd sim cache: {exc}", file=sys.stderr)
        return 2
    if args.json:
        docs = [r.as_dict() for r in results]
        print(json.dumps(docs[0] if len(docs) == 1 else docs))
    else:
        for result in results:
            capacity = f"{result.capacity_blocks:,} blocks" if result.capacity_blocks else "unbounded"
            print(f"hit ratio {100 * result.hit_ratio:.2f}% ({result.hit_blocks:,} of {result.blocks:,} prompt blocks "
                  f"of {result.block_tokens} tokens, {result.requests:,} requests; eviction {result.eviction}, "
                  f"capacity {capacity}, {result.evicted_blocks:,} evicted, {result.elapsed_s:.1f} s)")
    if args.out is not None:
        from . import report

        meta = {"workload": args.trace.name, "eviction": args.eviction, "block_tokens": args.block_tokens,
                "command": "kvrouterd " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["sim"] else ""}
        for path in report.write_cache([r.as_dict() for r in results], meta, args.out):
            if not args.json:
                print(f"wrote {path}")
    return 0


class _Silent:
    """stderr for --quiet: never a terminal, so the bar stays off."""

    def isatty(self) -> bool:
        return False

    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass
