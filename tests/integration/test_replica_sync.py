"""Two router replicas sharing in-flight load and approximate prefixes over a real NATS
JetStream server (events.bus.replica_sync), driven through their real gRPC ports."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import nats
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc
from kvrouterd.benchmarks.nats_server import NatsServer
from kvrouterd.config import parse_config
from kvrouterd.server.app import Daemon

from .test_metrics_endpoint import _get, sample
from .test_nats_bus import remake_stream

BS = 16
WORKERS = ("gpu-0", "gpu-1", "gpu-2")


class Replica:
    def __init__(self, daemon: Daemon, channel: grpc.aio.Channel) -> None:
        self.daemon = daemon
        self.router = daemon.router
        self.channel = channel
        self.stub = router_pb2_grpc.KVRouterStub(channel)

    def inflight(self) -> dict[str, int]:
        return {w.id: w.inflight_requests for w in self.router.workers}

    def prefill(self) -> dict[str, int]:
        return {w.id: w.pending_prefill_tokens for w in self.router.workers}

    async def stop(self) -> None:
        await self.channel.close()
        await self.daemon.stop(grace=0)


async def start_replica(url: str, *, mode: str = "events", capacity: int = 100_000, seed: int = 1,
                        routing: str = "least_loaded", **settings: object) -> Replica:
    config = {
        "listen": "127.0.0.1:0",
        "block_size": BS,
        "routing": {"name": routing},
        "workers": [{"id": w, "address": f"{w}.local:8000", "capacity_blocks": capacity, "mode": mode}
                    for w in WORKERS],
        "events": {"bus": {"kind": "nats", "url": url, "connect_timeout_s": 2, "snapshot_interval_s": 0}},
        **settings,
    }
    daemon = Daemon(parse_config(config), seed=seed)
    port = await daemon.start()
    return Replica(daemon, grpc.aio.insecure_channel(f"127.0.0.1:{port}"))


@pytest.fixture
async def pair(nats_server: NatsServer) -> AsyncIterator[list[Replica]]:
    started = [await start_replica(nats_server.url, seed=i, metrics={"listen": "127.0.0.1:0"}) for i in (1, 2)]
    try:
        yield started
    finally:
        for r in started:
            await r.stop()


async def settle(replicas: list[Replica], condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Flush every replica's deltas, then wait until ``condition`` holds."""
    for r in replicas:
        assert r.daemon.sync is not None
        await r.daemon.sync.flush()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, [(r.inflight(), r.daemon.sync.stats if r.daemon.sync else None) for r in replicas]
        await asyncio.sleep(0.02)


def prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(blocks * BS)]


async def test_load_routed_on_one_replica_is_seen_and_released_by_the_other(pair: list[Replica]) -> None:
    a, b = pair
    rng = random.Random(1)
    routed = {}
    for i in range(6):
        resp = await a.stub.Route(pb.RouteRequest(request_id=f"req-{i}", token_ids=prompt(rng, 4)))
        routed[resp.request_id] = resp.worker_id
    # least_loaded spreads six uncached prompts two per worker, on A...
    assert sorted(a.inflight().values()) == [2, 2, 2]
    await settle(pair, lambda: b.inflight() == a.inflight() and b.prefill() == a.prefill())
    assert b.router.workers.inflight_count == 6

    # ...and B, seeing A's load, sends its own next prompt to no busier worker than A would
    resp = await b.stub.Route(pb.RouteRequest(request_id="req-b", token_ids=prompt(rng, 4)))
    routed[resp.request_id] = resp.worker_id
    await settle(pair, lambda: a.router.workers.inflight_count == 7)
    assert sorted(b.inflight().values()) == [2, 2, 3] and a.inflight() == b.inflight()

    # a Complete may reach either replica: B releases what A routed, and A follows
    for rid in ["req-0", "req-1", "req-2"]:
        await b.stub.Complete(pb.CompleteRequest(request_id=rid, ttft_ms=40.0, e2e_ms=900.0, success=True))
    await a.stub.Complete(pb.CompleteRequest(request_id="req-b", success=True))
    await settle(pair, lambda: a.router.workers.inflight_count == 3 == b.router.workers.inflight_count)
    assert a.inflight() == b.inflight() and a.prefill() == b.prefill()
    left = {routed[f"req-{i}"] for i in range(3, 6)}
    assert {w for w, n in a.inflight().items() if n} <= left

    # a second Complete of the same request is refused on either replica, as on one
    for replica in pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await replica.stub.Complete(pb.CompleteRequest(request_id="req-0"))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
    for replica in pair:
        assert replica.daemon.sync is not None
        assert replica.daemon.sync.stats.rejected == 0 and replica.daemon.sync.stats.publish_errors == 0
    # what B applied of A's deltas, on B's /metrics
    assert b.daemon.metrics_endpoint is not None
    _, _, text = await asyncio.to_thread(_get, b.daemon.metrics_endpoint.port)
    assert sample(text, "kvrouter_replica_sync_deltas_total", outcome="charged") == 6
    assert sample(text, "kvrouter_replica_sync_deltas_total", outcome="released") == 1
    assert sample(text, "kvrouter_replica_sync_lost_total", reason="publish_error") == 0


async def test_a_complete_that_overtakes_its_dispatch_charges_nothing_anywhere(
    nats_server: NatsServer, pair: list[Replica]
) -> None:
    a, b = pair
    # the gateway completes on B before the routing replica's Dispatch is on the bus: B cannot
    # know the id yet, answers OK and publishes the completion...
    await b.stub.Complete(pb.CompleteRequest(request_id="fast", success=True))
    await settle(pair, lambda: a.daemon.sync is not None and a.daemon.sync.stats.received >= 3)
    # ...so when the Dispatch comes (here from a third replica, written to the stream as one
    # would), neither replica charges it
    nc = await nats.connect(nats_server.url)
    try:
        delta = pb.LoadDelta(replica_id="replica-x", dispatched=pb.Dispatched(
            request_id="fast", worker_id=WORKERS[1], prefill_tokens=32, prompt_tokens=32))
        await nc.publish("kvrouter.load", delta.SerializeToString())
        await nc.flush()
    finally:
        await nc.close()
    await settle(pair, lambda: all(r.router.counters["remote_late_dispatches"] == 1 for r in pair))
    assert a.router.workers.inflight_count == 0 == b.router.workers.inflight_count
    # an id completed on one replica is known as completed on the others too
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await a.stub.Complete(pb.CompleteRequest(request_id="fast"))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND


async def test_a_replica_started_later_replays_the_fleets_in_flight_requests(nats_server: NatsServer) -> None:
    a = await start_replica(nats_server.url)
    try:
        rng = random.Random(3)
        for i in range(5):
            await a.stub.Route(pb.RouteRequest(request_id=f"r{i}", token_ids=prompt(rng, 3)))
        await a.stub.Complete(pb.CompleteRequest(request_id="r0"))
        assert a.daemon.sync is not None
        await a.daemon.sync.flush()
        c = await start_replica(nats_server.url, seed=3)
        try:
            # start() returned: the last inflight_timeout_s of deltas were applied before SERVING
            assert c.inflight() == a.inflight() and c.prefill() == a.prefill()
            assert c.router.workers.inflight_count == 4
            assert c.daemon.sync is not None and c.daemon.sync.stats.replayed >= 6
            # the requests A routed may complete on C, and A releases them
            await c.stub.Complete(pb.CompleteRequest(request_id="r1"))
            await settle([a, c], lambda: a.router.workers.inflight_count == 3 == c.router.workers.inflight_count)
        finally:
            await c.stop()
    finally:
        await a.stop()


async def test_a_lost_complete_stops_counting_everywhere_after_the_timeout(nats_server: NatsServer) -> None:
    fast = {"limits": {"inflight_timeout_s": 0.5}, "tick_interval_s": 0.05}
    a = await start_replica(nats_server.url, **fast)
    b = await start_replica(nats_server.url, seed=2, **fast)
    try:
        await a.stub.Route(pb.RouteRequest(request_id="lost", token_ids=prompt(random.Random(4), 2)))
        await settle([a, b], lambda: b.router.workers.inflight_count == 1)
        await settle([a, b], lambda: a.router.workers.inflight_count == 0 == b.router.workers.inflight_count, 5.0)
        assert a.router.counters["inflight_expired"] == 1 == b.router.counters["inflight_expired"]
    finally:
        await a.stop()
        await b.stop()


def approximate_view(replica: Replica) -> dict[str, set[int]]:
    return {w: {k for k, _, _ in replica.router.export_blocks(w)} for w in WORKERS}


async def test_approximate_views_of_two_replicas_converge(nats_server: NatsServer) -> None:
    # small capacities, so each replica's eviction runs and its victims must reach the other
    cap = 40
    a = await start_replica(nats_server.url, mode="approximate", capacity=cap, routing="cache_aware")
    b = await start_replica(nats_server.url, mode="approximate", capacity=cap, routing="cache_aware", seed=2)
    pair = [a, b]
    try:
        rng = random.Random(5)
        shared = [prompt(rng, 6) for _ in range(8)]  # system prompts many requests start with
        n = 0
        for step in range(120):
            replica = pair[rng.random() < 0.5]
            tokens = rng.choice(shared)[: rng.randint(2, 6) * BS] + prompt(rng, rng.randint(1, 3))
            resp = await replica.stub.Route(pb.RouteRequest(request_id=f"q{n}", token_ids=tokens))
            n += 1
            if step % 3 == 0:
                await pair[rng.random() < 0.5].stub.Complete(pb.CompleteRequest(request_id=resp.request_id))
            if step % 10 == 0:
                await asyncio.sleep(0.01)  # let deltas interleave with local routes

        def converged() -> bool:
            return approximate_view(a) == approximate_view(b) and a.inflight() == b.inflight()

        await settle(pair, converged)
        views = approximate_view(a)
        # a replica evicts down to capacity after its own routes; the other's latest prompt
        # (at most 9 blocks) may sit on top until that worker is next routed to
        assert all(0 < len(v) <= cap + 2 * 9 for v in views.values()), {w: len(v) for w, v in views.items()}
        assert a.router.counters["approx_evicted"] > 0 and b.router.counters["approx_evicted"] > 0
        # the same view means the same cached prefixes, so the same cache-aware scores, everywhere
        for tokens in shared:
            keys = a.router.keys_for_tokens(tokens)
            overlaps = [{w.id: r.router.index.match(keys, w.bit).overlap(w.slot) for w in r.router.workers}
                        for r in pair]
            assert overlaps[0] == overlaps[1]
        assert any(b.router.index.match(a.router.keys_for_tokens(t), (1 << 64) - 1).path for t in shared)
    finally:
        await a.stop()
        await b.stop()


async def test_deltas_published_while_nats_restarts_reach_the_other_replica(
    nats_server: NatsServer, pair: list[Replica]
) -> None:
    a, b = pair
    rng = random.Random(6)
    await a.stub.Route(pb.RouteRequest(request_id="before", token_ids=prompt(rng, 2)))
    await settle(pair, lambda: b.router.workers.inflight_count == 1)
    nats_server.stop()
    # routing goes on without the bus; the deltas wait in the client's reconnect buffer
    for i in range(5):
        await a.stub.Route(pb.RouteRequest(request_id=f"during-{i}", token_ids=prompt(rng, 2)))
    await b.stub.Complete(pb.CompleteRequest(request_id="before"))
    await asyncio.sleep(0.3)
    nats_server.start()
    await settle(pair, lambda: a.inflight() == b.inflight() and a.router.workers.inflight_count == 5, timeout=20)
    assert b.router.workers.inflight_count == 5
    for replica in pair:
        assert replica.daemon.sync is not None
        stats = replica.daemon.sync.stats
        assert stats.reconnects >= 1 and stats.publish_errors == 0 and stats.stream_skips == 0
    # and the consumers follow the stream after the restart
    await b.stub.Route(pb.RouteRequest(request_id="after", token_ids=prompt(rng, 2)))
    await settle(pair, lambda: a.router.workers.inflight_count == 6)



async def _load_follows_a_lost_stream(pair: list[Replica], seed: int, lose: Callable[[], Awaitable[None]],
                                      timeout: float) -> None:
    """Load routed before ``lose`` (the load stream lost, then made again) and after it: each
    replica counts one reset, follows the new stream from sequence 1 (below what it applied of
    the old one), and sees the other's load; /metrics shows the reset."""
    a, b = pair
    rng = random.Random(seed)
    for i in range(3):
        await a.stub.Route(pb.RouteRequest(request_id=f"before-{i}", token_ids=prompt(rng, 2)))
    await settle(pair, lambda: b.router.workers.inflight_count == 3)
    await lose()
    syncs = [r.daemon.sync for r in pair]
    await settle(pair, lambda: all(s is not None and s.stats.stream_resets == 1 for s in syncs), timeout=timeout)
    await b.stub.Route(pb.RouteRequest(request_id="after", token_ids=prompt(rng, 2)))
    await a.stub.Complete(pb.CompleteRequest(request_id="before-0"))
    await settle(pair, lambda: a.router.workers.inflight_count == 3 == b.router.workers.inflight_count, timeout=timeout)
    assert a.inflight() == b.inflight()
    assert b.daemon.metrics_endpoint is not None
    _, _, text = await asyncio.to_thread(_get, b.daemon.metrics_endpoint.port)
    assert sample(text, "kvrouter_replica_sync_lost_total", reason="stream_reset") == 1


async def test_a_nats_restart_without_its_store_is_followed_on_the_new_load_stream(
    nats_server: NatsServer, pair: list[Replica], tmp_path: Path
) -> None:
    """The server comes back without the load stream: each replica creates it again and follows
    it from sequence 1, so load routed after the restart is seen by the other replica."""

    async def restart_without_store() -> None:
        nats_server.stop()
        nats_server.store_dir = tmp_path / "fresh-store"
        nats_server.start()

    await _load_follows_a_lost_stream(pair, 8, restart_without_store, timeout=20)

PD_WORKERS = [{"id": wid, "address": f"{wid}.local:8000", "role": role, "mode": "events"}
              for wid, role in (("pre-0", "prefill"), ("pre-1", "prefill"), ("dec-0", "decode"), ("dec-1", "decode"))]


async def test_the_prefill_hop_of_a_disaggregated_route_is_charged_and_released_on_every_replica(
    nats_server: NatsServer,
) -> None:
    pd = {"workers": PD_WORKERS, "disaggregation": {"mode": "always"}, "metrics": {"listen": "127.0.0.1:0"}}
    a = await start_replica(nats_server.url, **pd)
    b = await start_replica(nats_server.url, seed=2, **pd)
    pair = [a, b]
    try:
        tokens = prompt(random.Random(7), 8)
        resp = await a.stub.Route(pb.RouteRequest(request_id="pd-1", token_ids=tokens))
        assert resp.disaggregated and resp.prefill_uncached_tokens == len(tokens)
        pre, dec = resp.prefill_worker_id, resp.worker_id
        assert a.prefill()[pre] == len(tokens)
        # B sees the prefill worker's charge A made, and the decode worker's request
        await settle(pair, lambda: b.prefill()[pre] == len(tokens))
        assert b.inflight() == a.inflight() and b.prefill() == a.prefill()
        assert b.inflight()[pre] == 1 and b.inflight()[dec] == 1 and b.prefill()[dec] == 0

        # the prefill is done (reported to B this time): both replicas release the prefill
        # worker alone; the decode worker stays charged until the request's Complete
        await b.stub.Complete(pb.CompleteRequest(request_id="pd-1", prefill_ms=35.0, prefill_done=True))
        assert b.prefill()[pre] == 0 and b.inflight()[pre] == 0
        await settle(pair, lambda: a.prefill()[pre] == 0)
        assert a.inflight() == b.inflight() and a.inflight()[dec] == 1 and a.inflight()[pre] == 0
        # a second prefill_done, on either replica, changes nothing
        for replica in pair:
            await replica.stub.Complete(pb.CompleteRequest(request_id="pd-1", prefill_done=True))
        await a.stub.Complete(pb.CompleteRequest(request_id="pd-1", ttft_ms=60.0, e2e_ms=700.0, success=True))
        await settle(pair, lambda: b.router.workers.inflight_count == 0)
        for replica in pair:
            assert all(n == 0 for n in replica.inflight().values()) and all(n == 0 for n in replica.prefill().values())
            assert replica.daemon.sync is not None and replica.daemon.sync.stats.rejected == 0
        assert b.daemon.metrics_endpoint is not None
        _, _, text = await asyncio.to_thread(_get, b.daemon.metrics_endpoint.port)
        assert sample(text, "kvrouter_replica_sync_deltas_total", outcome="charged") == 2  # both hops
        assert a.router.counters["remote_prefill_releases"] == 1
    finally:
        await a.stop()
        await b.stop()


async def test_deadline_admission_on_each_replica_counts_the_prefill_the_other_routed(pair: list[Replica]) -> None:
    """A replica's deadline admission must price a worker's backlog with every replica's
    dispatches: hearing only its own, each of N replicas admitted ~N times what the SLO allows."""
    a, b = pair
    rng = random.Random(3)
    for i in range(6):
        await a.stub.Route(pb.RouteRequest(request_id=f"deep-{i}", token_ids=prompt(rng, 250)))  # 4,000 tokens
    await settle(pair, lambda: b.inflight() == a.inflight())
    guard_a, guard_b = (r.daemon.admission.guard for r in pair)
    assert guard_a is not None and guard_b is not None
    # the same requests, with the same modelled prefill, in both models of each worker's backlog
    assert {w: [(rid, e[0], e[2]) for rid, e in f.items()] for w, f in guard_b._flight.items() if f} == \
           {w: [(rid, e[0], e[2]) for rid, e in f.items()] for w, f in guard_a._flight.items() if f}
    now = b.router.clock.now()
    assert all(guard_b.backlog_ms(w, now) > 0 for w in b.router.workers if w.inflight_requests)
    # and a Complete heard by A reaches B's model too
    for i in range(6):
        await a.stub.Complete(pb.CompleteRequest(request_id=f"deep-{i}", success=True))
    await settle(pair, lambda: b.router.workers.inflight_count == 0)
    assert not any(guard_b._flight.values())


async def test_a_first_token_heard_by_another_replica_reaches_the_routing_replicas_deadline_model(
        pair: list[Replica]) -> None:
    """A gateway may send a request's first-token report (Complete with prefill_done and its
    TTFT) to any replica; the replica that admitted it judges its TTFT against the SLO."""
    a, b = pair
    rng = random.Random(5)
    routed = await a.stub.Route(pb.RouteRequest(request_id="ft-1", token_ids=prompt(rng, 4), ttft_slo_ms=1000.0))
    guard_a = a.daemon.admission.guard
    assert guard_a is not None and "ft-1" in guard_a._judged
    await settle(pair, lambda: b.router.workers.inflight_count == 1)
    await b.stub.Complete(pb.CompleteRequest(request_id=routed.request_id, prefill_done=True, ttft_ms=1500.0))
    await settle(pair, lambda: "ft-1" not in guard_a._judged)
    assert "ft-1" not in guard_a._predicted  # learned once, now: the final Complete teaches nothing twice
    assert a.router.workers.inflight_count == 1  # still decoding until its Complete


async def test_a_load_stream_deleted_and_made_again_while_connected_is_followed_anew(
    nats_server: NatsServer, pair: list[Replica]
) -> None:
    """The connection never drops: the replicas' consumers are gone with the old stream and only
    the once-a-second check can tell; then load routed on one replica is seen by the other."""
    await _load_follows_a_lost_stream(pair, 9, lambda: remake_stream(nats_server.url, "KVROUTER_LOAD"), timeout=8)
    for r in pair:
        assert r.daemon.sync is not None and r.daemon.sync.stats.reconnects == 0
