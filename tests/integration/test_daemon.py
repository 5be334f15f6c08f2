"""The daemon end to end over real grpc.aio: register, stream events, route, complete, trace."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.index.keys import block_keys

BS = 16


def stored(tokens, hashes, parent=None):
    ev = pb.StoredBlocks(engine_hashes=hashes, token_ids=tokens)
    if parent is not None:
        ev.parent_engine_hash = parent
    return pb.CacheEvent(stored=ev)


async def register(stub, wid, mode=pb.CACHE_STATE_MODE_EVENTS, capacity=10_000):
    return await stub.RegisterWorker(
        pb.RegisterWorkerRequest(worker=pb.Worker(id=wid, address=f"{wid}.local:8000", capacity_blocks=capacity, mode=mode))
    )


async def publish(stub, *batches):
    async def gen():
        for b in batches:
            yield b

    return await stub.PublishEvents(gen())


async def test_health_serving_and_reflection(running):
    health = health_pb2_grpc.HealthStub(running.channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(running.channel)

    async def req():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for answer in refl.ServerReflectionInfo(req()):
        names = {s.name for s in answer.list_services_response.service}
        assert "kvrouter.v1.KVRouter" in names and "grpc.health.v1.Health" in names
        break


async def test_route_lands_on_the_worker_holding_the_prefix(running):
    stub = running.stub
    for wid in ("a", "b", "c"):
        await register(stub, wid)
    prompt = list(range(1000, 1000 + 40 * BS))  # 40 blocks
    # worker b caches the first 30 blocks in two chained events; c caches only the first 5
    summary = await publish(
        stub,
        pb.EventBatch(worker_id="b", sequence=0, events=[stored(prompt[: 10 * BS], list(range(1, 11)))]),
        pb.EventBatch(worker_id="b", sequence=1, events=[stored(prompt[10 * BS : 30 * BS], list(range(11, 31)), parent=10)]),
        pb.EventBatch(worker_id="c", sequence=0, events=[stored(prompt[: 5 * BS], list(range(101, 106)))]),
    )
    assert summary.batches_applied == 3 and summary.blocks_stored == 35 and summary.gaps_detected == 0

    resp = await stub.Route(pb.RouteRequest(token_ids=prompt + [7, 7, 7], session_id="s1"))
    assert resp.worker_id == "b" and resp.worker_address == "b.local:8000"
    assert resp.matched_blocks == 30 and resp.matched_tokens == 30 * BS and resp.prompt_blocks == 40
    assert resp.policy == "cache_aware" and resp.reason == "prefix_match"
    assert resp.request_id

    workers = {w.id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert workers["b"].inflight_requests == 1
    assert workers["b"].pending_prefill_tokens == len(prompt) + 3 - 30 * BS
    assert workers["b"].cached_blocks == 30 and workers["b"].mode == pb.CACHE_STATE_MODE_EVENTS

    await stub.Complete(pb.CompleteRequest(request_id=resp.request_id, ttft_ms=120.0, e2e_ms=900.0, success=True))
    workers = {w.id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert workers["b"].inflight_requests == 0 and workers["b"].pending_prefill_tokens == 0

    (span,) = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.route"]
    a = span.attributes
    assert a["kvrouter.chosen.worker_id"] == "b"
    assert a["kvrouter.chosen.matched_blocks"] == 30
    assert a["kvrouter.policy"] == "cache_aware" and a["kvrouter.reason"] == "prefix_match"
    assert a["kvrouter.prompt_blocks"] == 40
    assert a["kvrouter.chosen.state_mode"] == "events"
    overlap = dict(zip(a["kvrouter.candidates.id"], a["kvrouter.candidates.overlap_blocks"]))
    assert overlap == {"a": 0, "b": 30, "c": 5}
    assert len(a["kvrouter.candidates.score"]) == 3
    batch_spans = [s for s in running.spans.get_finished_spans() if s.name == "kvrouter.events.apply"]
    assert len(batch_spans) == 3 and batch_spans[0].attributes["kvrouter.blocks_stored"] == 10


async def test_removal_by_engine_hash_and_block_keys_input(running):
    stub = running.stub
    await register(stub, "a")
    prompt = list(range(5000, 5000 + 8 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, list(range(900, 908)))]))
    # the engine evicts its last 3 blocks (by its own hashes)
    await publish(stub, pb.EventBatch(worker_id="a", sequence=1, events=[pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[905, 906, 907]))]))
    keys = block_keys(prompt, BS)
    resp = await stub.Route(pb.RouteRequest(block_keys=keys, prompt_tokens=len(prompt)))
    assert resp.matched_blocks == 5


async def test_indexed_blocks_leaves_out_a_block_no_worker_holds(running):
    """An engine evicts a chain's middle block: the index keeps it, held by none, so the block
    under it is matched again once the engine stores it anew, but routing never hits it, and
    GetStats counted it (issue #28 item 13: 3 indexed against 2 cached)."""
    stub = running.stub
    await register(stub, "a")
    prompt = list(range(7000, 7000 + 3 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, [41, 42, 43])]),
                  pb.EventBatch(worker_id="a", sequence=1, events=[pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[42]))]))
    stats = await stub.GetStats(pb.GetStatsRequest())
    assert [w.cached_blocks for w in stats.workers] == [2] and stats.indexed_blocks == 2
    assert (await stub.Route(pb.RouteRequest(token_ids=prompt))).matched_blocks == 1
    await publish(stub, pb.EventBatch(worker_id="a", sequence=2, events=[stored(prompt[BS : 2 * BS], [42], parent=41)]))
    assert (await stub.Route(pb.RouteRequest(token_ids=prompt))).matched_blocks == 3
    assert (await stub.GetStats(pb.GetStatsRequest())).indexed_blocks == 3


async def test_sequence_gap_degrades_until_cleared(running):
    stub = running.stub
    await register(stub, "a")
    toks = list(range(16 * 4))
    s = await publish(
        stub,
        pb.EventBatch(worker_id="a", sequence=0, events=[stored(toks[:16], [1])]),
        pb.EventBatch(worker_id="a", sequence=3, events=[stored(toks[16:32], [2], parent=1)]),
        pb.EventBatch(worker_id="a", sequence=3, events=[stored(toks[32:48], [3], parent=2)]),  # duplicate
    )
    assert s.gaps_detected == 1 and s.batches_duplicate == 1 and s.batches_applied == 2
    (w,) = (await stub.ListWorkers(pb.ListWorkersRequest())).workers
    assert w.state == pb.WORKER_STATE_DEGRADED and w.cached_blocks == 2
    await publish(stub, pb.EventBatch(worker_id="a", sequence=4, events=[pb.CacheEvent(cleared=pb.AllBlocksCleared()), stored(toks[:16], [1])]))
    (w,) = (await stub.ListWorkers(pb.ListWorkersRequest())).workers
    assert w.state == pb.WORKER_STATE_READY and w.cached_blocks == 1
    stats = await stub.GetStats(pb.GetStatsRequest())
    assert stats.event_gaps == 1 and stats.indexed_blocks == 1


async def test_approximate_mode_learns_from_its_own_decisions(running):
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid, mode=pb.CACHE_STATE_MODE_APPROXIMATE)
    prompt = list(range(64 * BS))
    first = await stub.Route(pb.RouteRequest(token_ids=prompt))
    await stub.Complete(pb.CompleteRequest(request_id=first.request_id, success=True))
    second = await stub.Route(pb.RouteRequest(token_ids=prompt + list(range(99, 99 + BS))))
    assert second.worker_id == first.worker_id and second.matched_blocks == 64
    workers = {w.id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert workers[first.worker_id].mode == pb.CACHE_STATE_MODE_APPROXIMATE
    assert workers[first.worker_id].cached_blocks == 65


@pytest.mark.parametrize("daemon_config", [{"speculative": {"ttl_s": 10}}])
async def test_events_mode_sees_a_routed_prompt_before_its_engine_stores_it(running):
    """Speculative indexing (config speculative.ttl_s): a follow-up routed before
    the first prompt's Stored events arrive lands beside it; the events then confirm the blocks."""
    stub = running.stub
    for wid in ("a", "b", "c"):
        await register(stub, wid)
    prompt = list(range(5000, 5000 + 20 * BS))
    first = await stub.Route(pb.RouteRequest(token_ids=prompt))
    assert first.matched_blocks == 0
    second = await stub.Route(pb.RouteRequest(token_ids=prompt + list(range(99, 99 + 4 * BS))))
    assert second.worker_id == first.worker_id and second.matched_blocks == 20
    # the engine stores the prompt: keys as its hashes, so the blocks are the claimed ones
    summary = await publish(stub, pb.EventBatch(worker_id=first.worker_id, sequence=0,
                                                events=[stored(prompt, block_keys(prompt, BS))]))
    assert summary.blocks_stored == 20
    workers = {w.id: w for w in (await stub.ListWorkers(pb.ListWorkersRequest())).workers}
    assert workers[first.worker_id].cached_blocks == 20  # what the engine stored
    speculative = running.daemon.router.speculative
    assert speculative.outcomes["confirmed"] == 20 and speculative.live_on(first.worker_id) == 4  # the follow-up's


async def test_evict_hint_over_grpc(running):
    stub = running.stub
    await register(stub, "a")
    toks = list(range(6 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(toks, [11, 12, 13, 14, 15, 16])]))
    resp = await stub.EvictHint(pb.EvictHintRequest(worker_id="a", blocks=2, pinned_engine_hashes=[16]))
    # 16 is the only leaf and pinned: nothing below it can go before it
    assert list(resp.engine_hashes) == [] and resp.exhausted
    resp = await stub.EvictHint(pb.EvictHintRequest(worker_id="a", tokens=2 * BS))
    assert list(resp.engine_hashes) == [16, 15] and not resp.exhausted and resp.policy == "lru"


@pytest.mark.parametrize(
    "call,request_msg,code",
    [
        ("Route", pb.RouteRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        ("Route", pb.RouteRequest(token_ids=[1] * 32, block_keys=[1]), grpc.StatusCode.INVALID_ARGUMENT),
        ("Route", pb.RouteRequest(token_ids=[1] * 32, policy="nope"), grpc.StatusCode.INVALID_ARGUMENT),
        ("Route", pb.RouteRequest(token_ids=[1] * 32, candidate_workers=["ghost"]), grpc.StatusCode.NOT_FOUND),
        ("Route", pb.RouteRequest(token_ids=[1] * 5000), grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Complete", pb.CompleteRequest(request_id="never-routed"), grpc.StatusCode.NOT_FOUND),
        ("EvictHint", pb.EvictHintRequest(worker_id="ghost", blocks=1), grpc.StatusCode.NOT_FOUND),
        ("EvictHint", pb.EvictHintRequest(worker_id="a"), grpc.StatusCode.INVALID_ARGUMENT),
        ("EvictHint", pb.EvictHintRequest(worker_id="a", blocks=1, tokens=16), grpc.StatusCode.INVALID_ARGUMENT),
        ("ReportLoad", pb.ReportLoadRequest(worker_id="a", kv_utilization=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        ("DeregisterWorker", pb.DeregisterWorkerRequest(worker_id="ghost"), grpc.StatusCode.NOT_FOUND),
        ("RegisterWorker", pb.RegisterWorkerRequest(worker=pb.Worker(id="x")), grpc.StatusCode.INVALID_ARGUMENT),
        ("RegisterWorker", pb.RegisterWorkerRequest(worker=pb.Worker(id="x", address="h:1", block_size=70_000)),
         grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_input_gets_a_precise_status_and_changes_nothing(running, call, request_msg, code):
    await register(running.stub, "a")
    before = (len(running.router.index), running.router.workers.inflight_count, len(running.router.workers))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(running.stub, call)(request_msg)
    assert err.value.code() == code
    assert err.value.details()
    assert (len(running.router.index), running.router.workers.inflight_count, len(running.router.workers)) == before


@pytest.fixture
def daemon_config():
    return {"limits": {"max_prompt_tokens": 4096}}


async def test_malformed_batch_rejected_without_applying_it(running):
    stub = running.stub
    await register(stub, "a")
    good = pb.EventBatch(worker_id="a", sequence=0, events=[stored(list(range(16)), [1])])
    bad = pb.EventBatch(worker_id="a", sequence=1, events=[stored(list(range(20)), [2], parent=1)])  # 20 tokens: not whole blocks
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await publish(stub, good, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page size 16" in err.value.details()
    w = running.router.workers.get("a")
    assert running.router.index.count(w.slot) == 1 and w.last_sequence == 0


async def test_a_sequence_past_int64_is_rejected_before_it_is_applied(running):
    """The answer reports a worker's last sequence as int64: a batch numbered past it must not be
    applied and then fail the answer (UNKNOWN, with the index already changed)."""
    stub = running.stub
    await register(stub, "a")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await publish(stub, pb.EventBatch(worker_id="a", sequence=2**64 - 2, events=[stored(list(range(16)), [1])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2**63-1" in err.value.details()
    w = running.router.workers.get("a")
    assert len(running.router.index) == 0 and w.last_sequence == -1
    resp = await publish(stub, pb.EventBatch(worker_id="a", sequence=2**63 - 1, events=[pb.CacheEvent(cleared=pb.AllBlocksCleared())]))
    assert [(s.worker_id, s.last_sequence) for s in resp.workers] == [("a", 2**63 - 1)]


async def test_unknown_worker_batch_is_not_found(running):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await publish(running.stub, pb.EventBatch(worker_id="ghost", sequence=0, events=[]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_no_worker_registered_is_unavailable(running):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.Route(pb.RouteRequest(token_ids=[1] * 16))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_cache_salt_separates_keys_and_a_route_with_the_same_salt_matches(running):
    """Issue #11 item 5: tenants (SGLang ``cache_salt``) never share cached prefixes."""
    stub = running.stub
    await register(stub, "a")
    tokens = list(range(500, 500 + 48))
    salted = pb.StoredBlocks(engine_hashes=[1, 2, 3], token_ids=tokens, cache_salt="tenant-a")
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[pb.CacheEvent(stored=salted)]))
    same = await stub.Route(pb.RouteRequest(token_ids=tokens, cache_salt="tenant-a"))
    other = await stub.Route(pb.RouteRequest(token_ids=tokens, cache_salt="tenant-b"))
    unsalted = await stub.Route(pb.RouteRequest(token_ids=tokens))
    assert (same.matched_blocks, other.matched_blocks, unsalted.matched_blocks) == (3, 0, 0)


@pytest.mark.parametrize(
    ("worker", "needle"),
    [
        (dict(address="h:1", kv_events_endpoint="http://x:1"), "must be tcp://HOST:PORT"),
        (dict(address="h:1", kv_events_endpoint="tcp://10.0.0.5"), "numeric port"),
        (dict(address="h:1", kv_events_endpoint="tcp://127.0.0.1?dp_rank=1"), "numeric port"),
        (dict(address="h:1", kv_events_endpoint="tcp://127.0.0.1:65535?dp_rank=9"), "outside 1-65535"),
        (dict(address="h:1", kv_events_endpoint="tcp://*:5557"), "not the * it binds to"),
        (dict(address="not-an-endpoint"), "must be HOST:PORT"),
        (dict(address="h:99999"), "must be HOST:PORT"),
    ],
)
async def test_register_worker_refuses_bad_endpoints_before_registering(running, worker, needle):
    """Issue #11 item 6: a bad endpoint is the caller's error, found before anything changes."""
    msg = pb.Worker(id="bad", mode=pb.CACHE_STATE_MODE_EVENTS, **worker)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await running.stub.RegisterWorker(pb.RegisterWorkerRequest(worker=msg))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
    assert "bad" not in running.router.workers
    assert running.daemon.events is None or "bad" not in running.daemon.events.subscribers


async def test_a_fleet_past_4_mib_of_descriptions_is_listed_a_page_at_a_time(running):
    """300 workers with legal 16,000-character labels describe ~4.8 MB: one GetStats or
    ListWorkers reply passed a default client's 4 MiB receive limit (issue #28 item 8)."""
    stub = running.stub  # a channel with default options: 4 MiB received at most
    ids = [f"w{i:03}" for i in range(300)]
    for wid in reversed(ids):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker=pb.Worker(id=wid, address=f"{wid}.local:8000", labels={"note": "x" * 16_000})))
    stats = await stub.GetStats(pb.GetStatsRequest())
    assert stats.worker_count == 300 and 0 < len(stats.workers) < 300
    assert [w.id for w in stats.workers] == ids[: len(stats.workers)]
    listed, token, pages = [], "", 0
    while True:
        page = await stub.ListWorkers(pb.ListWorkersRequest(page_token=token))
        assert page.ByteSize() <= 1 << 20
        listed += [w.id for w in page.workers]
        pages += 1
        if not page.next_page_token:
            break
        token = page.next_page_token
    assert listed == ids and pages >= 5
    page = await stub.ListWorkers(pb.ListWorkersRequest(page_size=7))
    assert [w.id for w in page.workers] == ids[:7] and page.next_page_token
    page = await stub.ListWorkers(pb.ListWorkersRequest(page_size=7, page_token=page.next_page_token))
    assert [w.id for w in page.workers] == ids[7:14]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListWorkers(pb.ListWorkersRequest(page_token="not a token!"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
