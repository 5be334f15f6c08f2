"""The chart's alerts and Grafana dashboard query only series a real kvrouterd exports.

A ``kvrouterd serve`` process is driven until every family it exports has a series (routes, a
rejected route, event batches with a gap, a ZMQ worker's replay counters, an event its wire
could not apply, completions with TTFT and cached tokens, a Route under an unknown model), then
scraped over HTTP on loopback. Every
PromQL expression of the rendered PrometheusRule and of the dashboard is parsed with
``promql-parser`` and each metric it selects must be in that scrape, with every label it
matches on or groups by either on that metric or added by Prometheus at scrape time.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import promql_parser
import pytest
import yaml

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb

from kvrouterd.telemetry.metrics import ROUTE_ERROR_CODES

from .test_daemon import BS, publish, register, stored
from .test_metrics_endpoint import sample, scrape

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvrouterd"
RELEASE, NAMESPACE = "kvr", "llm"
# labels Prometheus (through the ServiceMonitor) puts on every scraped series
TARGET_LABELS = {"job", "namespace", "pod", "instance", "service", "endpoint", "container"}
# series Prometheus makes itself, not the daemon
PROMETHEUS_SERIES = {"up": set()}
# Grafana's built-in interval; any duration parses the same
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m"}


@pytest.fixture
def daemon_config():
    return {"metrics": {"listen": "127.0.0.1:0"}}


def exported(text: str) -> dict[str, set[str]]:
    """Metric name -> label names, from a Prometheus text-format scrape."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if m := re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? \S+$", line):
            out.setdefault(m[1], set()).update(re.findall(r'(\w+)="', m[2] or ""))
    return out


async def scrape_everything(running) -> dict[str, set[str]]:  # type: ignore[no-untyped-def]
    stub = running.stub
    for wid in ("a", "b"):
        await register(stub, wid)
    prompt = list(range(100, 100 + 4 * BS))
    await publish(
        stub,
        pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, [1, 2, 3, 4])]),
        pb.EventBatch(worker_id="b", sequence=3, events=[]),  # a gap on b
    )
    routed = await stub.Route(pb.RouteRequest(token_ids=prompt))
    await stub.Complete(pb.CompleteRequest(request_id=routed.request_id, success=True))
    with pytest.raises(Exception):  # noqa: B017 - any rejection: only the error counter matters
        await stub.Route(pb.RouteRequest(token_ids=prompt, policy="no_such_policy"))
    running.daemon.ops_metrics.add_event_source(lambda: {"a": _Replays()})
    # events the engine wire refused (tests/integration/test_engine_wire.py makes real ones)
    running.router.workers.get("a").events_rejected["malformed_stored"] = 1
    _, _, text = await scrape(running)
    return exported(text)


class _Replays:
    replays_ok = 2
    replays_failed = 1


def rendered(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        texts = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [d for path, t in texts.items() if path.endswith(".yaml") for d in yaml.safe_load_all(t) if d]


ON = {"metrics": {"prometheusRule": {"enabled": True}}, "grafana": {"dashboard": {"enabled": True}}}


def alert_rules() -> list[dict[str, Any]]:
    (rule,) = [d for d in rendered(ON) if d["kind"] == "PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard() -> dict[str, Any]:
    (cm,) = [d for d in rendered(ON) if d["kind"] == "ConfigMap" and "kvrouterd.json" in d["data"]]
    return json.loads(cm["data"]["kvrouterd.json"])


def dashboard_queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["query"]["query"])
            assert m, var["name"]
            yield f"${var['name']}", m[1]


def problems(expr: str, series: dict[str, set[str]]) -> list[str]:
    for var, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(var, value)
    found: list[str] = []
    selected: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            selected.append(node.name)
            if node.name not in series:
                found.append(f"{node.name} is not exported")
                return
            for matcher in node.matchers.matchers:
                if matcher.name not in series[node.name] | TARGET_LABELS:
                    found.append(f"{node.name} has no label {matcher.name}")

    def grouping(node: Any) -> None:
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            inner: list[str] = []
            promql_parser.walk(node.expr, lambda n: inner.append(n.name) if isinstance(n, promql_parser.VectorSelector) else None)
            have = set().union(*(series.get(name, set()) for name in inner)) | TARGET_LABELS
            found.extend(f"by ({label}) over {inner}: no such label" for label in node.modifier.labels if label not in have)

    tree = promql_parser.parse(expr)
    promql_parser.walk(tree, visit)
    promql_parser.walk(tree, grouping)
    assert selected, expr
    return found


async def test_the_checker_catches_a_misspelt_metric_or_label(running) -> None:
    series = {**await scrape_everything(running), **PROMETHEUS_SERIES}
    assert problems('sum by (worker) (rate(kvrouter_worker_event_gaps_total{job="x"}[5m]))', series) == []
    assert problems("rate(kvrouter_worker_event_gap_total[5m])", series) == ["kvrouter_worker_event_gap_total is not exported"]
    assert problems('kvrouter_workers{status="degraded"}', series) == ["kvrouter_workers has no label status"]
    assert problems("sum by (kind) (rate(kvrouter_events_blocks_total[5m]))", series) == \
        ["by (kind) over ['kvrouter_events_blocks_total']: no such label"]


def test_alerts_cover_the_operators_signals_and_are_complete() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    exprs = "\n".join(r["expr"] for r in rules)
    for signal in ('state="degraded"', "kvrouter_worker_event_gaps_total", 'code="RESOURCE_EXHAUSTED"',
                   'outcome="failed"', "kvrouter_worker_events_rejected_total", 'state="ready"',
                   "kvrouter_internal_errors_total"):
        assert signal in exprs, signal
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        # Prometheus's templates survived Helm's (escaped in the chart)
        assert "{{ $labels." in r["annotations"]["summary"] or "{{ $value" in r["annotations"]["summary"], r["alert"]
        # only this release's series: the job the ServiceMonitor gives them, in its namespace
        assert f'job="{RELEASE}-kvrouterd", namespace="{NAMESPACE}"' in r["expr"], r["alert"]


def test_the_dashboard_configmap_carries_the_dashboard_file() -> None:
    docs = rendered({"grafana": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}})
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "kvrouterd.json" in d["data"]]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["kvrouterd.json"]) == json.loads((CHART / "dashboards" / "kvrouterd.json").read_text())
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]


# ---- a real daemon process ----------------------------------------------------------------

def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _drive_a_daemon_process(tmp_path: Path) -> dict[str, set[str]]:
    """`kvrouterd serve` as a process, metrics on loopback, after events (SDK and ZMQ wire),
    a Route, its Complete with the engine's TTFT and cached tokens, a rejected Route, an event
    the engine wire could not apply and a Route under a model no engine stored: its scrape."""
    import grpc
    import msgpack
    import zmq

    from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc

    from .test_serve_cli import free_port, wait_serving
    from .test_zmq_events import TOPIC

    grpc_port, metrics_port = free_port(), free_port()
    ctx = zmq.Context()
    engine = ctx.socket(zmq.PUB)
    engine.setsockopt(zmq.LINGER, 0)
    zmq_port = engine.bind_to_random_port("tcp://127.0.0.1")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
        "workers": [{"id": "z", "address": "127.0.0.1:8000", "mode": "events",
                     "kv_events_endpoint": f"tcp://127.0.0.1:{zmq_port}"}],
    }))
    proc = subprocess.Popen([sys.executable, "-m", "kvrouterd", "serve", "--config", str(config),
                             "--listen", f"127.0.0.1:{grpc_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(f"127.0.0.1:{grpc_port}")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = router_pb2_grpc.KVRouterStub(channel)
            for wid in ("a", "b"):
                stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(
                    id=wid, address=f"{wid}.local:8000", capacity_blocks=10_000, mode=pb.CACHE_STATE_MODE_EVENTS)))
            prompt = list(range(100, 100 + 4 * BS))
            stub.PublishEvents(iter([
                pb.EventBatch(worker_id="a", sequence=0, events=[stored(prompt, [1, 2, 3, 4])]),
                pb.EventBatch(worker_id="b", sequence=3, events=[]),  # a gap on b
            ]))
            routed = stub.Route(pb.RouteRequest(token_ids=prompt))
            stub.Complete(pb.CompleteRequest(request_id=routed.request_id, success=True, ttft_ms=120.0, e2e_ms=900.0,
                                             cached_tokens=3 * BS))
            with pytest.raises(grpc.RpcError):
                stub.Route(pb.RouteRequest(token_ids=prompt, policy="no_such_policy"))
            stub.Route(pb.RouteRequest(token_ids=prompt, model="a-model-no-engine-stored"))
        # a store whose engine hashes do not match its pages, until the subscriber has joined
        bad_store = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
                     "token_ids": list(range(BS)), "block_size": BS, "lora_id": None, "medium": None,
                     "lora_name": None, "group_idx": 0}
        deadline = time.monotonic() + 20
        for seq in itertools.count():
            engine.send_multipart([TOPIC, seq.to_bytes(8, "big"), msgpack.packb([float(seq), [bad_store], 0])])
            series = exported(_get(f"http://127.0.0.1:{metrics_port}/metrics"))
            # the loop's lag is exported from its first heartbeat on (HEARTBEAT_S after the
            # loop starts), which a fast run of the calls above can beat to the scrape
            if ({"kvrouter_worker_events_rejected_total", "kvrouter_event_loop_lag_seconds_bucket"} <= series.keys()
                    or time.monotonic() > deadline):
                return series
            time.sleep(0.2)
        raise AssertionError("unreachable")
    finally:
        proc.terminate()
        proc.wait(10)
        engine.close()
        ctx.term()


def test_every_panel_and_alert_reads_a_series_a_daemon_process_exports(tmp_path: Path) -> None:
    series = {**_drive_a_daemon_process(tmp_path), **PROMETHEUS_SERIES}
    queries = [(r["alert"], r["expr"]) for r in alert_rules()] + list(dashboard_queries(dashboard()))
    assert len(queries) > 20
    bad = {where: p for where, expr in queries if (p := problems(expr, series))}
    assert not bad, bad
    # the KPIs users compare across routers are on the dashboard
    exprs = "\n".join(expr for _, expr in dashboard_queries(dashboard()))
    for kpi in ("kvrouter_request_ttft_seconds_bucket", "kvrouter_completed_cached_tokens_total",
                "kvrouter_completed_prompt_tokens_total", "kvrouter_route_namespace_misses_total",
                "kvrouter_event_loop_lag_seconds_bucket"):
        assert kpi in exprs, kpi


async def test_route_errors_are_exported_at_zero_before_any_rejection(running) -> None:  # type: ignore[no-untyped-def]
    # rate() and increase() never see a counter's first value: a series born at 1 would hide
    # the first burst of shed Routes from the alert
    _, _, text = await scrape(running)
    for code in ROUTE_ERROR_CODES:
        assert sample(text, "kvrouter_route_errors_total", code=code) == 0
