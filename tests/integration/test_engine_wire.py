"""Engine batches as vLLM (0.11, 0.23, 0.26) and SGLang encode them, over real ZMQ sockets.

Each test publishes the bytes an engine version publishes (``engine_wire``) from a real PUB
socket, through the subscriber, sequencing and replay, into the router (issue #11).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvrouterd.clock import ManualClock
from kvrouterd.events import ZmqEndpoint, ZmqEventsConfig, ZmqEventSource
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, RouteRequest, WorkerState
from kvrouterd.router import Router, RouterSettings
from tests.integration.engine_wire import ALL_ENGINES, VLLM_023, VLLM_026, EngineWire, V26BlockStored
from tests.integration.test_zmq_events import FakeEngine

BS = 16  # the router's block size, as deployed
MODEL = "m"

Env = tuple[Router, ZmqEventSource, Callable[[EngineWire], Awaitable[FakeEngine]]]


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    ctx = zmq.asyncio.Context()
    router = Router(RouterSettings(block_size=BS), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    source = ZmqEventSource(  # wired as server/app.py wires it
        ZmqEventsConfig(topic="kv@", silence_s=5.0, replay_timeout_s=0.5),
        lambda batch: router.apply(batch, per_event=True),
        lambda wid, lost: router.reset_events(wid, lost=lost),
        ctx=ctx,
        rejected=lambda wid, counts, lost: router.note_rejected_events(wid, counts, lost_removal=lost),
    )
    engines: list[FakeEngine] = []

    async def start(wire: EngineWire) -> FakeEngine:
        engine = FakeEngine(ctx, new_replay_layout=wire.new_replay_layout)
        engines.append(engine)
        source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model=MODEL))
        await engine.wait_subscribed()
        return engine

    yield router, source, start
    await source.close()
    for e in engines:
        await e.close()
    ctx.term()


def prompt(start: int, tokens: int) -> list[int]:
    return list(range(start, start + tokens))


def matched(router: Router, tokens: list[int]) -> int:
    """Router blocks of ``tokens`` the worker holds as a prefix."""
    keys = block_keys(tokens, BS, MODEL)
    return router.index.match(keys, 1 << router.workers.get("w").slot).overlaps.get(0, 0)


async def publish(engine: FakeEngine, wire: EngineWire, *events: Any, drop: bool = False) -> int:
    return await engine.publish(raw=wire.batch(*events), drop=drop)


async def applied(source: ZmqEventSource, seq: int) -> None:
    await until(lambda: source.subscribers["w"].stats.last_sequence == seq)


def stored_prompt(wire: EngineWire, first_hash: int, tokens: list[int]) -> Any:
    """A chain from the root holding ``tokens``, in the engine's default pages (SGLang: one
    hash per token)."""
    page = wire.default_page
    return wire.stored([first_hash + i for i in range(len(tokens) // page)], tokens)


def unreadable_removal(wire: EngineWire) -> Any:
    """A BlockRemoved in the engine's own layout whose hash cannot be read (a float)."""
    return {"type": "BlockRemoved", "block_hashes": [1.5]} if wire.name == "vllm-0.26" else ["BlockRemoved", [1.5]]


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_a_store_the_router_cannot_take_never_costs_the_removal_beside_it(env: Env, wire: EngineWire) -> None:
    router, source, start = env
    engine = await start(wire)
    page = wire.default_page
    tokens = prompt(1000, 2 * BS)
    hashes = [0xA000 + i for i in range(2 * BS // page)]
    await publish(engine, wire, wire.stored(hashes, tokens))
    await applied(source, 0)
    assert matched(router, tokens) == 2
    # one scheduler step: the engine evicts the second block and stores an EAGLE "bigram"
    # page (token pairs) the router cannot key
    # page the router cannot key, and a store whose hashes do not match its pages
    bigram = wire.stored([0xB001], [[5, 6]] * page, page=page)
    miscounted = wire.stored([0xB002, 0xB003], prompt(9000, page), page=page)
    await publish(engine, wire, bigram, wire.removed(hashes[len(hashes) // 2:]), miscounted)
    await applied(source, 1)
    worker = router.workers.get("w")
    assert matched(router, tokens) == 1  # the removal was applied
    assert worker.events_rejected == {"malformed_stored": 1, "hash_count": 1}
    assert worker.state is WorkerState.READY  # a skipped store leaves no stale block


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_a_worker_whose_stores_are_all_rejected_does_not_look_healthy(env: Env, wire: EngineWire) -> None:
    router, source, start = env
    engine = await start(wire)
    page = wire.default_page
    for i in range(3):
        await publish(engine, wire, wire.stored([0xC000 + i], [[1, 2]] * page, page=page))
    await applied(source, 2)
    worker = router.workers.get("w")
    assert worker.state is WorkerState.DEGRADED and worker.state_reason == "stored events rejected"
    await publish(engine, wire, wire.stored([0xD000 + i for i in range(BS // page)], prompt(0, BS)))
    await applied(source, 3)
    assert worker.state is WorkerState.READY and worker.events_rejected == {"malformed_stored": 3}


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
@pytest.mark.parametrize("page", [1, 4, 32, 64])
async def test_engine_pages_of_any_size_map_onto_router_blocks(env: Env, wire: EngineWire, page: int) -> None:
    """SGLang's default page is 1 token, vLLM runs 32- or 64-token blocks: the router re-chunks
    the tokens into its 16-token blocks and still applies removals page by page."""
    router, source, start = env
    engine = await start(wire)
    tokens = prompt(5000, 128)  # 8 router blocks
    npages = len(tokens) // page
    hashes = [0xE000 + i for i in range(npages)]
    # stored in two chains, split mid-block for small pages, as a prefix grows over two steps
    cut = npages // 2 + (1 if page < BS else 0)
    await publish(engine, wire, wire.stored(hashes[:cut], tokens[: cut * page], page=page))
    await publish(engine, wire, wire.stored(hashes[cut:], tokens[cut * page:], hashes[cut - 1], page=page))
    await applied(source, 1)
    assert matched(router, tokens) == 8
    # the engine evicts the page holding token 80 (router block 5): blocks 0-4 stay a prefix
    victim = 80 // page
    await publish(engine, wire, wire.removed([hashes[victim]]))
    await applied(source, 2)
    assert matched(router, tokens) == victim * page // BS
    worker = router.workers.get("w")
    assert worker.events_rejected == {} and worker.state is WorkerState.READY


async def test_hybrid_groups_a_sliding_window_eviction_keeps_the_prefix(env: Env) -> None:
    """vLLM >= 0.24 hybrid models: every group reports the same hashes (issue #11 item 2)."""
    router, source, start = env
    wire = VLLM_026
    engine = await start(wire)
    tokens = prompt(300, 3 * BS)
    hashes = [0xF001, 0xF002, 0xF003]
    await publish(engine, wire,
                  wire.stored(hashes, tokens, group=0, kind="full_attention"),
                  wire.stored(hashes, tokens, group=1, kind="sliding_window"))
    await applied(source, 0)
    assert matched(router, tokens) == 3
    # the window slides past the first two blocks: full attention still holds them
    await publish(engine, wire, wire.removed(hashes[:2], group=1))
    await applied(source, 1)
    assert matched(router, tokens) == 3
    # full attention evicts the last block: the prefix now ends at block 2
    await publish(engine, wire, wire.removed(hashes[2:], group=0))
    await applied(source, 2)
    assert matched(router, tokens) == 2
    # blocks only a sliding-window group stores cannot serve a prefix on their own
    other = prompt(900, BS)
    await publish(engine, wire, wire.stored([0xF101], other, group=1, kind="sliding_window"))
    await applied(source, 3)
    assert matched(router, other) == 0
    # and a removal with no group drops a block from every group
    await publish(engine, wire, wire.removed(hashes[:1]))
    await applied(source, 4)
    assert matched(router, tokens) == 0


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_a_lost_removal_degrades_and_rebuilds_the_view_by_replay(env: Env, wire: EngineWire) -> None:
    router, source, start = env
    engine = await start(wire)
    tokens = prompt(0, 2 * BS)
    await publish(engine, wire, stored_prompt(wire, 1, tokens))
    # a removal whose hashes cannot be read (a float): it may have evicted anything
    await publish(engine, wire, unreadable_removal(wire))
    await applied(source, 1)
    worker = router.workers.get("w")
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.resyncs == 1)
    # the replay brings the same unreadable removal: the view stays DEGRADED, not silently READY
    assert worker.state is WorkerState.DEGRADED and worker.state_reason == "removal lost"
    assert worker.events_rejected["malformed_removed"] == 2
    # the engine clears its cache: the view is right again
    await publish(engine, wire, wire.cleared(), stored_prompt(wire, 300, prompt(7000, BS)))
    await applied(source, 2)
    assert worker.state is WorkerState.READY and matched(router, prompt(7000, BS)) == 1


async def test_rejected_events_survive_a_gap_replay_in_the_old_replay_layout(env: Env) -> None:
    """vLLM <= 0.25 replays ``[b"", seq, payload]``; the replayed batch is applied event by event too."""
    router, source, start = env
    wire = ALL_ENGINES[0]
    engine = await start(wire)
    tokens = prompt(100, 2 * BS)
    await publish(engine, wire, wire.stored([1, 2], tokens))
    await publish(engine, wire, wire.removed([2]), wire.stored([9], [[1, 2]] * BS), drop=True)  # lost live
    await publish(engine, wire, wire.stored([3], prompt(4000, BS)))
    await applied(source, 2)
    assert source.subscribers["w"].stats.replays_ok == 1
    assert matched(router, tokens) == 1
    assert router.workers.get("w").events_rejected == {"malformed_stored": 1}


async def _restart_on_same_port(engine: FakeEngine) -> None:
    """The engine process dies and comes back on the same address with an empty cache:
    the subscriber's TCP connection drops and ZMQ reconnects it by itself."""
    port = engine.port
    engine.pub.close(0)
    engine.pub = engine.ctx.socket(zmq.XPUB)
    engine.pub.setsockopt(zmq.LINGER, 0)
    engine.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    for _ in range(200):  # the old socket lets go of the port asynchronously
        try:
            engine.pub.bind(f"tcp://127.0.0.1:{port}")
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"port {port} stayed busy")
    engine.restart()


def _pages(wire: EngineWire, first: int, tokens: list[int]) -> list[int]:
    return [first + i for i in range(len(tokens) // wire.default_page)]


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_a_restart_the_sequence_hides_is_caught_by_the_replay_after_a_reconnect(env: Env, wire: EngineWire) -> None:
    """Issue #11 item 7: the engine restarts while we are disconnected and publishes exactly
    as many batches as we expect; the next one continues our sequence."""
    router, source, start = env
    engine = await start(wire)
    old = prompt(0, BS)
    for i in range(3):
        tokens = prompt(1000 * i, BS)
        await publish(engine, wire, wire.stored(_pages(wire, 1000 * (i + 1), tokens), tokens))
    await applied(source, 2)
    await _restart_on_same_port(engine)
    new = [prompt(50_000 + 1000 * i, BS) for i in range(4)]
    for i in range(3):  # published while nobody is connected: lost for us, kept for replay
        await publish(engine, wire, wire.stored(_pages(wire, 90_000 + 1000 * i, new[i]), new[i]), drop=True)
    await engine.wait_subscribed()
    await publish(engine, wire, wire.stored(_pages(wire, 99_000, new[3]), new[3]))  # sequence 3: as expected
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.restarts == 1 and sub.stats.last_sequence == 3)
    assert sub.stats.run_checks == 1
    assert matched(router, old) == 0  # the old run's blocks are gone
    assert all(matched(router, p) == 1 for p in new)  # the new run's, replayed from 0, are there
    assert router.workers.get("w").state is WorkerState.READY


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_a_restart_that_published_more_batches_than_expected_is_not_replayed_as_a_gap(
        env: Env, wire: EngineWire) -> None:
    """Issue #28 item 11: the new run published more batches than we expect while we were
    disconnected, so its first live batch looks like an ordinary gap. Replaying the missing
    range of the new run onto the old view would keep the old run's blocks as false hits and
    never apply the new run's first batches."""
    router, source, start = env
    engine = await start(wire)
    old = [prompt(1000 * i, BS) for i in range(3)]
    for i, tokens in enumerate(old):
        await publish(engine, wire, wire.stored(_pages(wire, 1000 * (i + 1), tokens), tokens))
    await applied(source, 2)
    await _restart_on_same_port(engine)
    new = [prompt(50_000 + 1000 * i, BS) for i in range(6)]
    for i in range(5):  # sequences 0-4 of the new run, published while nobody is connected
        await publish(engine, wire, wire.stored(_pages(wire, 90_000 + 1000 * i, new[i]), new[i]), drop=True)
    await engine.wait_subscribed()
    await publish(engine, wire, wire.stored(_pages(wire, 99_000, new[5]), new[5]))  # sequence 5: we expect 3
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.last_sequence == 5)
    assert sub.stats.restarts == 1 and sub.stats.run_checks == 1
    assert all(matched(router, p) == 0 for p in old)  # no false hit on the old run's blocks
    assert all(matched(router, p) == 1 for p in new)  # every batch of the new run, 0 included
    assert router.workers.get("w").state is WorkerState.READY


async def test_a_reconnect_without_a_restart_changes_nothing(env: Env) -> None:
    router, source, start = env
    wire = VLLM_026
    engine = await start(wire)
    await publish(engine, wire, wire.stored([1], prompt(0, BS)))
    await applied(source, 0)
    port, buffered, seq = engine.port, list(engine.buffer), engine.seq
    await _restart_on_same_port(engine)  # a dropped connection: same process state below
    engine.buffer, engine.seq = buffered, seq
    await engine.wait_subscribed()
    await publish(engine, wire, wire.stored([2], prompt(100, BS)))
    sub = source.subscribers["w"]
    await applied(source, 1)
    assert engine.port == port and sub.stats.run_checks == 1 and sub.stats.restarts == 0
    assert matched(router, prompt(0, BS)) == 1 and matched(router, prompt(100, BS)) == 1


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_a_batch_timestamp_going_back_triggers_the_check(env: Env, wire: EngineWire) -> None:
    router, source, start = env
    engine = await start(wire)
    await engine.publish(raw=wire.batch(stored_prompt(wire, 100, prompt(0, BS)), ts=1000.0))
    await applied(source, 0)
    engine.restart()  # a new run, on a clock that is behind, whose first batch we never saw
    await engine.publish(raw=wire.batch(stored_prompt(wire, 700, prompt(700, BS)), ts=10.0), drop=True)
    await engine.publish(raw=wire.batch(stored_prompt(wire, 800, prompt(800, BS)), ts=11.0))
    sub = source.subscribers["w"]
    await until(lambda: sub.stats.restarts == 1 and sub.stats.last_sequence == 1)
    assert matched(router, prompt(0, BS)) == 0 and matched(router, prompt(700, BS)) == 1


async def test_a_subscriber_that_dies_degrades_its_worker_and_is_restarted() -> None:
    """Issue #11 item 6: whatever kills the subscriber, the worker must not look healthy on a
    dead feed, and the feed comes back by itself."""
    ctx = zmq.asyncio.Context()
    router = Router(RouterSettings(block_size=BS), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    calls = {"n": 0}

    def flaky_apply(batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug in the apply path")
        return router.apply(batch, per_event=True)

    source = ZmqEventSource(ZmqEventsConfig(topic="kv@", replay_timeout_s=0.5, reconnect_ivl_ms=50), flaky_apply,
                            lambda wid, lost: router.reset_events(wid, lost=lost), ctx=ctx)
    wire = VLLM_026
    engine = FakeEngine(ctx)
    try:
        source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model=MODEL))
        await engine.wait_subscribed()
        await publish(engine, wire, wire.stored([1], prompt(0, BS)))
        await publish(engine, wire, wire.stored([2], prompt(100, BS)))  # the apply path blows up here
        worker = router.workers.get("w")
        await until(lambda: source.subscribers["w"].stats.subscriber_restarts == 1)
        assert worker.state is WorkerState.DEGRADED or router.index.count(worker.slot) < 2
        # the fresh subscriber joins by replay from 0 and rebuilds the view
        await engine.wait_subscribed()
        await publish(engine, wire, wire.stored([3], prompt(200, BS)))
        await until(lambda: router.index.count(worker.slot) == 3)
        assert worker.state is WorkerState.READY
    finally:
        await source.close()
        await engine.close()
        ctx.term()


async def test_multimodal_extra_keys_keep_different_images_apart(env: Env) -> None:
    """vLLM hashes each block's extra keys (image content hashes) with its tokens: the same
    placeholder tokens behind two images are two different prefixes (issue #11 item 5)."""
    router, source, start = env
    wire = VLLM_026
    engine = await start(wire)
    placeholders = [9] * (2 * BS)  # the image's placeholder tokens, identical for every image
    # vLLM's extras per block: the LoRA name, then (image identifier, offset in the block)
    image_a = V26BlockStored([1, 2], None, placeholders, BS, None, None, "sql",
                             extra_keys=[("sql", ("mm-hash-a", 0)), ("sql", ("mm-hash-a", -BS))])
    image_b = V26BlockStored([3, 4], None, placeholders, BS, None, None, "sql",
                             extra_keys=[("sql", ("mm-hash-b", 0)), ("sql", ("mm-hash-b", -BS))])
    text = V26BlockStored([5], None, prompt(0, BS), BS, None, None, "sql", extra_keys=[("sql",)])
    await publish(engine, wire, image_a, image_b, text)
    await applied(source, 0)
    slot = router.workers.get("w").slot
    assert router.index.count(slot) == 5  # two images: two chains, not one shared prefix
    plain = block_keys(placeholders, BS, MODEL, "sql")
    assert router.index.match(plain, 1 << slot).overlaps.get(0, 0) == 0  # no false hit for text-only keys
    # the adapter's name in every block's extras is the lora salt, not an extra: text matches
    assert router.index.match(block_keys(prompt(0, BS), BS, MODEL, "sql"), 1 << slot).overlaps.get(0, 0) == 1


@pytest.mark.parametrize("wire", ALL_ENGINES, ids=lambda w: w.name)
async def test_an_engine_cache_salt_separates_tenants_and_a_salted_route_matches(env: Env, wire: EngineWire) -> None:
    """SGLang's ``cache_salt`` on a stored event salts the chain; a Route with the same salt
    matches it, any other does not (issue #11 item 5). Sent in each engine's event layout, as
    a map field (the field positional layouts do not have)."""
    router, source, start = env
    engine = await start(wire)
    tokens = prompt(0, 2 * BS)
    hashes = _pages(wire, 1, tokens)
    event = msgspec.to_builtins(wire.stored(hashes, tokens))
    if isinstance(event, list):  # positional layouts: name the fields as the map layout does
        names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
        event = {"type": event[0], **dict(zip(names, event[1:]))}
    event["cache_salt"] = "tenant-a"
    await publish(engine, wire, event)
    await applied(source, 0)
    slot = 1 << router.workers.get("w").slot
    salted = router.keys_for_tokens(tokens, MODEL, "", "tenant-a")
    assert router.index.match(salted, slot).overlaps.get(0, 0) == 2
    assert router.index.match(router.keys_for_tokens(tokens, MODEL, "", "tenant-b"), slot).overlaps.get(0, 0) == 0
    assert matched(router, tokens) == 0


async def test_lora_id_only_events_map_to_the_configured_adapter_name() -> None:
    ctx = zmq.asyncio.Context()
    router = Router(RouterSettings(block_size=BS), ManualClock())
    router.add_worker(WorkerSpec(id="w", address="w:1", mode=CacheMode.EVENTS))
    source = ZmqEventSource(
        ZmqEventsConfig(topic="kv@", replay_timeout_s=0.5, lora_ids={"7": "sql-adapter"}),
        lambda batch: router.apply(batch, per_event=True), lambda wid, lost: router.reset_events(wid, lost=lost),
        ctx=ctx, rejected=lambda wid, counts, lost: router.note_rejected_events(wid, counts, lost_removal=lost),
    )
    wire = ALL_ENGINES[0]  # vLLM 0.11: lora_id, no lora_name
    engine = FakeEngine(ctx, new_replay_layout=False)
    try:
        source.add(ZmqEndpoint("w", engine.endpoint, engine.replay_endpoint, model=MODEL))
        await engine.wait_subscribed()
        tokens = prompt(0, BS)
        await publish(engine, wire, wire.stored([1], tokens, lora_id=7), wire.stored([2], prompt(99, BS), lora_id=8))
        await applied(source, 0)
        slot = router.workers.get("w").slot
        assert router.index.match(block_keys(tokens, BS, MODEL, "sql-adapter"), 1 << slot).overlaps.get(0, 0) == 1
        assert router.index.match(block_keys(tokens, BS, MODEL, "7"), 1 << slot).overlaps.get(0, 0) == 0
        assert router.workers.get("w").events_rejected == {"unknown_lora_id": 1}
    finally:
        await source.close()
        await engine.close()
        ctx.term()


@pytest.mark.parametrize("wire", [VLLM_023, VLLM_026], ids=lambda w: w.name)
async def test_an_adapter_whose_blocks_a_vllm_worker_stores_is_loaded_there_and_draws_its_requests(
    env: Env, wire: EngineWire
) -> None:
    """vLLM names the adapter of every stored block (``lora_name``): the router takes it as
    loaded on that worker (issue #31 item 2), and a request for the adapter goes there rather
    than to an idle worker that would have to load it, though nothing of its prompt is cached."""
    router, source, start = env
    router.add_worker(WorkerSpec(id="idle", address="idle:1", max_loras=1))
    engine = await start(wire)
    tokens = prompt(0, BS)
    await publish(engine, wire, wire.stored([1], tokens, lora_name="sql-lora"))
    await applied(source, 0)
    assert list(router.workers.get("w").loras) == ["sql-lora"]
    assert router.index.match(block_keys(tokens, BS, MODEL, "sql-lora"), 1 << router.workers.get("w").slot).overlaps
    router.route(RouteRequest("busy", [7], BS, model=MODEL, lora="other"))  # one request in flight, "other" loaded
    result = router.route(RouteRequest("r", block_keys(prompt(500, BS), BS, MODEL, "sql-lora"), BS, model=MODEL,
                                       lora="sql-lora"))
    assert result.worker.id == "w" and result.decision.lora_placement == "loaded"


async def test_vllm_cache_salt_in_the_first_blocks_extras_salts_the_chain_like_a_routes_cache_salt(env: Env) -> None:
    """vLLM puts ``request.cache_salt`` in the extras of the block at token 0: the chain is
    keyed as a Route with that ``cache_salt`` keys it, so tenants never share a prefix and
    the tenant itself still hits (issue #11 item 5)."""
    router, source, start = env
    wire = VLLM_026
    engine = await start(wire)
    tokens = prompt(0, 2 * BS)
    salted = V26BlockStored([1, 2], None, tokens, BS, None, None, None, extra_keys=[("tenant-a",), None])
    child = V26BlockStored([3], 2, prompt(1000, BS), BS, None, None, None)
    await publish(engine, wire, salted, child)
    await applied(source, 0)
    slot = router.workers.get("w").slot
    whole = tokens + prompt(1000, BS)
    assert router.index.match(block_keys(whole, BS, MODEL, salt="tenant-a"), 1 << slot).overlaps.get(0, 0) == 3
    assert router.index.match(block_keys(whole, BS, MODEL, salt="tenant-b"), 1 << slot).overlaps.get(0, 0) == 0
    assert router.index.match(block_keys(whole, BS, MODEL), 1 << slot).overlaps.get(0, 0) == 0
