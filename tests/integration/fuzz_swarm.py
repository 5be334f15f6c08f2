"""A million hostile calls from 16 concurrent clients against ``kvrouterd serve`` in its own process.

The sequential fuzz test (``test_fuzz_grpc.py``) checks the daemon's state after every call; this
swarm checks what only concurrency and volume find (issue #28): membership changes racing
routes and exports, slot reuse, poisoned latency fits meeting other clients' routes, RouteStream
batches whose items fail beside items that succeed. Each client draws, from its own seeded
``random.Random``, either a call of ``fuzz_calls``' hypothesis strategies (a pool drawn once,
seeded, at start) or a call shaped to race: good Routes over every policy and prompt form,
Completes of routed ids with extreme and non-finite numbers, PublishEvents in and out of order,
RegisterWorker/DeregisterWorker churn over a few ids, ExportIndex of those ids, ListWorkers
paging, GetStats, ReportLoad, EvictHint. The prober (``fuzz_probe.py``, its own process) times
an innocent client's Routes throughout. Run::

    PYTHONPATH=$PWD:$PWD/clients/python python -m tests.integration.fuzz_swarm \\
        --calls 1000000 --clients 16 --report /tmp/swarm.json [--seed 1] [--max-seconds 1800]

It prints calls/s on stderr while running, then a table of statuses (RPC x code), RouteStream
item codes, invariant checks and the probe Route's p50/p99/max, and writes them to ``--report``.
It exits 1 (the table's last lines say why) on any UNKNOWN or INTERNAL status or item code, any
DEADLINE_EXCEEDED (a call unanswered within 10 s), an internal error the daemon counted
(``kvrouter_internal_errors_total``, whose tracebacks it logs: printed here), a probe Route that
crashed or hung (one shed by the in-flight budget is only counted), or a broken invariant. Every
``--check-every`` calls, and at the end, the clients pause and the daemon's state is checked from
outside (``swarm_checks.py``):

* ListWorkers, paged, lists ``GetStats.worker_count`` distinct workers in id order;
* ExportIndex of every worker parses: parents before children, each parent held by some worker
  or listed unheld; a worker's blocks number its ``cached_blocks``; the union of held blocks
  numbers ``GetStats.indexed_blocks`` (which counts blocks a registered worker holds);
* an approximate-mode worker holds at most its capacity (issue #28 item 7);
* a Route of every policy names a registered worker that is not draining; between checks, every
  Route answer names a worker some RegisterWorker named, and one of its candidates if it named any;
* the daemon is alive, its resident memory under ``--max-rss-mib``, its open file descriptors
  under ``--max-fds``, and its /metrics count no internal error.

The daemon's ERROR log lines are counted by message in the report (an attack earns some: an
engine endpoint nobody listens on); they fail nothing by themselves.

The suite runs 3,000 calls of it (``test_fuzz_swarm.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.benchmarks.harness import channel as open_channel
from kvrouterd.benchmarks.harness import table_lines
from kvrouterd.benchmarks.serve_process import ServeProcess
from kvrouterd.index.keys import tokens_to_bytes

from .fuzz_calls import (
    BS, CALL_TIMEOUT_S, CODE_NAMES, DAEMON_CONFIG, EXTREME_FLOATS, PROBE, Prober, hostile_call, invoke, poisoning,
)
from .swarm_checks import check_state, internal_errors

#: every routing policy the daemon is configured with ("" = its default)
POLICIES = ["", "cache_aware", "dualmap", "lbgr", "min_ttft", "kv_cost", "preble", "round_robin", "compose"]
#: workers registered for the whole run (w0 approximate, w1 event-driven)
STEADY = ["w0", "w1"]
#: ids the clients register and deregister, racing each other's routes, events and exports
CHURN = [f"c{i}" for i in range(6)]
#: a Route or an item code that is never right: a crash (UNKNOWN, INTERNAL) or a hang
FAILING = {"UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"}
#: numbers a client may report: sane ones (the bounds included), and the ones that once poisoned
#: routing for everyone, drawn in one field of about one call in eight, so most calls are
#: accepted and build the state the hostile ones then meet
SANE_FLOATS = [0.0, 1.0, 35.0, 900.0, 86_400_000.0]
SANE_INTS = [0, 1, 64, 2**24]
HUGE_INTS = [2**24 + 1, 2**31 - 1, 2**32 - 1]
HOSTILE_SHARE = 0.04
#: the fuzz test's daemon, its routed requests expiring after 10 s: the sweep races the calls,
#: and Routes whose Complete was refused do not fill the in-flight budget for good
SWARM_CONFIG: dict[str, Any] = {**DAEMON_CONFIG, "limits": {**DAEMON_CONFIG["limits"], "inflight_timeout_s": 10.0},
                                "metrics": {"listen": "127.0.0.1:0"}}
#: prompts the good Routes and stored events share, so routes hit cached blocks
PROMPTS = [list(range(p * 1000, p * 1000 + n * BS)) for p, n in enumerate([2, 4, 8, 16, 3, 6])]


def draw_pool(size: int, seed_value: int) -> list[list[tuple[str, Any]]]:
    """``size`` groups of hostile calls (one call, or an attack of several) from ``fuzz_calls``'
    strategies, the same for the same seed."""
    pool: list[list[tuple[str, Any]]] = []

    @seed(seed_value)
    @settings(max_examples=size, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(hostile_call.map(lambda call: [call]), poisoning))
    def collect(group: list[tuple[str, Any]]) -> None:
        pool.append(group)

    collect()
    return pool


class Gate:
    """Lets the clients call until the checker asks for quiet, then waits for their calls in
    flight to end: the state checks see the daemon with nothing changing it but the prober."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def enter(self) -> None:
        await self._open.wait()
        self._active += 1
        self._idle.clear()

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def quiesce(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def reopen(self) -> None:
        self._open.set()


class Tally:
    """Every call's status by RPC, RouteStream items' codes, and the broken invariants."""

    def __init__(self) -> None:
        self.calls = 0
        self.statuses: Counter[tuple[str, str]] = Counter()
        self.item_codes: Counter[str] = Counter()
        self.violations: list[str] = []
        self.failures: list[str] = []
        self.checks = 0
        self.peak_rss_mib = 0.0
        self.peak_fds = 0
        #: what the last state check saw: workers, blocks indexed, blocks exported
        self.last_check: dict[str, int] = {}
        self.slowest_call_s = 0.0
        self.slowest_call = ""

    def count(self, rpc: str, code: grpc.StatusCode, took: float, what: Callable[[], str]) -> None:
        self.calls += 1
        self.statuses[(rpc, code.name)] += 1
        if took > self.slowest_call_s:
            self.slowest_call_s, self.slowest_call = took, rpc
        if code.name in FAILING and len(self.failures) < 50:
            self.failures.append(f"{rpc} answered {code.name}: {what()[:300]}")

    def items(self, rpc: str, codes: list[int]) -> None:
        for c in codes:
            name = CODE_NAMES.get(c, str(c))
            self.item_codes[name] += 1
            if name in FAILING - {"DEADLINE_EXCEEDED"} and len(self.failures) < 50:
                # an item's DEADLINE_EXCEEDED is its own timeout_ms, which the client chose
                self.failures.append(f"{rpc} item answered {name}")

    def violate(self, what: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(what)


class Fleet:
    """The worker ids a Route may name: every id a RegisterWorker was ever sent for."""

    def __init__(self) -> None:
        self.ever: set[str] = set(STEADY) | {PROBE}

    def check_route(self, tally: Tally, request: pb.RouteRequest, reply: pb.RouteResponse) -> None:
        if reply.worker_id not in self.ever:
            tally.violate(f"Route answered {reply.worker_id!r}, never registered")
        elif request.candidate_workers and reply.worker_id not in request.candidate_workers:
            tally.violate(f"Route answered {reply.worker_id!r}, not among its candidates "
                          f"{list(request.candidate_workers)}")


class Client:
    """One of the swarm's clients: a connection of its own and a seeded stream of calls."""

    def __init__(self, n: int, port: int, seed_value: int, pool: list[list[tuple[str, Any]]], tally: Tally,
                 fleet: Fleet, gate: Gate) -> None:
        self.n = n
        self.rng = random.Random(seed_value * 1000 + n)
        self.channel = open_channel(port)
        self.stub = router_pb2_grpc.KVRouterStub(self.channel)
        self.pool, self.tally, self.fleet, self.gate = pool, tally, fleet, gate
        self.routed: list[str] = []
        self.sequences: dict[str, int] = {}
        self.made = 0
        #: each kind of call, and how many in 100 draws are of it
        self.actions: list[tuple[Callable[[], Any], int]] = [
            (self.hostile, 30), (self.route, 20), (self.complete, 8), (self.stream, 10), (self.events, 10),
            (self.churn, 6), (self.export, 4), (self.load, 6), (self.list_workers, 3), (self.stats, 3)]
        self._choices = [a for a, _ in self.actions]
        self._weights = [w for _, w in self.actions]

    async def run(self, budget: Callable[[], bool]) -> None:
        try:
            while budget():
                await self.gate.enter()
                try:
                    await self.rng.choices(self._choices, self._weights)[0]()
                finally:
                    self.gate.leave()
        finally:
            await self.channel.close()

    async def call(self, rpc: str, fn: Callable[[], Any], describe: Callable[[], str]) -> Any:
        """``fn()`` awaited and counted under ``rpc``; its reply, or None if it failed."""
        started = time.perf_counter()
        try:
            reply = await fn()
        except grpc.aio.AioRpcError as exc:
            details = exc.details()  # ``exc`` is unbound after the handler; the lambda runs later
            self.tally.count(rpc, exc.code(), time.perf_counter() - started, lambda: f"{describe()} ({details})")
            return None
        self.tally.count(rpc, grpc.StatusCode.OK, time.perf_counter() - started, describe)
        return reply

    def fresh_id(self) -> str:
        self.made += 1
        return f"s{self.n}-{self.made}"

    def number(self) -> float:
        """A float field's value: now and then one of ``EXTREME_FLOATS``."""
        return self.rng.choice(EXTREME_FLOATS if self.rng.random() < HOSTILE_SHARE else SANE_FLOATS)

    def count(self) -> int:
        """An integer field's value: now and then past its bound."""
        return self.rng.choice(HUGE_INTS if self.rng.random() < HOSTILE_SHARE else SANE_INTS)

    # ---- the calls -----------------------------------------------------------------------------

    async def hostile(self) -> None:
        for method, message in self.rng.choice(self.pool):
            if method == "RegisterWorker":
                # before the call: a Route of another client may name it before this one hears OK
                self.fleet.ever.add(message.worker.id)
            started = time.perf_counter()
            code, codes = await invoke(self.channel, method, message)
            self.tally.count(method, code, time.perf_counter() - started, lambda m=message: str(m)[:300])
            self.tally.items(method, codes)

    def route_request(self) -> pb.RouteRequest:
        rng = self.rng
        prompt = rng.choice(PROMPTS)[: rng.randrange(1, 17) * BS + rng.choice([0, 0, 5])]
        msg = pb.RouteRequest(request_id=self.fresh_id(), policy=rng.choice(POLICIES),
                              ttft_slo_ms=self.number(), expected_output_tokens=self.count())
        form = rng.choice(["tokens", "packed", "keys"])
        if form == "tokens":
            msg.token_ids.extend(prompt)
        elif form == "packed":
            msg.token_ids_le32 = tokens_to_bytes(prompt)
        else:
            msg.block_keys.extend(rng.getrandbits(64) for _ in range(rng.randrange(1, 12)))
            msg.prompt_tokens = rng.choice([0, len(msg.block_keys) * BS]) if rng.random() > HOSTILE_SHARE else 2**32 - 1
        if rng.random() < 0.3:
            msg.candidate_workers.extend(rng.sample([*STEADY, *CHURN, "ghost"], rng.randrange(1, 4)))
        return msg

    async def route(self) -> None:
        msg = self.route_request()
        reply = await self.call("Route", lambda: self.stub.Route(msg, timeout=CALL_TIMEOUT_S), msg.__str__)
        if reply is not None:
            self.fleet.check_route(self.tally, msg, reply)
            self.routed.append(reply.request_id)
            del self.routed[:-64]

    def complete_request(self) -> pb.CompleteRequest:
        rng = self.rng
        # mostly a routed request; now and then one never routed
        routed = self.routed and rng.random() < 0.9
        rid = self.routed.pop(rng.randrange(len(self.routed))) if routed else self.fresh_id()
        return pb.CompleteRequest(request_id=rid, ttft_ms=self.number(), e2e_ms=self.number(),
                                  output_tokens=self.count(), cached_tokens=rng.choice(
                                      [2**63 - 1, -(2**63)] if rng.random() < HOSTILE_SHARE else [-1, 0, 5]),
                                  success=rng.random() < 0.8, session_ended=rng.random() < 0.1)

    async def complete(self) -> None:
        msg = self.complete_request()
        await self.call("Complete", lambda: self.stub.Complete(msg, timeout=CALL_TIMEOUT_S), msg.__str__)

    async def stream(self) -> None:
        """A batch of good Routes, Routes that fail (no such policy, only unknown candidates, no
        prompt), Completes with hostile numbers and empty items; every item answered on its own."""
        rng = self.rng
        items: list[pb.RouteStreamRequest] = []
        routes: dict[int, pb.RouteRequest] = {}
        for i in range(rng.randrange(1, 24)):
            kind = rng.choice(["route", "route", "bad_policy", "bad_candidates", "empty_prompt", "complete", "none"])
            if kind == "complete":
                items.append(pb.RouteStreamRequest(id=i, complete=self.complete_request()))
                continue
            if kind == "none":
                items.append(pb.RouteStreamRequest(id=i))
                continue
            msg = self.route_request()
            if kind == "bad_policy":
                msg.policy = "nope"
            elif kind == "bad_candidates":
                del msg.candidate_workers[:]
                msg.candidate_workers.append("ghost-" + str(i))
            elif kind == "empty_prompt":
                msg.ClearField("token_ids")
                msg.ClearField("token_ids_le32")
                del msg.block_keys[:]
            routes[i] = msg
            items.append(pb.RouteStreamRequest(id=i, route=msg, timeout_ms=self.rng.choice(
                [0.0, 0.0, 1.0, 1000.0] if rng.random() > HOSTILE_SHARE else EXTREME_FLOATS)))
        message = pb.RouteStreamRequest(id=10_000, batch=pb.RouteStreamRequestBatch(items=items))
        answers: list[pb.RouteStreamResponse] = []

        async def run() -> None:
            async for r in self.stub.RouteStream(iter([message]), timeout=CALL_TIMEOUT_S):
                answers.extend(r.batch.items if r.WhichOneof("kind") == "batch" else [r])

        await self.call("RouteStream", run, lambda: f"batch of {len(items)}")
        self.tally.items("RouteStream", [a.error.code for a in answers])
        for a in answers:
            if a.WhichOneof("kind") == "route" and a.id in routes:
                self.fleet.check_route(self.tally, routes[a.id], a.route)
                self.routed.append(a.route.request_id)
        del self.routed[:-64]

    async def events(self) -> None:
        """A batch for an event-driven worker: the next sequence, a repeat, a gap, a restart (0),
        or a huge one; stored chains of the shared prompts, removals, clears, malformed events."""
        rng = self.rng
        wid = rng.choice(["w1", *CHURN])
        last = self.sequences.get(wid, -1)
        sequence = rng.choice([last + 1, last + 1, last + 1, max(last, 0), last + 3, 0, 2**64 - 1])
        self.sequences[wid] = sequence if sequence < 2**63 else last
        events = []
        for _ in range(rng.randrange(1, 4)):
            kind = rng.choice(["stored", "stored", "stored", "removed", "cleared", "malformed"])
            if kind == "stored":
                prompt = rng.choice(PROMPTS)
                start = rng.randrange(0, len(prompt) // BS)
                end = rng.randrange(start + 1, len(prompt) // BS + 1)
                ev = pb.StoredBlocks(engine_hashes=[hash((prompt[0], b)) & (2**64 - 1) for b in range(start, end)])
                ev.token_ids_le32 = tokens_to_bytes(prompt[start * BS:end * BS])
                if start:
                    ev.parent_engine_hash = hash((prompt[0], start - 1)) & (2**64 - 1)
                events.append(pb.CacheEvent(stored=ev))
            elif kind == "removed":
                prompt = rng.choice(PROMPTS)
                events.append(pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[
                    hash((prompt[0], b)) & (2**64 - 1) for b in rng.sample(range(len(prompt) // BS), 1)])))
            elif kind == "cleared":
                events.append(pb.CacheEvent(cleared=pb.AllBlocksCleared()))
            else:
                # token count not a multiple of the hashes', or a length no uint32 divides
                packed = b"\x01\x02\x03" if rng.random() < 0.5 else tokens_to_bytes([1] * 17)
                events.append(pb.CacheEvent(stored=pb.StoredBlocks(engine_hashes=[1, 2], token_ids_le32=packed)))
        batch = pb.EventBatch(worker_id=wid, sequence=sequence, events=events, timestamp=self.number())
        await self.call("PublishEvents", lambda: self.stub.PublishEvents(iter([batch]), timeout=CALL_TIMEOUT_S),
                        batch.__str__)

    async def churn(self) -> None:
        rng = self.rng
        wid = rng.choice(CHURN)
        if rng.random() < 0.5:
            await self.call("DeregisterWorker", lambda: self.stub.DeregisterWorker(
                pb.DeregisterWorkerRequest(worker_id=wid), timeout=CALL_TIMEOUT_S), lambda: wid)
            return
        mode = rng.choice([pb.CACHE_STATE_MODE_EVENTS, pb.CACHE_STATE_MODE_APPROXIMATE])
        worker = pb.Worker(id=wid, address=f"10.1.0.{CHURN.index(wid)}:8000", mode=mode,
                           capacity_blocks=rng.choice([0, 1, 8, 200]), labels={"zone": rng.choice("ab")})
        self.fleet.ever.add(wid)  # before the call, as in ``hostile``
        reply = await self.call("RegisterWorker", lambda: self.stub.RegisterWorker(
            pb.RegisterWorkerRequest(worker=worker), timeout=CALL_TIMEOUT_S), worker.__str__)
        if reply is not None:
            self.sequences.pop(wid, None)

    async def export(self) -> None:
        ids = self.rng.sample([*STEADY, *CHURN], self.rng.randrange(1, 4))
        request = pb.ExportIndexRequest(worker_ids=ids, max_blocks_per_chunk=self.rng.choice([0, 1, 3]))

        async def run() -> None:
            async for _ in self.stub.ExportIndex(request, timeout=CALL_TIMEOUT_S):
                pass

        await self.call("ExportIndex", run, request.__str__)

    async def load(self) -> None:
        rng = self.rng
        wid = rng.choice([*STEADY, *CHURN, "ghost"])
        if rng.random() < 0.6:
            msg = pb.ReportLoadRequest(worker_id=wid, queued_requests=self.count(), running_requests=self.count(),
                                       kv_utilization=rng.choice([0.0, 0.5, 1.0]) if rng.random() > HOSTILE_SHARE
                                       else rng.choice(EXTREME_FLOATS))
            await self.call("ReportLoad", lambda: self.stub.ReportLoad(msg, timeout=CALL_TIMEOUT_S), msg.__str__)
            return
        hint = pb.EvictHintRequest(worker_id=wid, blocks=rng.choice([0, 1, 8, 64, 2**32 - 1]),
                                   tokens=self.count(), policy=rng.choice(["", "lru", "unicache", "tlru"]),
                                   pinned_keys=[rng.getrandbits(64) for _ in range(rng.randrange(0, 3))])
        await self.call("EvictHint", lambda: self.stub.EvictHint(hint, timeout=CALL_TIMEOUT_S), hint.__str__)

    async def list_workers(self) -> None:
        token = self.rng.choice(["", "", "", "zz", "\x00", "c3", "x" * 300])
        size = self.rng.choice([0, 1, 2, 5, 2**32 - 1])
        for _ in range(64):
            reply = await self.call("ListWorkers", lambda: self.stub.ListWorkers(
                pb.ListWorkersRequest(page_size=size, page_token=token), timeout=CALL_TIMEOUT_S), lambda: repr(token))
            if reply is None or not reply.next_page_token:
                return
            token = reply.next_page_token

    async def stats(self) -> None:
        await self.call("GetStats", lambda: self.stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S),
                        lambda: "")


async def check(stub: Any, daemon: ServeProcess, tally: Tally, args: argparse.Namespace) -> None:
    """``swarm_checks.check_state`` now; what it finds broken goes to ``tally``."""
    tally.checks += 1
    found = await check_state(stub, daemon, prompt=PROMPTS[2], policies=POLICIES, max_rss_mib=args.max_rss_mib,
                              max_fds=args.max_fds,
                              approximate_capacity=SWARM_CONFIG["limits"]["approximate_capacity_blocks"])
    for what in found.violations:
        tally.violate(f"check {tally.checks} (after {tally.calls} calls): {what}")
    tally.last_check = found.saw
    tally.peak_rss_mib = max(tally.peak_rss_mib, found.rss_mib)
    tally.peak_fds = max(tally.peak_fds, found.fds)


# ---- the run -----------------------------------------------------------------------------------

async def swarm(args: argparse.Namespace, daemon: ServeProcess, workdir: Path) -> dict[str, Any]:
    """Clients calling until ``args.calls`` (or ``args.max_seconds``), checks every
    ``args.check_every`` calls and at the end; the report."""
    drawn = time.perf_counter()
    pool = draw_pool(args.pool, args.seed)
    print(f"drew {len(pool)} hostile call groups in {time.perf_counter() - drawn:.1f} s", file=sys.stderr)
    tally, fleet, gate = Tally(), Fleet(), Gate()
    async with open_channel(daemon.port) as control:
        stub = router_pb2_grpc.KVRouterStub(control)
        for i, wid in enumerate(STEADY):
            await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                id=wid, address=f"10.0.0.{i}:8000", capacity_blocks=200,
                mode=pb.CACHE_STATE_MODE_EVENTS if i else pb.CACHE_STATE_MODE_APPROXIMATE)))
        await stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
            id=PROBE, address="10.9.9.9:8000", mode=pb.CACHE_STATE_MODE_EVENTS)))
        prober = Prober(daemon.port, workdir / "probe.json")
        started = time.perf_counter()
        deadline = started + args.max_seconds

        def budget() -> bool:
            return tally.calls < args.calls and time.perf_counter() < deadline

        clients = [Client(n, daemon.port, args.seed, pool, tally, fleet, gate) for n in range(args.clients)]
        tasks = [asyncio.create_task(c.run(budget)) for c in clients]
        next_check = args.check_every
        last = (started, 0)
        try:
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=0.1)
                now = time.perf_counter()
                if now - last[0] >= 2.0:
                    rate = (tally.calls - last[1]) / (now - last[0])
                    last = (now, tally.calls)
                    print(f"{tally.calls:>9} calls  {rate:7.0f} calls/s  {now - started:6.0f} s", file=sys.stderr)
                if tally.calls >= next_check and not all(t.done() for t in tasks):
                    await gate.quiesce()
                    await check(stub, daemon, tally, args)
                    gate.reopen()
                    next_check = tally.calls + args.check_every
            for t in tasks:
                t.result()
            wall = time.perf_counter() - started
            await check(stub, daemon, tally, args)
        finally:
            probes, probe_statuses = prober.stop()
    return report(tally, wall, probes, probe_statuses, daemon)


def report(tally: Tally, wall: float, probes: list[tuple[float, float]], probe_statuses: dict[str, int],
           daemon: ServeProcess) -> dict[str, Any]:
    lat = sorted(took for _, took in probes)

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 2) if lat else math.nan

    statuses: dict[str, dict[str, int]] = {}
    for (rpc, code), n in sorted(tally.statuses.items()):
        statuses.setdefault(rpc, {})[code] = n
    internal = internal_errors(daemon.metrics_port)
    errors = [line for line in daemon.warnings if '"level": "error"' in line]
    # ERROR lines an attack may earn (an engine endpoint nobody listens on) are not failures by
    # themselves; counted by message, they show one that is (a subscriber out of sockets)
    error_lines = Counter(json.loads(line).get("msg", "")[:120] if line.startswith("{") else line[:120]
                          for line in errors)
    why = [*tally.failures, *tally.violations]
    # the innocent client may be shed (RESOURCE_EXHAUSTED: the hostile ones fill the small
    # in-flight budget), never crash or hang
    why += [f"probe Routes answered {code}: {n}" for code, n in probe_statuses.items() if code in FAILING]
    if internal and not any("internal errors" in v for v in tally.violations):
        why.append(f"the daemon counted internal errors {internal}")
    return {"calls": tally.calls, "wall_s": round(wall, 1), "calls_per_s": round(tally.calls / wall),
            "statuses": statuses, "route_stream_item_codes": dict(tally.item_codes.most_common()),
            "state_checks": tally.checks, "last_check_saw": tally.last_check,
            "daemon_peak_rss_mib": round(tally.peak_rss_mib), "daemon_peak_fds": tally.peak_fds,
            "internal_errors_total": internal,
            "slowest_call_ms": round(tally.slowest_call_s * 1000, 1), "slowest_call": tally.slowest_call,
            "probe_routes": len(lat), "probe_route_statuses": probe_statuses,
            "probe_route_ms": {"p50": pct(0.5), "p99": pct(0.99), "p999": pct(0.999), "max": pct(1.0)},
            "daemon_error_lines": dict(error_lines.most_common(20)), "daemon_error_log": errors[:10],
            "failed_because": why}


def print_report(found: dict[str, Any]) -> None:
    codes = sorted({c for per in found["statuses"].values() for c in per}, key=lambda c: (c != "OK", c))
    rows = [["rpc", *codes, "total"]]
    for rpc, per in found["statuses"].items():
        rows.append([rpc, *(str(per.get(c, "")) for c in codes), str(sum(per.values()))])
    print(f"{found['calls']} calls in {found['wall_s']} s ({found['calls_per_s']} calls/s), "
          f"{found['state_checks']} state checks (the last saw {found['last_check_saw']}), "
          f"daemon peak RSS {found['daemon_peak_rss_mib']} MiB, {found['daemon_peak_fds']} open fds")
    for line in table_lines(rows, right_from=1, rule=True):
        print(line)
    print("RouteStream item codes:", ", ".join(f"{c} {n}" for c, n in found["route_stream_item_codes"].items()))
    p = found["probe_route_ms"]
    print(f"probe Routes: {found['probe_routes']} {found['probe_route_statuses']}, "
          f"ms p50 {p['p50']} p99 {p['p99']} p99.9 {p['p999']} max {p['max']}")
    print(f"kvrouter_internal_errors_total: {found['internal_errors_total'] or 0}")
    for msg, n in found["daemon_error_lines"].items():
        print(f"daemon ERROR log lines: {n} x {msg}")
    if found["failed_because"]:
        print("FAILED:")
        for line in found["failed_because"]:
            print("  " + line)
        for line in found["daemon_error_log"]:
            print("  daemon: " + line[:4000])
    else:
        print("OK: no UNKNOWN, INTERNAL or DEADLINE_EXCEEDED, every invariant held")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The daemon started in its own process, the swarm run against it, the daemon stopped."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        config = workdir / "swarm-daemon.yaml"
        config.write_text(yaml.safe_dump({"listen": "127.0.0.1:0", **SWARM_CONFIG}))
        daemon = ServeProcess(config)
        daemon.start()
        try:
            return asyncio.run(swarm(args, daemon, workdir))
        finally:
            daemon.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1_000_000, help="calls to make, all clients together")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients, each on its own connection")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pool", type=int, default=2000, help="groups of hostile calls drawn from the strategies")
    p.add_argument("--check-every", type=int, default=50_000, help="calls between state checks")
    p.add_argument("--max-seconds", type=float, default=math.inf, help="stop sooner, after this long")
    p.add_argument("--max-rss-mib", type=float, default=2048.0, help="the daemon's resident memory bound")
    p.add_argument("--max-fds", type=int, default=1024, help="the daemon's open file descriptors bound")
    p.add_argument("--report", default="", help="write the report here (json)")
    return p


def main() -> None:
    args = parser().parse_args()
    found = run(args)
    print_report(found)
    if args.report:
        Path(args.report).write_text(json.dumps(found, indent=2))
    sys.exit(1 if found["failed_because"] else 0)


if __name__ == "__main__":
    main()
