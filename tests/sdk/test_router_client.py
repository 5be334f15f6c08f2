"""RouterClient / SyncRouterClient against a fake router on a real grpc.aio server."""

from __future__ import annotations

import asyncio
import socket
from array import array

import grpc
import pytest

from kvrouter_client import (
    RouterClient,
    RouterRejected,
    RouterUnavailable,
    RouteResult,
    SyncRouterClient,
    TaskCategory,
    keys,
)
from kvrouter_client._generated.kvrouter.v1 import router_pb2 as pb
from kvrouter_client._client import _complete_request, _route_request
from kvrouter_client._streams import COMPLETE, MAX_BATCH_ITEMS, ROUTE, batch_message, stream_item

from .conftest import until


def dead_target() -> str:
    """An address nobody listens on (a port we bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


async def test_route_sends_every_field_and_returns_the_choice(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        result = await client.route(
            list(range(64)), model="m", lora="l", session_id="s", task=TaskCategory.AGENTIC, ttft_slo_ms=300.0,
            expected_output_tokens=50, policy="dualmap", candidate_workers=["w1", "w2"], request_id="r1",
        )
    sent = fake_server.fake.routes[0]
    # packed, the form the router hashes without decoding; the repeated field stays empty
    assert sent.token_ids_le32 == b"".join(t.to_bytes(4, "little") for t in range(64))
    assert not sent.token_ids and not sent.block_keys
    assert (sent.model, sent.lora, sent.session_id, sent.task) == ("m", "l", "s", pb.TASK_CATEGORY_AGENTIC)
    assert sent.ttft_slo_ms == 300.0 and sent.expected_output_tokens == 50 and sent.policy == "dualmap"
    assert list(sent.candidate_workers) == ["w1", "w2"] and sent.request_id == "r1"
    assert result == RouteResult(
        request_id="r1", worker_id="w1", worker_address="10.0.0.1:8000", matched_blocks=2, matched_tokens=32,
        prompt_blocks=4, alternative_worker_id="w2", alternative_worker_address="10.0.0.2:8000",
        policy="cache_aware", reason="prefix_match", estimated_ttft_ms=12.5,
    )


async def test_route_with_block_keys_and_argument_errors(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        await client.route(block_keys=[1, 2, 3], prompt_tokens=50)
        assert list(fake_server.fake.routes[0].block_keys) == [1, 2, 3]
        assert fake_server.fake.routes[0].prompt_tokens == 50
        with pytest.raises(ValueError, match="exactly one"):
            await client.route()
        with pytest.raises(ValueError, match="exactly one"):
            await client.route([1], block_keys=[2])
    with pytest.raises(ValueError, match="target"):
        RouterClient()


async def test_unreachable_router_raises_without_a_fallback():
    async with RouterClient(dead_target(), timeout=1.0) as client:
        with pytest.raises(RouterUnavailable) as info:
            await client.route([1] * 32)
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_unreachable_router_fails_open_to_the_callers_choice():
    seen = []

    def fallback(req):
        seen.append(req)
        return "local-0", "127.0.0.1:9000"

    async with RouterClient(dead_target(), timeout=1.0, fallback=fallback) as client:
        result = await client.route([5] * 32, session_id="s9", candidate_workers=["a"])
        assert result.fallback and result.worker_id == "local-0" and result.worker_address == "127.0.0.1:9000"
        assert result.reason == "router_unavailable"
        assert seen[0].session_id == "s9" and list(seen[0].candidate_workers) == ["a"]
        # the router never saw it, so completing it is a no-op that succeeds
        assert await client.complete(result, ttft_ms=5) is True


async def test_deadline_is_enforced(fake_server):
    fake_server.fake.route_delay = 2.0
    async with RouterClient(fake_server.target, timeout=0.05) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(RouterUnavailable) as info:
            await client.route([1] * 16)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - started < 1.5  # gave up at the deadline, not after the slow router
        # a per-call deadline overrides the client's
        fake_server.fake.route_delay = 0.2
        assert (await client.route([1] * 16, timeout=5.0)).worker_id == "w1"


async def test_rejections_raise_even_with_a_fallback(fake_server):
    fake_server.fake.route_error = grpc.StatusCode.INVALID_ARGUMENT
    async with RouterClient(fake_server.target, timeout=2.0, fallback=lambda r: ("x", "y")) as client:
        with pytest.raises(RouterRejected) as info:
            await client.route([1] * 16)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_no_eligible_worker_counts_as_unavailable_and_fails_open(fake_server):
    fake_server.fake.route_error = grpc.StatusCode.UNAVAILABLE  # what the router says with no worker
    async with RouterClient(fake_server.target, timeout=2.0, fallback=lambda r: ("x", "y:1")) as client:
        assert (await client.route([1] * 16)).fallback


async def test_complete_reports_and_distinguishes_unreachable_from_rejected(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        result = await client.route([1] * 32, request_id="r7")
        assert await client.complete(result, ttft_ms=10.0, e2e_ms=100.0, cached_tokens=16, output_tokens=9, success=False)
        sent = fake_server.fake.completes[0]
        assert (sent.request_id, sent.ttft_ms, sent.e2e_ms, sent.cached_tokens, sent.output_tokens, sent.success) == (
            "r7", 10.0, 100.0, 16, 9, False)
        assert await client.complete("r8")
        assert fake_server.fake.completes[1].cached_tokens == -1 and fake_server.fake.completes[1].success
        fake_server.fake.complete_error = grpc.StatusCode.NOT_FOUND
        with pytest.raises(RouterRejected):
            await client.complete("r9")
    async with RouterClient(dead_target(), timeout=0.5) as client:
        assert await client.complete("r10") is False


async def test_sync_client_has_the_same_behaviour(fake_server):
    def use() -> tuple[RouteResult, RouteResult, bool]:
        with SyncRouterClient(fake_server.target, timeout=2.0) as client:
            ok = client.route(list(range(32)), session_id="s")
            done = client.complete(ok, ttft_ms=1.0)
        with SyncRouterClient(dead_target(), timeout=1.0, fallback=lambda r: ("f", "f:1")) as client:
            fb = client.route([1] * 16)
        return ok, fb, done

    ok, fb, done = await asyncio.to_thread(use)  # a blocking client must not run on the server's loop
    assert ok.worker_id == "w1" and not ok.fallback and done
    assert fb.fallback and fb.worker_address == "f:1"
    assert fake_server.fake.completes[0].request_id == ok.request_id

    def rejected() -> None:
        with SyncRouterClient(fake_server.target, timeout=2.0) as client:
            client.route([1] * 16)

    fake_server.fake.route_error = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RouterRejected):
        await asyncio.to_thread(rejected)

    def unreachable() -> None:
        with SyncRouterClient(dead_target(), timeout=1.0) as client:
            client.route([1] * 16)

    with pytest.raises(RouterUnavailable):
        await asyncio.to_thread(unreachable)


async def test_list_workers(fake_server):
    fake_server.fake.registered["w"] = pb.Worker(id="w", address="a:1", mode=pb.CACHE_STATE_MODE_EVENTS)
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        (w,) = await client.list_workers()
    assert w.id == "w" and w.address == "a:1" and w.mode == 1


async def test_list_workers_pages_through_them_all(fake_server):
    """A router answers ListWorkers a page at a time (issue #28 item 8: one reply of a large
    fleet passed gRPC's 4 MiB default): both clients follow next_page_token to the end."""
    fake = fake_server.fake
    fake.list_page_size = 3
    for i in range(8):
        fake.registered[f"w{i}"] = pb.Worker(id=f"w{i}", address=f"a:{i}")
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        assert [w.id for w in await client.list_workers()] == [f"w{i}" for i in range(8)]
    assert [r.page_token for r in fake.list_requests] == ["", "3", "6"]

    def listed() -> list[str]:
        with SyncRouterClient(fake_server.target, timeout=2.0) as sync:
            return [w.id for w in sync.list_workers()]

    assert await asyncio.to_thread(listed) == [f"w{i}" for i in range(8)]


# ---- the RouteStream pool -------------------------------------------------------------------


async def test_concurrent_calls_share_the_stream_pool_and_get_their_own_answers(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0, streams=3) as client:
        results = await asyncio.gather(*(client.route([1] * 16, request_id=f"r{i}") for i in range(40)))
        assert [r.request_id for r in results] == [f"r{i}" for i in range(40)]
        done = await asyncio.gather(*(client.complete(r) for r in results))
    assert all(done)
    assert fake_server.fake.streams_opened == 3  # reused, not one per call
    assert sorted(c.request_id for c in fake_server.fake.completes) == sorted(f"r{i}" for i in range(40))
    # every message carried the call's deadline (for the router's admission queue) and its own id
    messages = fake_server.fake.stream_messages
    assert {m.timeout_ms for m in messages} == {2000.0}
    assert len({m.id for m in messages}) == len(messages) == 80


async def test_a_broken_stream_fails_its_call_open_and_the_next_call_reconnects(fake_server):
    fake_server.fake.break_route_stream = True
    async with RouterClient(fake_server.target, timeout=2.0, streams=1, fallback=lambda r: ("f", "f:1")) as client:
        assert (await client.route([1] * 16)).fallback
        again = await client.route([1] * 16, request_id="after")
        assert not again.fallback and again.request_id == "after"
    assert fake_server.fake.streams_opened == 2


async def test_a_restarted_router_is_used_again_through_new_streams(fake_server):
    async with RouterClient(fake_server.target, timeout=1.0, streams=2, fallback=lambda r: ("f", "f:1")) as client:
        assert not (await client.route([1] * 16)).fallback
        await fake_server.stop()
        assert (await client.route([1] * 16)).fallback
        assert (await client.route([1] * 16)).fallback
        await fake_server.start()
        await until_routed(client)


async def until_routed(client: RouterClient) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while (await client.route([1] * 16)).fallback:
        assert loop.time() < end, "the client never went back to the restarted router"
        await asyncio.sleep(0.05)


async def test_stream_rejections_and_deadlines_match_the_unary_ones(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        fake_server.fake.route_error = grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(RouterRejected) as info:
            await client.route([1] * 16)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        fake_server.fake.route_error = None
        # the same stream still answers after a rejected message
        assert (await client.route([1] * 16)).worker_id == "w1"
        fake_server.fake.complete_error = grpc.StatusCode.UNAVAILABLE
        assert await client.complete("r1") is False
    assert fake_server.fake.streams_opened == 1


async def test_a_router_without_route_stream_is_called_unary(fake_server):
    fake_server.fake.streams_supported = False
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        first = await client.route([1] * 16, request_id="a")
        # asked once; twice when gRPC's core hid the first UNIMPLEMENTED behind a failed write
        # (~1% of runs: test_a_router_without_route_stream_is_found_when_the_first_write_fails)
        asked = fake_server.fake.streams_opened
        second = await client.route([1] * 16, request_id="b")
        assert await client.complete(second)
    assert (first.request_id, second.request_id) == ("a", "b") and not first.fallback
    assert asked in (1, 2) and fake_server.fake.streams_opened == asked  # then unary only
    assert [c.request_id for c in fake_server.fake.completes] == ["b"]


async def _fails_as_core_does(call, write, message) -> None:
    """A write gRPC's core could not send (the call had already ended): INTERNAL "Internal
    error from Core", which replaces the status the router ended the call with; the message
    never leaves."""
    call.cancel()  # the call is over: its reader ends too
    raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "Internal error from Core")


async def _after_the_router_ended_it(call, write, message) -> None:
    """A write that starts once the router has ended the call: gRPC refuses it outright, and the
    call keeps the router's own status (the race's other outcome, made certain)."""
    await call.code()
    await write(message)


class _Calls:
    """The client's RouteStream calls, the n-th opened writing as ``writes[n]`` says (past the
    list: as gRPC does); ``opened`` counts them."""

    def __init__(self, client: RouterClient, *writes) -> None:
        pool = client._streams
        self.method, self.writes, self.opened = pool._method, writes, 0
        pool._method = self

    def __call__(self):
        call = self.method()
        n, self.opened = self.opened, self.opened + 1
        if n < len(self.writes):
            behave, write = self.writes[n], call.write

            async def written(message):
                await behave(call, write, message)

            call.write = written
        return call


async def test_a_message_the_stream_could_not_send_goes_once_more_on_a_new_stream(fake_server):
    """A write that fails never reached the router: the call goes again on a new stream, and
    the router sees it once, not twice."""
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        calls = _Calls(client, _fails_as_core_does)
        routed = await client.route([1] * 16, request_id="a")
        assert (routed.request_id, routed.fallback, calls.opened) == ("a", False, 2)
        assert [m.route.request_id for m in fake_server.fake.stream_messages] == ["a"]
        assert await client.complete(routed)


async def test_a_router_without_route_stream_is_found_when_the_first_write_fails(fake_server):
    """Against a router without RouteStream, gRPC's core may fail the first write INTERNAL
    in place of the router's UNIMPLEMENTED (~1% of first calls on loopback): the call goes
    again, learns UNIMPLEMENTED, and is answered by the unary Route."""
    fake_server.fake.streams_supported = False
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        # the second stream's write waits for the router's UNIMPLEMENTED, which that write
        # would otherwise race as the first did (~1%)
        _Calls(client, _fails_as_core_does, _after_the_router_ended_it)
        routed = await client.route([1] * 16, request_id="a")
        assert await client.complete(routed)
    assert (routed.request_id, routed.fallback) == ("a", False)
    assert [r.request_id for r in fake_server.fake.routes] == ["a"]
    assert [c.request_id for c in fake_server.fake.completes] == ["a"]


async def test_a_message_queued_on_a_stream_that_ended_goes_on_a_new_one(fake_server):
    """The router ended the stream before the client wrote to it (gRPC then refuses the write
    outright): the queued message never left, so it goes on a new stream."""
    fake_server.fake.end_route_streams_at_open = [grpc.StatusCode.UNAVAILABLE]
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        calls = _Calls(client, _after_the_router_ended_it)
        routed = await client.route([1] * 16, request_id="a")
        assert (routed.request_id, routed.fallback, calls.opened) == ("a", False, 2)
    assert [m.route.request_id for m in fake_server.fake.stream_messages] == ["a"]
    assert fake_server.fake.streams_opened == 2


async def test_a_message_that_cannot_be_sent_twice_fails_open_after_one_more_try(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0, streams=2, fallback=lambda r: ("f", "f:1")) as client:
        calls = _Calls(client, *[_fails_as_core_does] * 5)
        assert (await client.route([1] * 16)).fallback
        assert calls.opened == 2  # tried, then once more: never a loop
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        _Calls(client, *[_fails_as_core_does] * 5)
        with pytest.raises(RouterUnavailable, match="Internal error from Core"):
            await client.route([1] * 16)
    assert fake_server.fake.stream_messages == [] and fake_server.fake.routes == []


async def test_streams_zero_uses_unary_calls_only(fake_server):
    async with RouterClient(fake_server.target, timeout=2.0, streams=0) as client:
        assert await client.complete(await client.route([1] * 16))
    assert fake_server.fake.streams_opened == 0 and len(fake_server.fake.completes) == 1
    with pytest.raises(ValueError, match="streams"):
        RouterClient(fake_server.target, streams=-1)


# ---- coalescing: calls ready together share one stream message --------------------------------


async def test_calls_ready_together_leave_in_one_batch_and_get_their_own_answers(fake_server):
    fake = fake_server.fake
    async with RouterClient(fake_server.target, timeout=2.0, streams=2) as client:
        # before any advertisement calls go one per message, spread over the pool
        await asyncio.gather(client.route([1] * 16), client.route([1] * 16))
        assert fake.streams_opened == 2 and fake.stream_batches == []
        await client.route([1] * 16, request_id="warm")
        assert fake.stream_batches == []  # a lone call goes alone
        results = await asyncio.gather(*(client.route([i] * 16, request_id=f"r{i}") for i in range(40)))
        assert [r.request_id for r in results] == [f"r{i}" for i in range(40)]
        # the answers came back in one batch, so their callers' completes were ready together too
        assert all(await asyncio.gather(*(client.complete(r) for r in results)))
    # each burst joined one stream's forming batch rather than being spread over the pool
    assert fake.stream_batches == [40, 40] and fake.streams_opened == 2
    assert [m.route.token_ids_le32[:4] for m in fake.stream_messages[3:43]] == [bytes([i, 0, 0, 0]) for i in range(40)]
    assert sorted(c.request_id for c in fake.completes) == sorted(f"r{i}" for i in range(40))
    assert {m.timeout_ms for m in fake.stream_messages} == {2000.0}  # each item keeps its own deadline
    assert len({m.id for m in fake.stream_messages}) == 83


async def test_batches_stay_within_the_item_cap_and_the_routers_advertised_size(fake_server):
    fake = fake_server.fake
    fake.batch_limit_bytes = 20_000
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        await client.route([1] * 16)
        await asyncio.gather(*(client.route([7] * 16) for _ in range(100)))
        assert fake.stream_batches == [MAX_BATCH_ITEMS, 100 - MAX_BATCH_ITEMS]
        fake.stream_batches.clear()
        fake.stream_batch_bytes.clear()
        # 1,000 tokens packed are 4,000 bytes: four such routes fit in 20,000 bytes, not five
        await asyncio.gather(*(client.route([7] * 1000) for _ in range(10)))
        assert fake.stream_batches == [4, 4, 2]
        assert max(fake.stream_batch_bytes) <= 20_000
        # a call larger than a batch may be still goes, on its own
        huge = await asyncio.gather(*(client.route([7] * 6000) for _ in range(2)))
        assert len(huge) == 2 and fake.stream_batches == [4, 4, 2]


async def test_send_block_keys_sends_the_routers_keys_for_its_advertised_block_size(fake_server):
    fake = fake_server.fake
    fake.block_size = 8
    tokens = list(range(100, 190))  # 11 blocks of 8 and 2 tokens over
    async with RouterClient(fake_server.target, timeout=2.0, streams=1, send_block_keys=True) as client:
        await client.route(tokens[:3])  # the stream's first call: no full block, token ids whatever the metadata
        await until(lambda: client._streams._streams[0].block_size == 8)  # type: ignore[union-attr]
        await client.route(tokens, model="m", lora="l", session_id="s", request_id="r1")
        await client.route(array("I", tokens))
        await client.route(tokens[:7])  # no full block: token ids, as an empty block_keys is no prompt
    short, keyed, plain, seven = fake.routes
    assert short.token_ids_le32 == array("I", tokens[:3]).tobytes() and not short.block_keys
    # the router's keys, salted by model and LoRA as the router salts them, and the prompt's length
    assert list(keyed.block_keys) == keys.block_keys(tokens, 8, "m", "l") and keyed.prompt_tokens == 90
    assert not keyed.token_ids_le32 and not keyed.token_ids
    assert (keyed.model, keyed.lora, keyed.session_id, keyed.request_id) == ("m", "l", "s", "r1")
    assert list(plain.block_keys) == keys.block_keys(tokens, 8) and plain.prompt_tokens == 90
    assert seven.token_ids_le32 == array("I", tokens[:7]).tobytes() and not seven.block_keys


async def test_send_block_keys_sends_token_ids_without_an_advertised_block_size_or_unary(fake_server):
    fake = fake_server.fake
    tokens = list(range(64))
    async with RouterClient(fake_server.target, timeout=2.0, streams=1, send_block_keys=True) as client:
        for _ in range(3):
            await client.route(tokens)  # a router from before block keys advertises no block size
    fake.block_size = 16
    async with RouterClient(fake_server.target, timeout=2.0, streams=0, send_block_keys=True) as client:
        await client.route(tokens)  # unary calls carry no advertisement
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        for _ in range(3):
            await client.route(tokens)  # advertised, but not asked for
    assert len(fake.routes) == 7
    assert all(r.token_ids_le32 == array("I", tokens).tobytes() and not r.block_keys for r in fake.routes)


async def test_send_block_keys_fails_open_with_the_token_ids(fake_server):
    fake = fake_server.fake
    fake.block_size = 16
    seen: list[pb.RouteRequest] = []
    fallback = lambda r: seen.append(r) or ("f", "f:1")  # noqa: E731
    async with RouterClient(fake_server.target, timeout=2.0, streams=1, send_block_keys=True,
                            fallback=fallback) as client:
        await client.route(list(range(32)))
        fake.route_error = grpc.StatusCode.UNAVAILABLE
        assert (await client.route(list(range(48)))).fallback
    assert list(fake.routes[-1].block_keys) == keys.block_keys(list(range(48)))
    # the fallback sees the request the caller made, its prompt as token ids
    assert seen[0].token_ids_le32 == array("I", range(48)).tobytes() and not seen[0].block_keys


def test_a_keyed_route_parses_as_protobufs_block_keys_request():
    tokens = list(range(1000))
    route = _route_request(tokens, None, 0, "m", "l", "s", TaskCategory.CHAT, 9.5, 7, "p", ["w1"], "r")
    sent = pb.RouteRequest.FromString(b"".join(route.keyed(16)))
    expected = pb.RouteRequest(block_keys=keys.block_keys(tokens, 16, "m", "l"), prompt_tokens=1000, model="m",
                               lora="l", session_id="s", task=int(TaskCategory.CHAT), ttft_slo_ms=9.5,
                               expected_output_tokens=7, policy="p", candidate_workers=["w1"], request_id="r")
    assert sent == expected
    # a caller's prompt_tokens beside token ids is replaced by the ids' count, as the router counts them
    route = _route_request(tokens, None, 5, "", "", "", TaskCategory.UNSPECIFIED, 0.0, 0, "", (), "")
    assert pb.RouteRequest.FromString(b"".join(route.keyed(16))).prompt_tokens == 1000
    assert route.keyed(0) == route.body()  # no block size: the token ids


async def test_an_older_router_without_the_advertisement_gets_one_message_per_call(fake_server):
    fake = fake_server.fake
    fake.batches_supported = False
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        await client.route([1] * 16)
        results = await asyncio.gather(*(client.route([1] * 16, request_id=f"r{i}") for i in range(40)))
        assert all(await asyncio.gather(*(client.complete(r) for r in results)))
    assert [r.request_id for r in results] == [f"r{i}" for i in range(40)]
    assert fake.stream_batches == [] and len(fake.stream_messages) == 81
    assert fake.streams_opened == 1


def test_batch_framing_is_protobufs_own_encoding():
    items = [pb.RouteStreamRequest(id=i, route=pb.RouteRequest(token_ids_le32=bytes(4 * i * 40))) for i in range(1, 5)]
    expected = pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=items)).SerializeToString()
    assert batch_message([m.SerializeToString() for m in items]) == expected


@pytest.mark.parametrize("n", [1, 127, 128, 300_000])
@pytest.mark.parametrize("timeout_ms", [500.0, 0.25])
def test_stream_items_are_byte_for_byte_what_protobuf_encodes(n, timeout_ms):
    # the client frames each call around its serialised request instead of nesting messages
    routes = [
        _route_request(list(range(1000)), None, 0, "", "", "", TaskCategory.UNSPECIFIED, 0.0, 0, "", (), ""),
        _route_request([], None, 5, "m", "l", "s", TaskCategory.CHAT, 9.5, 7, "p", ["w1", "w2"], "r"),
        _route_request(None, [2**64 - 1, 3], 0, "m", "", "", 2, 0.0, 0, "", (), ""),
    ]
    for route in routes:
        expected = pb.RouteStreamRequest(id=n, route=route.message(), timeout_ms=timeout_ms).SerializeToString()
        assert stream_item(n, ROUTE, route.body(), timeout_ms) == expected
    complete = _complete_request("kvr-1", 1.5, 9.0, -1, 12, False, True)
    expected = pb.RouteStreamRequest(id=n, complete=complete, timeout_ms=timeout_ms).SerializeToString()
    assert stream_item(n, COMPLETE, [complete.SerializeToString()], timeout_ms) == expected


async def test_a_prompt_given_as_an_array_stays_the_callers(fake_server):
    fake_server.fake.route_delay = 1.0
    calls: list[pb.RouteRequest] = []
    fallback = lambda r: calls.append(r) or ("f", "f:1")  # noqa: E731
    async with RouterClient(fake_server.target, timeout=0.3, fallback=fallback) as slow:
        prompt = array("I", range(32))
        routing = asyncio.create_task(slow.route(prompt))
        await asyncio.sleep(0.05)
        prompt.extend(range(16))  # the client holds no view of it: the caller may grow it meanwhile
        assert (await routing).fallback  # past the deadline
    # the fallback saw the prompt the call was made with
    assert calls[0].token_ids_le32 == array("I", range(32)).tobytes()
    fake_server.fake.route_delay = 0.2
    async with RouterClient(fake_server.target, timeout=2.0) as client:
        prompt = array("I", range(64))
        routing = asyncio.create_task(client.route(prompt))
        await asyncio.sleep(0.05)
        prompt.extend(range(16))
        assert (await routing).worker_id == "w1"
    assert fake_server.fake.routes[1].token_ids_le32 == array("I", range(64)).tobytes()


async def test_each_call_keeps_its_own_deadline_on_a_shared_stream(fake_server):
    async with RouterClient(fake_server.target, timeout=5.0, streams=1) as client:
        for _ in range(50):  # answered calls do not pile up in the stream's deadline queue
            await client.route([1] * 16)
        (stream,) = client._streams._streams  # type: ignore[union-attr]
        assert stream is not None and len(stream.deadlines) <= 1
        fake_server.fake.route_delay = 1.0
        loop = asyncio.get_running_loop()
        patient = asyncio.create_task(client.route([1] * 16))
        started = loop.time()
        # sooner than the call before it on the same stream: it still ends at its own deadline
        with pytest.raises(RouterUnavailable, match="DEADLINE_EXCEEDED"):
            await client.route([1] * 16, timeout=0.2)
        assert loop.time() - started < 0.8
        assert (await patient).worker_id == "w1"  # the slow answer is within its 5 s


async def test_a_cancelled_call_raises_cancelled_and_leaves_nothing_waiting(fake_server):
    fake_server.fake.route_delay = 0.5
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        routing = asyncio.create_task(client.route([1] * 16))
        await until(lambda: len(fake_server.fake.routes) == 1)
        routing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await routing
        (stream,) = client._streams._streams  # type: ignore[union-attr]
        assert stream is not None and stream.waiting == {}
        # its answer, when it comes, is dropped, and the stream goes on serving
        fake_server.fake.route_delay = 0.0
        assert (await client.route([1] * 16)).worker_id == "w1"


async def test_a_call_that_gives_up_while_queued_behind_a_blocked_write_is_never_sent(fake_server):
    fake = fake_server.fake
    async with RouterClient(fake_server.target, timeout=5.0, streams=1) as client:
        await client.route([1] * 16, request_id="warm")
        fake.stream_reading.clear()
        first = asyncio.create_task(client.route([1] * 16, request_id="first"))
        await until(lambda: len(fake.stream_messages) == 2)  # read, then held: the router reads no more
        # 2 MB the router does not read: the write waits for HTTP/2 flow control
        big = asyncio.create_task(client.route([7] * 500_000, request_id="big"))
        await asyncio.sleep(0.3)
        assert not big.done()
        with pytest.raises(RouterUnavailable, match="DEADLINE_EXCEEDED"):
            await client.route([1] * 16, request_id="gave-up", timeout=0.2)
        fake.stream_reading.set()
        assert (await first).request_id == "first" and (await big).request_id == "big"
        await client.route([1] * 16, request_id="after")
    assert [m.route.request_id for m in fake.stream_messages] == ["warm", "first", "big", "after"]


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
async def test_a_stream_that_breaks_internal_fails_open_and_the_next_call_streams_again(fake_server, code):
    """A router that goes away with a message in flight ends the call INTERNAL "Internal error
    from Core" on the client: the stream broke, nothing refused the request (the router answers
    refusals in-band), so it fails open and the next call opens a new stream."""
    fake_server.fake.fail_route_streams = [code]
    async with RouterClient(fake_server.target, timeout=2.0, streams=1, fallback=lambda r: ("f", "f:1")) as client:
        assert (await client.route([1] * 16)).fallback
        await until_routed(client)
    async with RouterClient(fake_server.target, timeout=2.0, streams=1) as client:
        fake_server.fake.fail_route_streams = [code]
        with pytest.raises(RouterUnavailable):
            await client.route([1] * 16)
