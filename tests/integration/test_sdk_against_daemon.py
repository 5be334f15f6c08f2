"""The SDK driving the real daemon (in-process, 127.0.0.1:0) the way gateways and engines do."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import grpc
import pytest

from kvrouter_client import (
    CacheMode,
    EventPublisher,
    RouterClient,
    RouterRejected,
    RouterUnavailable,
    SyncRouterClient,
    WorkerState,
    keys,
)
from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.config import parse_config
from kvrouterd.protocols import WorkerState as CoreWorkerState
from kvrouterd.server.app import Daemon

BS = 16


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def target(running) -> str:
    return f"127.0.0.1:{running.daemon.port}"


async def test_engines_publish_and_the_gateway_routes_to_the_cached_prefix(running):
    p = prompt(1000, 12)
    async with EventPublisher(target(running), "a", block_size=BS, timeout=2.0) as a, \
            EventPublisher(target(running), "b", block_size=BS, timeout=2.0) as b:
        info = await a.register("a.local:8000", capacity_blocks=1000)
        assert info.mode is CacheMode.EVENTS and info.state is WorkerState.READY
        await b.register("b.local:8000", capacity_blocks=1000)
        # a caches 10 blocks of the prompt in two chained events; b caches 2
        a.stored(p[: 4 * BS], engine_hashes=[1, 2, 3, 4])
        a.stored(p[4 * BS : 10 * BS], engine_hashes=[5, 6, 7, 8, 9, 10], parent_engine_hash=4)
        b.stored(p[: 2 * BS], engine_hashes=[91, 92])
        assert await a.flush(timeout=5) and await b.flush(timeout=5)

        async with RouterClient(target(running), timeout=2.0) as gw:
            choice = await gw.route(p + [1, 2, 3], session_id="s1")
            assert (choice.worker_id, choice.worker_address) == ("a", "a.local:8000")
            assert choice.matched_blocks == 10 and choice.prompt_blocks == 12 and not choice.fallback
            # the same prompt as SDK-computed block keys matches identically
            by_keys = await gw.route(block_keys=keys.block_keys(p, BS), prompt_tokens=len(p))
            assert by_keys.worker_id == "a" and by_keys.matched_blocks == 10
            assert running.router.workers.get("a").inflight_requests == 2
            assert await gw.complete(choice, ttft_ms=50.0, e2e_ms=400.0, output_tokens=20)
            assert await gw.complete(by_keys)
            assert running.router.workers.get("a").inflight_requests == 0

        # a evicts its tail: removal by engine hash; b now holds the longest prefix of the first blocks
        a.removed([3, 4, 5, 6, 7, 8, 9, 10])
        assert await a.flush(timeout=5)
        async with RouterClient(target(running), timeout=2.0) as gw:
            assert (await gw.route(prompt(1000, 2))).matched_blocks == 2
        assert running.router.index.count(running.router.workers.get("a").slot) == 2


async def test_publisher_using_router_keys_as_hashes_and_eviction_advice(running):
    p = prompt(5000, 6)
    ks = keys.block_keys(p, BS)
    async with EventPublisher(target(running), "k", block_size=BS, timeout=2.0) as pub:
        await pub.register("k.local:8000", capacity_blocks=100)
        pub.stored(p)  # no engine hashes: our hashes are kvrouterd keys
        assert await pub.flush(timeout=5)
        advice = await pub.evict_hint(blocks=2)
        assert advice.keys == [ks[-1], ks[-2]]  # the prompt's tail, leaf first
        assert advice.engine_hashes == advice.keys and not advice.exhausted
        pub.removed(advice.keys)
        assert await pub.flush(timeout=5)
        worker = running.router.workers.get("k")
        assert running.router.index.count(worker.slot) == 4
        await pub.report_load(queued=3, running=7, kv_utilization=0.5)
        assert (worker.reported_queue, worker.reported_running, worker.kv_utilization) == (3, 7, 0.5)
        await pub.deregister()
        assert "k" not in running.router.workers


async def test_sync_gateway_client(running):
    import asyncio

    async with EventPublisher(target(running), "s", block_size=BS, timeout=2.0) as pub:
        await pub.register("s.local:8000")

    def gateway() -> tuple[str, bool]:
        with SyncRouterClient(target(running), timeout=2.0) as gw:
            choice = gw.route(prompt(0, 3), model="m")
            return choice.worker_id, gw.complete(choice, ttft_ms=5.0)

    assert await asyncio.to_thread(gateway) == ("s", True)


@pytest.mark.parametrize("streams", [4, 0])
async def test_a_typo_in_candidate_workers_raises_even_with_a_fallback(running, streams):
    """Issue #29 item 10: UNAVAILABLE made the client fail open, so a typo sent every request
    to the fallback unseen. NOT_FOUND is a rejection; a known but draining worker still fails open."""
    async with EventPublisher(target(running), "gpu-1", block_size=BS, timeout=2.0) as pub:
        await pub.register("gpu-1.local:8000")

    def fallback(request: pb.RouteRequest) -> tuple[str, str]:
        return "local", "127.0.0.1:9000"

    async with RouterClient(target(running), timeout=2.0, streams=streams, fallback=fallback) as gw:
        with pytest.raises(RouterRejected, match="gpu-9") as typo:
            await gw.route(prompt(0, 3), candidate_workers=["gpu-9"])
        assert typo.value.code is grpc.StatusCode.NOT_FOUND
        running.router.set_draining("gpu-1", True)
        assert (await gw.route(prompt(0, 3), candidate_workers=["gpu-1"])).fallback

    def sync_typo() -> grpc.StatusCode | None:
        with SyncRouterClient(target(running), timeout=2.0, fallback=fallback) as gw:
            try:
                gw.route(prompt(0, 3), candidate_workers=["gpu-9"])
            except RouterRejected as err:
                return err.code
        return None

    assert await asyncio.to_thread(sync_typo) is grpc.StatusCode.NOT_FOUND


async def test_events_published_before_registration_arrive_once_registered(running):
    import asyncio

    p = prompt(7000, 3)
    async with EventPublisher(target(running), "late", block_size=BS, timeout=2.0, reconnect_initial_s=0.02,
                              reconnect_max_s=0.05) as pub:
        pub.stored(p, engine_hashes=[1, 2, 3])  # the router does not know "late" yet: NOT_FOUND, retried
        while pub.stats.reconnects == 0:
            await asyncio.sleep(0.01)
        await pub.register("late.local:8000")
        assert await pub.flush(timeout=5)
    worker = running.router.workers.get("late")
    assert running.router.index.count(worker.slot) == 3 and worker.state is CoreWorkerState.READY
    assert pub.stats.rejected == 0


async def test_router_started_after_the_engine_receives_everything_buffered():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pub = EventPublisher(f"127.0.0.1:{port}", "early", block_size=BS, timeout=2.0, reconnect_initial_s=0.02,
                         reconnect_max_s=0.1, max_batch_events=1, linger_s=0.0)
    await pub.start()
    daemon = Daemon(parse_config({"listen": f"127.0.0.1:{port}"}), seed=1)
    try:
        for i in range(5):
            pub.stored(prompt(100 * i, 1), engine_hashes=[i + 1])
        assert not await pub.flush(timeout=0.3)  # nobody is listening yet
        assert pub.unacknowledged_batches == 5
        await daemon.start()
        await until_registered(pub, "early.local:8000")
        assert await pub.flush(timeout=10)
        worker = daemon.router.workers.get("early")
        assert running_count(daemon, worker) == 5 and worker.state is CoreWorkerState.READY
    finally:
        await pub.close()
        await daemon.stop(grace=0.2)


async def until_registered(pub: EventPublisher, address: str) -> None:
    """What an engine does at start: register, retrying while the router is not up yet."""
    import asyncio

    for _ in range(100):
        try:
            await pub.register(address)
            return
        except RouterUnavailable:
            await asyncio.sleep(0.05)
    raise AssertionError("router never became reachable")


def running_count(daemon: Daemon, worker) -> int:  # type: ignore[no-untyped-def]
    return daemon.router.index.count(worker.slot)


@pytest.fixture
def daemon_config() -> dict:
    return {"block_size": BS}


class TestCoalescedCalls:
    @pytest.fixture
    def daemon_config(self) -> dict:
        return {"block_size": BS, "limits": {"max_message_bytes": 1 << 20}}

    async def test_concurrent_calls_batched_on_one_stream_are_each_decided_traced_and_completed(self, running):
        p = prompt(7000, 8)
        async with EventPublisher(target(running), "a", block_size=BS, timeout=2.0) as a:
            await a.register("a.local:8000", capacity_blocks=1000)
            await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="b", address="b.local:8000")))
            a.stored(p, engine_hashes=list(range(1, 9)))
            assert await a.flush(timeout=5)
        async with RouterClient(target(running), timeout=2.0, streams=1) as gw:
            await gw.complete(await gw.route(p))
            # the stream read the daemon's advertisement: batches below limits.off_loop_prompt_bytes
            # (the default 256 KiB; its message size limit, 1 MiB here, is larger)
            (stream,) = gw._streams._streams  # type: ignore[union-attr]
            assert stream is not None and stream.batch_limit == (256 << 10) - 1
            routed = await asyncio.gather(*(gw.route(p, request_id=f"r{i}", session_id=f"s{i}") for i in range(30)))
            assert [(r.request_id, r.worker_id, r.matched_blocks) for r in routed] == [(f"r{i}", "a", 8) for i in range(30)]
            assert running.router.workers.get("a").inflight_requests == 30
            assert all(await asyncio.gather(*(gw.complete(r) for r in routed)))
            assert running.router.workers.inflight_count == 0
            # a bad call among good ones is refused alone
            good, bad = await asyncio.gather(gw.route(p, request_id="ok"), gw.route(p, policy="nope"), return_exceptions=True)
            assert good.worker_id == "a" and isinstance(bad, RouterRejected)
        spans = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
        assert len(spans) == 33  # one per decision, batched or not


class TestBurstsBelowTheOffLoopThreshold:
    """A burst of ordinary Routes is batched into messages upb parses whole on the loop; only a
    Route whose own prompt reaches ``limits.off_loop_prompt_bytes`` is split and hashed off it."""

    @pytest.fixture
    def daemon_config(self) -> dict:
        return {"block_size": BS, "limits": {"off_loop_prompt_bytes": 64 << 10}}

    async def test_a_burst_larger_than_the_threshold_is_never_split_and_a_huge_route_still_is(self, running):
        service = running.daemon.service
        hashed_off_loop: list[int] = []
        hash_wire_prompt = service.hash_prompt

        def counted(split, *args):  # type: ignore[no-untyped-def]
            hashed_off_loop.append(split.prompt.size)
            return hash_wire_prompt(split, *args)

        service.hash_prompt = counted
        await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="a.local:8000")))
        ordinary = prompt(0, 250)  # 16,000 bytes packed: 40 of them are 640,000
        huge = prompt(10_000, 1100)  # 70,400 bytes packed: over the threshold alone
        async with RouterClient(target(running), timeout=5.0, streams=1) as gw:
            await gw.complete(await gw.route(ordinary))  # the stream is open, the advertisement read
            (stream,) = gw._streams._streams  # type: ignore[union-attr]
            assert stream is not None and stream.batch_limit == (64 << 10) - 1
            batches_before = running.daemon.metrics.stream_batches.value
            routed = await asyncio.gather(*(gw.route(ordinary, request_id=f"r{i}") for i in range(40)))
            assert [r.worker_id for r in routed] == ["a"] * 40
            assert all(await asyncio.gather(*(gw.complete(r) for r in routed)))
            assert hashed_off_loop == []
            # the burst went batched, in several messages, none of them reaching the threshold
            assert running.daemon.metrics.stream_batches.value - batches_before >= 10
            alone = await gw.route(huge)
            assert alone.worker_id == "a" and alone.prompt_blocks == 1100
            assert await gw.complete(alone)
        assert hashed_off_loop == [len(huge) * 4]


class TestBlockKeysFromTheGateway:
    """``RouterClient(send_block_keys=True)`` and Routes given as ``block_keys``: the same
    decisions, errors and load as the same prompts given as token ids."""

    @staticmethod
    async def twin_daemons(stack, config: dict):  # type: ignore[no-untyped-def]
        """Two daemons of one config and seed, the same workers and cached blocks in each."""
        daemons = []
        for _ in range(2):
            daemon = Daemon(parse_config({"listen": "127.0.0.1:0", **config}), seed=1)
            await daemon.start()
            stack.push_async_callback(daemon.stop, 0.5)
            daemons.append(daemon)
            for worker, model, lora, blocks in (("a", "m", "", 10), ("b", "m", "sql", 6), ("c", "", "", 4)):
                async with EventPublisher(f"127.0.0.1:{daemon.port}", worker, block_size=BS, timeout=2.0) as pub:
                    await pub.register(f"{worker}.local:8000", capacity_blocks=1000)
                    pub.stored(prompt(1000, blocks), model=model, lora=lora)
                    assert await pub.flush(timeout=5)
        return daemons

    @staticmethod
    def decided(result) -> tuple:  # type: ignore[no-untyped-def]
        """Everything a Route answers but its request id (each daemon makes up its own)."""
        return dataclasses.replace(result, request_id="")

    async def test_the_sdk_sending_block_keys_routes_exactly_as_token_ids(self, monkeypatch):
        from contextlib import AsyncExitStack

        from kvrouterd.server import convert

        keyed_routes = []
        as_array = convert.block_keys
        monkeypatch.setattr(convert, "block_keys", lambda field: keyed_routes.append(len(field)) or as_array(field))
        calls = [  # (token ids, route() keywords): namespaces, a partial last block, no full block, over the limit
            (prompt(1000, 12), {"model": "m"}),
            (prompt(1000, 12) + [7, 8, 9], {"model": "m", "session_id": "s"}),
            (prompt(1000, 8), {"model": "m", "lora": "sql"}),
            (prompt(1000, 8), {}),
            (prompt(1000, 8), {"model": "other"}),
            (prompt(1000, 3), {"model": "m", "candidate_workers": ["b", "c"]}),
            (list(range(5)), {"model": "m"}),
            (prompt(1000, 300), {"model": "m"}),
            (prompt(1000, 12), {"model": "m", "policy": "nope"}),
        ]
        async with AsyncExitStack() as stack:
            plain_daemon, keyed_daemon = await self.twin_daemons(stack, {"block_size": BS, "limits": {
                "max_prompt_tokens": 4096}})
            plain = await stack.enter_async_context(RouterClient(f"127.0.0.1:{plain_daemon.port}", timeout=2.0,
                                                                streams=1))
            keyed = await stack.enter_async_context(RouterClient(f"127.0.0.1:{keyed_daemon.port}", timeout=2.0,
                                                                streams=1, send_block_keys=True))
            await keyed.complete(await keyed.route(list(range(3))))  # opens the stream: its metadata arrives
            await plain.complete(await plain.route(list(range(3))))
            keyed_routes.clear()
            routed = []
            for tokens, kw in calls:
                answers = []
                for client in (plain, keyed):
                    try:
                        answers.append(self.decided(await client.route(tokens, **kw)))
                    except RouterRejected as exc:
                        answers.append((exc.code, str(exc)))
                assert answers[0] == answers[1], (len(tokens), kw)
                routed.append(answers[1])
            # the calls with a full block went as keys: all but the 5-token prompt
            assert len(keyed_routes) == len(calls) - 1
            assert [r.worker_id for r in routed[:6]] == ["a", "a", "b", "c", "b", "c"]
            assert [r.matched_blocks for r in routed[:6]] == [10, 10, 6, 4, 0, 0]  # b and c: other namespaces
            assert routed[7][0] is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_prompt_tokens=4096" in routed[7][1]
            assert routed[8][0] is grpc.StatusCode.INVALID_ARGUMENT
            for daemon in (plain_daemon, keyed_daemon):  # the same load charged on both
                assert [(w.id, w.inflight_requests, w.pending_prefill_tokens) for w in daemon.router.workers] == [
                    (w.id, w.inflight_requests, w.pending_prefill_tokens) for w in plain_daemon.router.workers]

    async def test_block_keys_route_as_token_ids_under_model_lora_and_cache_salt(self):
        from contextlib import AsyncExitStack

        from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

        async with AsyncExitStack() as stack:
            daemons = await self.twin_daemons(stack, {"block_size": BS})
            stubs = []
            for daemon in daemons:
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}")
                stack.push_async_callback(channel.close)
                stubs.append(router_pb2_grpc.KVRouterStub(channel))
            for model, lora, salt in (("m", "", ""), ("m", "sql", ""), ("m", "", "tenant"), ("", "", "tenant"),
                                      ("m", "sql", "tenant"), ("", "", "")):
                tokens = prompt(1000, 10) + [1, 2]
                by_ids = pb.RouteRequest(token_ids_le32=b"".join(t.to_bytes(4, "little") for t in tokens),
                                         model=model, lora=lora, cache_salt=salt)
                by_keys = pb.RouteRequest(block_keys=keys.block_keys(tokens, BS, model, lora, salt),
                                          prompt_tokens=len(tokens), model=model, lora=lora, cache_salt=salt)
                answers = [await stub.Route(msg) for stub, msg in zip(stubs, (by_ids, by_keys))]
                for answer in answers:
                    answer.request_id = ""
                assert answers[0] == answers[1], (model, lora, salt)
                assert answers[0].prompt_blocks == 10
