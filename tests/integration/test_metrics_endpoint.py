"""The Prometheus endpoint scraped over real HTTP after real gRPC routes and events."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

from .test_daemon import BS, publish, register, stored


@pytest.fixture
def daemon_config():
    return {"metrics": {"listen": "127.0.0.1:0"}}


def _get(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


async def scrape(running, path: str = "/metrics") -> tuple[int, str, str]:
    # urllib blocks: run it in a thread so the daemon's loop can answer
    return await asyncio.to_thread(_get, running.daemon.metrics_endpoint.port, path)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one series ``name{labels...}`` (labels matched as a subset)."""
    found = []
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append(float(m.group(4)))
    assert len(found) == 1, f"{name}{labels}: {len(found)} series match"
    return found[0]


async def test_scrape_reports_decisions_prefix_hits_events_and_workers(running):
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    prompt = list(range(100, 100 + 8 * BS))
    await publish(
        stub,
        pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt[: 6 * BS], list(range(1, 7)))]),
        pb.EventBatch(worker_id="b", sequence=0, events=[stored(prompt[: 2 * BS], list(range(11, 13)))]),
        pb.EventBatch(worker_id="b", sequence=5, events=[]),  # a gap on b
    )
    # a holds 6 blocks, b 2: picking a is picking the best reachable prefix
    r1 = await stub.Route(pb.RouteRequest(token_ids=prompt))
    assert r1.worker_id == "a"
    # a cold prompt: no candidate holds any of it
    r2 = await stub.Route(pb.RouteRequest(token_ids=list(range(9000, 9000 + 4 * BS))))

    status, ctype, text = await scrape(running)
    assert status == 200 and ctype.startswith("text/plain")
    assert sample(text, "kvrouter_decisions_total", policy="cache_aware", reason="prefix_match") == 1
    assert sample(text, "kvrouter_route_duration_seconds_count", policy="cache_aware") == 2
    # the route latency histogram has sub-millisecond buckets
    assert 'le="0.001"' in text
    assert sample(text, "kvrouter_prefix_decisions_total", policy="cache_aware", picked="best") == 1
    assert sample(text, "kvrouter_prefix_decisions_total", policy="cache_aware", picked="no_prefix") == 1
    assert sample(text, "kvrouter_prefix_decisions_total", policy="cache_aware", picked="worse") == 0
    assert sample(text, "kvrouter_prefix_achieved_blocks_total", policy="cache_aware") == 6
    assert sample(text, "kvrouter_prefix_reachable_blocks_total", policy="cache_aware") == 6
    assert sample(text, "kvrouter_worker_event_batches_total", worker="a") == 1
    assert sample(text, "kvrouter_worker_event_batches_total", worker="b") == 2
    assert sample(text, "kvrouter_worker_event_gaps_total", worker="b") == 1
    assert sample(text, "kvrouter_worker_event_gaps_total", worker="a") == 0
    assert sample(text, "kvrouter_workers", mode="events", state="degraded") == 1
    assert sample(text, "kvrouter_workers", mode="events", state="ready") == 1
    inflight = {"a": 1, "b": 0}
    inflight[r2.worker_id] += 1
    for wid, n in inflight.items():
        assert sample(text, "kvrouter_worker_inflight_requests", worker=wid) == n
    assert sample(text, "kvrouter_inflight_requests") == 2
    assert sample(text, "kvrouter_index_blocks") == 6
    assert sample(text, "process_resident_memory_bytes") > 0

    # a completion releases the in-flight gauges by the next scrape
    await stub.Complete(pb.CompleteRequest(request_id=r1.request_id, success=True))
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_worker_inflight_requests", worker="a") == inflight["a"] - 1
    assert sample(text, "kvrouter_inflight_requests") == 1


async def test_event_batches_and_blocks_are_counted_by_outcome_and_op(running):
    """kvrouter.events.batches{outcome} and .blocks{op} (plain ints observed at collection):
    each series appears once something was counted under it, as with an SDK counter."""
    stub = running.stub
    await register(stub, "a")
    _, _, text = await scrape(running)
    assert "kvrouter_events_batches_total" not in text and "kvrouter_events_blocks_total" not in text
    prompt = list(range(100, 100 + 3 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, [1, 2, 3])]),
                  pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, [1, 2, 3])]))  # a duplicate
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_events_batches_total", outcome="applied") == 1
    assert sample(text, "kvrouter_events_batches_total", outcome="duplicate") == 1
    assert sample(text, "kvrouter_events_blocks_total", op="stored") == 3
    assert 'outcome="rejected"' not in text and 'op="removed"' not in text
    removed = pb.CacheEvent(removed=pb.RemovedBlocks(engine_hashes=[3, 2]))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=1, events=[removed]))
    with pytest.raises(grpc.aio.AioRpcError):  # 5 tokens: not whole blocks, the batch is rejected
        await publish(stub, pb.EventBatch(worker_id="a", sequence=2, events=[stored(list(range(5)), [9])]))
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_events_batches_total", outcome="applied") == 2
    assert sample(text, "kvrouter_events_batches_total", outcome="rejected") == 1
    assert sample(text, "kvrouter_events_blocks_total", op="stored") == 3
    assert sample(text, "kvrouter_events_blocks_total", op="removed") == 2


@pytest.mark.parametrize("daemon_config", [{"metrics": {"listen": "127.0.0.1:0"}, "speculative": {"ttl_s": 10}}])
async def test_speculative_blocks_are_counted_by_how_they_ended(running):
    """kvrouter.speculative.blocks{outcome} and .live_blocks: a routed prompt's blocks count as
    cached until its engine's Stored confirms them, or a failed request drops them."""
    stub = running.stub
    await register(stub, "a")
    prompt = list(range(100, 100 + 4 * BS))
    r1 = await stub.Route(pb.RouteRequest(token_ids=prompt))
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_speculative_live_blocks") == 4
    # the engine stores 3 of the 4 so far (chunked prefill)
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt[: 3 * BS], [1, 2, 3])]))
    r2 = await stub.Route(pb.RouteRequest(token_ids=list(range(5000, 5000 + 2 * BS))))
    await stub.Complete(pb.CompleteRequest(request_id=r2.request_id, success=False))
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_speculative_blocks_total", outcome="confirmed") == 3
    assert sample(text, "kvrouter_speculative_blocks_total", outcome="dropped") == 2
    assert sample(text, "kvrouter_speculative_blocks_total", outcome="expired") == 0
    assert sample(text, "kvrouter_speculative_live_blocks") == 1
    assert r1.worker_id == "a"


async def test_a_worse_pick_is_counted_when_a_policy_ignores_the_cache(running):
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    prompt = list(range(50, 50 + 4 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, [1, 2, 3, 4])]))
    picks = [(await stub.Route(pb.RouteRequest(token_ids=prompt, policy="round_robin"))).worker_id for _ in range(2)]
    assert sorted(picks) == ["a", "b"]
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_prefix_decisions_total", policy="round_robin", picked="best") == 1
    assert sample(text, "kvrouter_prefix_decisions_total", policy="round_robin", picked="worse") == 1
    assert sample(text, "kvrouter_prefix_achieved_blocks_total", policy="round_robin") == 4
    assert sample(text, "kvrouter_prefix_reachable_blocks_total", policy="round_robin") == 8


async def test_the_maintenance_tick_records_queued_route_latencies(running):
    await register(running.stub, "a")
    await running.stub.Route(pb.RouteRequest(token_ids=list(range(4 * BS))))
    latency = running.daemon.metrics.route_latency
    assert latency.enabled
    for _ in range(50):  # a few ticks (20 ms each)
        if not latency._pending:
            break
        await asyncio.sleep(0.02)
    assert not latency._pending


async def test_only_get_metrics_is_served(running):
    status, _, body = await scrape(running, "/")
    assert status == 404 and "/metrics" in body
    status, _, _ = await scrape(running, "/metrics?name[]=x")
    assert status == 200


async def test_no_endpoint_unless_configured():
    from kvrouterd.config import parse_config
    from kvrouterd.server.app import Daemon

    daemon = Daemon(parse_config({"listen": "127.0.0.1:0"}))
    assert daemon.metrics_endpoint is None


async def test_event_source_replays_are_exported_per_worker(running):
    from kvrouterd.events import SubscriberStats

    stats = {"gpu-0": SubscriberStats(replays_ok=3, replays_failed=1)}
    running.daemon.ops_metrics.add_event_source(lambda: stats)
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_worker_event_replays_total", worker="gpu-0", outcome="ok") == 3
    assert sample(text, "kvrouter_worker_event_replays_total", worker="gpu-0", outcome="failed") == 1
    stats["gpu-0"].replays_ok += 1
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_worker_event_replays_total", worker="gpu-0", outcome="ok") == 4


async def test_the_daemons_zmq_source_feeds_the_replay_metric(running):
    assert running.daemon.events is not None
    assert running.daemon.events.stats in running.daemon.ops_metrics.event_sources


async def test_scrape_reports_what_complete_reports_per_worker_policy_and_model(running):
    stub = running.stub
    await register(stub, "a")
    prompt = list(range(100, 100 + 8 * BS))
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt[: 6 * BS], list(range(1, 7)))]))
    assert (await stub.Route(pb.RouteRequest(token_ids=prompt, request_id="r1"))).worker_id == "a"
    # the engine saw 4 blocks cached where the router predicted 6
    await stub.Complete(pb.CompleteRequest(request_id="r1", ttft_ms=120.0, e2e_ms=900.0, cached_tokens=4 * BS))
    await stub.Route(pb.RouteRequest(token_ids=prompt, request_id="r2", model="m1"))
    await stub.Complete(pb.CompleteRequest(request_id="r2", ttft_ms=30.0, e2e_ms=400.0, cached_tokens=-1))  # engine did not say
    _, _, text = await scrape(running)

    labels = {"worker": "a", "policy": "cache_aware"}
    # a request without a model: Prometheus shows the absent label as empty
    assert sample(text, "kvrouter_request_ttft_seconds_count", **labels, model="") == 1
    assert sample(text, "kvrouter_request_ttft_seconds_sum", **labels, model="") == pytest.approx(0.12)
    assert sample(text, "kvrouter_request_e2e_seconds_sum", **labels, model="") == pytest.approx(0.9)
    assert sample(text, "kvrouter_request_ttft_seconds_sum", **labels, model="m1") == pytest.approx(0.03)
    assert sample(text, "kvrouter_request_e2e_seconds_bucket", **labels, model="m1", le="0.5") == 1
    # only the completion whose engine reported cached tokens counts toward the hit rate
    assert sample(text, "kvrouter_completed_prompt_tokens_total", worker="a") == 8 * BS
    assert sample(text, "kvrouter_completed_cached_tokens_total", worker="a", source="engine") == 4 * BS
    assert sample(text, "kvrouter_completed_cached_tokens_total", worker="a", source="router") == 6 * BS
    assert 'model="m1"' not in "".join(line for line in text.splitlines() if line.startswith("kvrouter_completed_"))

    import kvrouterd

    assert sample(text, "kvrouter_build_info", version=kvrouterd.__version__) == 1


async def test_a_route_under_a_namespace_no_engine_stored_is_counted_and_logged_once(running, caplog):
    stub = running.stub
    await register(stub, "a")
    prompt = list(range(100, 100 + 4 * BS))
    # no events yet: a cold cache is not a mismatch
    await stub.Route(pb.RouteRequest(token_ids=prompt, model="llama"))
    event = stored(prompt, list(range(1, 5)))
    event.stored.model = "llama"
    await publish(stub, pb.EventBatch(worker_id="a", sequence=0, events=[event]))
    assert (await stub.Route(pb.RouteRequest(token_ids=prompt, model="llama"))).matched_blocks == 4
    with caplog.at_level("WARNING", logger="kvrouterd"):
        for _ in range(3):  # the gateway forgot the model name: keys in another namespace
            await stub.Route(pb.RouteRequest(token_ids=prompt))
        call = stub.RouteStream()
        await call.write(pb.RouteStreamRequest(id=1, route=pb.RouteRequest(token_ids=prompt, lora="x")))
        assert (await call.read()).route.worker_id == "a"
        await call.done_writing()
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_route_namespace_misses_total", model="", lora="") == 3
    assert sample(text, "kvrouter_route_namespace_misses_total", model="", lora="x") == 1
    assert "kvrouter_route_namespace_misses_total{lora=\"\",model=\"llama\"}" not in text
    warnings = [r.getMessage() for r in caplog.records if "no engine has stored blocks" in r.getMessage()]
    assert len(warnings) == 2 and "only under model='llama' lora=''" in warnings[0]


async def test_policy_rule_counts_are_exported_once_the_policy_decides(running):
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    _, _, text = await scrape(running)
    assert "kvrouter_policy_rule_fired_total" not in text  # cache_aware keeps no rule counts
    await stub.Route(pb.RouteRequest(token_ids=list(range(70, 70 + 4 * BS)), policy="dualmap"))
    _, _, text = await scrape(running)
    policy = running.daemon.router.routing_policy("dualmap")
    for rule in ("decode_bottleneck_decisions", "decode_bottleneck_moves"):
        assert sample(text, "kvrouter_policy_rule_fired_total", policy="dualmap", rule=rule) == policy.counters()[rule] == 0
    assert "kvrouter_admission_migrations_total" not in text  # no admission queue, no migrations series


async def test_a_deregistered_workers_series_are_dropped(running):
    """Issue #16 item 7: worker churn must not grow the exported series forever."""
    stub = running.stub
    for wid in ("gone", "kept"):
        await register(stub, wid)
    prompt = list(range(100, 100 + 4 * BS))
    for i, wid in enumerate(("gone", "kept")):
        await publish(stub, pb.EventBatch(worker_id=wid, sequence=0, events=[stored(prompt, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4])]),
                      pb.EventBatch(worker_id=wid, sequence=3, events=[]))  # a gap: kvrouter_events_gaps_total{worker}
        await stub.Route(pb.RouteRequest(token_ids=prompt, request_id=f"r-{wid}", candidate_workers=[wid], model="m"))
        await stub.Complete(pb.CompleteRequest(request_id=f"r-{wid}", ttft_ms=50.0, e2e_ms=500.0, cached_tokens=BS))
    await stub.Route(pb.RouteRequest(token_ids=prompt, request_id="open", candidate_workers=["gone"]))  # in flight
    _, _, before = await scrape(running)

    def series_of(text: str, worker: str) -> set[str]:
        return {line.split("{")[0] for line in text.splitlines()
                if not line.startswith("#") and f'worker="{worker}"' in line}

    gone_before = series_of(before, "gone")
    # every kind of per-worker series exists before: sync counters and histograms, observable gauges
    assert {"kvrouter_events_gaps_total", "kvrouter_request_ttft_seconds_count", "kvrouter_request_e2e_seconds_bucket",
            "kvrouter_completed_prompt_tokens_total", "kvrouter_completed_cached_tokens_total",
            "kvrouter_worker_cached_blocks", "kvrouter_worker_event_batches_total", "kvrouter_worker_event_gaps_total",
            "kvrouter_worker_inflight_requests"} <= gone_before
    kept_before = series_of(before, "kept")

    await stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="gone"))
    _, _, after = await scrape(running)
    assert series_of(after, "gone") == set()
    assert series_of(after, "kept") == kept_before  # the other worker's series stay, values intact
    assert sample(after, "kvrouter_request_ttft_seconds_count", worker="kept", policy="cache_aware", model="m") == 1
    assert sample(after, "kvrouter_events_gaps_total", worker="kept") == 1

    # a worker registered again under the same id starts its series afresh
    await register(stub, "gone")
    await publish(stub, pb.EventBatch(worker_id="gone", sequence=0, events=[]), pb.EventBatch(worker_id="gone", sequence=2, events=[]))
    _, _, again = await scrape(running)
    assert sample(again, "kvrouter_events_gaps_total", worker="gone") == 1


async def test_route_stream_batches_and_their_items_are_counted(running):
    await register(running.stub, "a")
    prompt = list(range(100, 100 + 2 * BS))
    call = running.stub.RouteStream()
    items = [pb.RouteStreamRequest(id=i, route=pb.RouteRequest(token_ids=prompt)) for i in range(3)]
    await call.write(pb.RouteStreamRequest(id=9, route=pb.RouteRequest(token_ids=prompt)))  # single: not counted
    await call.read()
    await call.write(pb.RouteStreamRequest(batch=pb.RouteStreamRequestBatch(items=items)))
    assert len((await call.read()).batch.items) == 3
    await call.done_writing()
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_route_stream_batches_total") == 1
    assert sample(text, "kvrouter_route_stream_batch_items_total") == 3


async def test_internal_errors_and_rejections_are_exported_by_rpc(running, monkeypatch):
    """Issue #28 items 5 and 9: ``kvrouter_internal_errors_total{rpc}`` and
    ``kvrouter_rpc_rejected_total{rpc,code}``."""
    await register(running.stub, "a")
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError):
            await running.stub.Route(pb.RouteRequest())  # no prompt
    with pytest.raises(grpc.aio.AioRpcError):
        await running.stub.DeregisterWorker(pb.DeregisterWorkerRequest(worker_id="ghost"))

    def broken(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("a handler bug")

    monkeypatch.setattr(running.router, "decide", broken)  # every Route decides
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await running.stub.Route(pb.RouteRequest(token_ids=list(range(2 * BS))))
        assert err.value.code() == grpc.StatusCode.INTERNAL
    _, _, text = await scrape(running)
    assert sample(text, "kvrouter_rpc_rejected_total", rpc="Route", code="INVALID_ARGUMENT") == 3
    assert sample(text, "kvrouter_rpc_rejected_total", rpc="DeregisterWorker", code="NOT_FOUND") == 1
    assert sample(text, "kvrouter_internal_errors_total", rpc="Route") == 2


async def test_router_state_is_read_on_the_event_loop_and_the_rest_of_a_scrape_off_it(running, monkeypatch):
    import threading

    from opentelemetry.metrics import Observation
    from prometheus_client.metrics_core import GaugeMetricFamily

    daemon = running.daemon
    read_on: list[int] = []
    translated_on: list[int] = []

    def observe(_):
        read_on.append(threading.get_ident())
        yield Observation(len(daemon.router.workers))

    # as the daemon's own instruments register theirs
    daemon.loop_reads.meter(daemon.meter_provider.get_meter("probe")).create_observable_gauge("probe.workers", [observe])

    class Exporter:
        def collect(self):
            translated_on.append(threading.get_ident())
            yield GaugeMetricFamily("probe_exporter", "where the exporter side ran", value=1)

    daemon.metrics_endpoint.registry.register(Exporter())
    # two of the daemon's own callbacks (its Metrics', its ops metrics') read the router through these
    for name in ("decode_workers_without_events", "policy_counters"):
        real = getattr(daemon.router, name)
        monkeypatch.setattr(daemon.router, name, lambda real=real: (read_on.append(threading.get_ident()), real())[1])
    read_on.clear()
    translated_on.clear()
    status, _, text = await scrape(running)
    assert status == 200 and "probe_workers 0.0" in text and "probe_exporter 1.0" in text
    assert read_on == [threading.get_ident()] * 3  # the loop's: router state is read between its updates
    assert translated_on and threading.get_ident() not in translated_on  # the rest on the HTTP server's


async def test_a_slow_scrape_does_not_hold_the_event_loop(running):
    """At 1,024 workers a collection took 200-250 ms, all of it on the loop while it ran there."""
    import time

    from prometheus_client.metrics_core import GaugeMetricFamily

    class Slow:
        def collect(self):
            time.sleep(0.5)  # as a big translation would take, minus the GIL it holds
            yield GaugeMetricFamily("probe_slow", "a slow part of a collection", value=1)

    running.daemon.metrics_endpoint.registry.register(Slow())
    longest = 0.0
    scraping = asyncio.ensure_future(scrape(running))
    while not scraping.done():
        started = time.perf_counter()
        await asyncio.sleep(0.01)
        longest = max(longest, time.perf_counter() - started)
    status, _, text = await scraping
    assert status == 200 and "probe_slow 1.0" in text
    assert longest < 0.25, f"the loop was held {longest:.3f} s during a scrape"
