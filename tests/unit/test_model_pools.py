"""Model pools and LoRA adapters (issue #31 items 1-2): which workers a request may go to, and
which of them its adapter prefers (``kvrouterd.router.pools``)."""

from __future__ import annotations

import grpc
import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.config import parse_config
from kvrouterd.errors import ConfigError, InvalidRequest, NoEligibleWorker, UnknownModel
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import Completion, EventBatch, RouteRequest, Stored, WorkerRole
from kvrouterd.router import Router, RouterSettings
from kvrouterd.router.pools import MAX_TRACKED_LORAS
from kvrouterd.server.status import http_status, status_code
from kvrouterd.telemetry.tracing import annotate_decision

BS = 4


def router(*specs: WorkerSpec, routing: str = "cache_aware", load_cost: float = 2.0) -> Router:
    r = Router(RouterSettings(block_size=BS, routing={"name": routing}, lora_load_cost=load_cost), ManualClock())
    for spec in specs:
        r.add_worker(spec)
    return r


def spec(wid: str, *models: str, loras: tuple[str, ...] = (), max_loras: int = 0) -> WorkerSpec:
    return WorkerSpec(id=wid, address=f"{wid}:1", models=models, loras=loras, max_loras=max_loras)


def req(n: int, model: str = "", lora: str = "", tokens: int = 4 * BS) -> RouteRequest:
    keys = block_keys(list(range(n * 1000, n * 1000 + tokens)), BS, model, lora)
    return RouteRequest(f"r{n}", keys, tokens, model=model, lora=lora)


# ---- the pool filter ---------------------------------------------------------------------

def test_a_route_for_a_model_only_considers_workers_serving_it() -> None:
    r = router(spec("a1", "A"), spec("a2", "A"), spec("b1", "B"))
    chosen = {r.route(req(n, "B")).worker.id for n in range(20)}
    assert chosen == {"b1"}
    decision, ctx, _ = r.decide(req(99, "A"))
    assert {w.id for w in ctx.candidates} == {"a1", "a2"}
    assert decision.pool == "A"


def test_a_model_nobody_serves_is_not_found_naming_it() -> None:
    r = router(spec("a1", "A"), spec("b1", "B"))
    with pytest.raises(UnknownModel) as err:
        r.route(req(1, "C"))
    assert "'C'" in str(err.value) and "'A', 'B'" in str(err.value)
    assert status_code(err.value) is grpc.StatusCode.NOT_FOUND
    assert http_status(err.value) == 404
    assert r.workers.inflight_count == 0


def test_a_pool_whose_workers_all_drain_is_unavailable_not_unknown() -> None:
    r = router(spec("a1", "A"), spec("b1", "B"))
    r.set_draining("a1", True)
    with pytest.raises(NoEligibleWorker) as err:
        r.route(req(1, "A"))
    assert not isinstance(err.value, UnknownModel)
    assert status_code(err.value) is grpc.StatusCode.UNAVAILABLE
    assert "'A'" in str(err.value)


def test_workers_declaring_no_models_serve_every_model_as_before() -> None:
    plain = router(spec("w1"), spec("w2"))
    assert {plain.route(req(n, "anything")).worker.id for n in range(8)} <= {"w1", "w2"}
    assert plain.route(req(9, "anything")).decision.pool == ""
    mixed = router(spec("any"), spec("a1", "A"))
    _, ctx, _ = mixed.decide(req(1, "A"))
    assert {w.id for w in ctx.candidates} == {"any", "a1"}
    _, ctx, _ = mixed.decide(req(2, "B"))  # only the undeclared worker serves B
    assert [w.id for w in ctx.candidates] == ["any"]


def test_a_request_without_a_model_may_go_to_any_worker() -> None:
    r = router(spec("a1", "A"), spec("b1", "B"))
    _, ctx, _ = r.decide(req(1))
    assert {w.id for w in ctx.candidates} == {"a1", "b1"}


def test_a_request_without_a_prompt_goes_where_its_model_may() -> None:
    """ext_proc's GETs and unread bodies: the same filters as a Route, and its NOT_FOUND, with no
    prompt to check and nothing committed; a P/D pool's destinations are its decode workers."""
    r = router(spec("a1", "A"), spec("b1", "B", loras=("sql",)), spec("b2", "B"),
               WorkerSpec(id="p1", address="p1:1", models=("B",), role=WorkerRole.PREFILL))
    assert r.destinations(RouteRequest("", (), 0, model="A")) == ([r.workers.get("a1")], "A")
    workers, pool = r.destinations(RouteRequest("", (), 0, model="B"))
    assert [w.id for w in workers] == ["b1", "b2"] and pool == "B"
    assert [w.id for w in r.destinations(RouteRequest("", (), 0, model="sql"))[0]] == ["b1"]
    assert {w.id for w in r.destinations(RouteRequest("", (), 0))[0]} == {"a1", "b1", "b2"}
    assert [w.id for w in r.destinations(RouteRequest("", (), 0, model="B", candidate_workers=("b2",)))[0]] == ["b2"]
    with pytest.raises(UnknownModel, match="'C'"):
        r.destinations(RouteRequest("", (), 0, model="C"))
    with pytest.raises(InvalidRequest, match="max_id_length"):
        r.destinations(RouteRequest("", (), 0, model="m" * 1000))
    assert r.workers.inflight_count == 0


def test_re_registering_a_worker_with_other_models_moves_it_between_pools() -> None:
    r = router(spec("w", "A"), spec("b", "B"))
    assert r.route(req(1, "A")).worker.id == "w"
    r.add_worker(spec("w", "B"))
    with pytest.raises(UnknownModel):
        r.route(req(2, "A"))
    _, ctx, _ = r.decide(req(3, "B"))
    assert {w.id for w in ctx.candidates} == {"w", "b"}


def test_candidate_workers_outside_the_pool_are_refused_naming_the_model() -> None:
    r = router(spec("a1", "A"), spec("b1", "B"))
    request = req(1, "B")
    request.candidate_workers = ("a1",)
    with pytest.raises(NoEligibleWorker, match="serves model 'B'"):
        r.route(request)


def test_a_model_naming_a_declared_adapter_asks_for_that_adapter() -> None:
    """OpenAI-style bodies put the adapter's name in ``model``."""
    r = router(spec("a1", "A", loras=("sql-lora",)), spec("a2", "A", loras=("chat-lora",)), spec("b1", "B"))
    result = r.route(req(1, "sql-lora"))
    assert result.worker.id == "a1"
    assert result.decision.lora_placement == "free_slot"
    assert list(r.workers.get("a1").loras) == ["sql-lora"]


def test_declared_adapters_bound_what_a_worker_serves() -> None:
    r = router(spec("a1", "A", loras=("x",)), spec("a2", "A"))
    _, ctx, _ = r.decide(req(1, "A", "y"))  # a2 loads any adapter of A; a1 only x
    assert [w.id for w in ctx.candidates] == ["a2"]
    with pytest.raises(UnknownModel, match="LoRA adapter 'y'"):
        router(spec("a1", "A", loras=("x",))).route(req(2, "A", "y"))


# ---- LoRA-aware choice ---------------------------------------------------------------

def test_a_worker_with_the_adapter_loaded_is_preferred_over_an_idle_one() -> None:
    r = router(spec("w1", "A"), spec("w2", "A"))
    r.report_load("w2", 0, 0, 0.0, ["sql"])
    r.route(req(1, "A"))  # w1 idle, w2 holding sql: both empty caches
    result = r.route(req(2, "A", "sql"))
    assert result.worker.id == "w2" and result.decision.lora_placement == "loaded"


def test_a_full_worker_is_avoided_for_one_with_a_free_adapter_slot() -> None:
    r = router(spec("full", "A", max_loras=2), spec("free", "A", max_loras=2))
    r.report_load("full", 0, 0, 0.0, ["x", "y"])
    r.report_load("free", 0, 0, 0.0, ["x"])
    result = r.route(req(1, "A", "z"))
    assert result.worker.id == "free" and result.decision.lora_placement == "free_slot"
    assert list(r.workers.get("free").loras) == ["x", "z"]


def test_max_loras_bounds_the_residency_as_an_lru_of_that_size() -> None:
    r = router(spec("w", "A", max_loras=2))
    for n, adapter in enumerate(["x", "y", "x", "z"]):
        r.route(req(n, "A", adapter))
    assert list(r.workers.get("w").loras) == ["x", "z"]  # y, least recently used, was evicted
    assert r.route(req(9, "A", "y")).decision.lora_placement == "swap"
    unlimited = router(spec("u", "A"))
    for n in range(MAX_TRACKED_LORAS + 5):
        unlimited.route(req(n, "A", f"l{n}"))
    assert len(unlimited.workers.get("u").loras) == MAX_TRACKED_LORAS


def test_an_adapters_traffic_stays_together_and_spills_only_when_its_workers_are_busy() -> None:
    """Without completions load only grows. The adapter stays on the workers holding it, and
    gains one more only when every holder has more than ``load_cost`` requests above it."""
    r = router(*(spec(f"w{i}", "A") for i in range(4)), routing="least_loaded", load_cost=2.0)
    r.report_load("w3", 0, 0, 0.0, ["sql"])
    chosen = [r.route(req(n, "A", "sql")).worker.id for n in range(3)]
    assert chosen == ["w3", "w3", "w3"]  # 0, 1, 2 in flight: not yet more than a load costs
    for n in range(3, 16):
        holders = [w for w in r.workers if "sql" in w.loras]
        before = {w.id: w.inflight_requests for w in r.workers}
        result = r.route(req(n, "A", "sql"))
        if result.worker not in holders:  # a spill: every holder was busier than loading it here costs
            assert result.decision.lora_placement == "free_slot"
            assert min(before[w.id] for w in holders) > before[result.worker.id] + 2
    assert sum("sql" in w.loras for w in r.workers) >= 2
    loads = [w.inflight_requests for w in r.workers]
    assert max(loads) - min(loads) <= 3  # spread by load, never piled onto the first holder


def test_completions_let_the_loaded_worker_keep_its_adapter() -> None:
    r = router(spec("w1", "A"), spec("w2", "A"), routing="least_loaded")
    r.report_load("w1", 0, 0, 0.0, ["sql"])
    for n in range(10):
        result = r.route(req(n, "A", "sql"))
        assert result.worker.id == "w1"
        r.complete(Completion(result.request.request_id))


def test_stored_events_naming_an_adapter_mark_it_loaded() -> None:
    r = router(spec("w", "A"))
    tokens = list(range(2 * BS))
    r.apply(EventBatch("w", 0, (Stored(tuple(tokens), None, model="A", lora="sql"), Stored(tuple(tokens), None))))
    assert list(r.workers.get("w").loras) == ["sql"]


def test_report_load_replaces_the_residency_and_checks_it_whole_first() -> None:
    r = router(spec("w", "A", max_loras=4))
    for n, adapter in enumerate(["x", "y"]):
        r.route(req(n, "A", adapter))
    r.report_load("w", 1, 2, 0.5, ["z", "y"])
    assert list(r.workers.get("w").loras) == ["y", "z"]  # y kept its place, z is new
    with pytest.raises(InvalidRequest):
        r.report_load("w", 3, 3, 0.1, ["ok", ""])
    assert list(r.workers.get("w").loras) == ["y", "z"] and r.workers.get("w").reported_queue == 1
    r.report_load("w", 0, 0, 0.0)  # not reported: kept
    assert list(r.workers.get("w").loras) == ["y", "z"]
    r.report_load("w", 0, 0, 0.0, [])
    assert not r.workers.get("w").loras


# ---- declaring a pool ------------------------------------------------------------------

def test_config_workers_declare_models_adapters_limit_and_role() -> None:
    cfg = parse_config({"workers": [{"id": "p", "address": "h:1", "models": ["m"], "loras": ["x"], "max_loras": 2,
                                     "role": "prefill"}], "lora": {"load_cost_requests": 5}})
    s = cfg.workers[0].to_spec(16)
    assert (s.models, s.loras, s.max_loras, s.role) == (("m",), ("x",), 2, WorkerRole.PREFILL)
    assert cfg.router_settings().lora_load_cost == 5
    assert parse_config({"workers": [{"id": "d", "address": "h:1"}]}).workers[0].to_spec(16).role is WorkerRole.BOTH


@pytest.mark.parametrize(("worker", "field"), [
    ({"models": [""]}, "workers[0].models"),
    ({"loras": ["x" * 300]}, "workers[0].loras"),
    ({"max_loras": -1}, "workers[0].max_loras"),
    ({"role": "encode"}, "workers[0].role"),
])
def test_bad_pool_declarations_fail_at_start_naming_the_field(worker: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"workers": [{"id": "w", "address": "h:1", **worker}]})


def test_register_checks_pool_names_against_the_id_limit() -> None:
    r = router()
    with pytest.raises(InvalidRequest, match="models"):
        r.add_worker(spec("w", "m" * 300))
    with pytest.raises(InvalidRequest, match="max_loras"):
        r.add_worker(spec("w", max_loras=100_000))
    assert len(r.workers) == 0


def test_the_decision_span_carries_the_pool_and_the_adapters_placement() -> None:
    class Span:
        attributes: dict = {}

        def set_attributes(self, attrs: dict) -> None:
            self.attributes = attrs

    r = router(spec("a1", "A"))
    span = Span()
    annotate_decision(span, r.route(req(1, "A", "sql")), BS)  # type: ignore[arg-type]
    assert span.attributes["kvrouter.pool"] == "A"
    assert (span.attributes["kvrouter.lora"], span.attributes["kvrouter.lora.placement"]) == ("sql", "free_slot")
    annotate_decision(span, r.route(req(2)), BS)  # type: ignore[arg-type]
    assert "kvrouter.pool" not in span.attributes and "kvrouter.lora" not in span.attributes


def test_an_adapter_is_keyed_under_its_one_base_model_and_no_other():
    r = router(spec("a", "base", loras=("sql", "chat")), spec("b", "base", loras=("sql",)),
               spec("c", "other", loras=("chat",)), spec("d", "sql2", loras=("sql2",)))
    # sql: every worker declaring it serves base; chat: two bases, unknown; sql2 is a base model too
    assert dict(r.adapter_bases()) == {"sql": "base"}
    tokens = list(range(4 * BS))
    assert list(r.keys_for_tokens(tokens, model="sql")) == block_keys(tokens, BS, model="base", lora="sql")
    assert list(r.keys_for_tokens(tokens, model="chat")) == block_keys(tokens, BS, model="chat")
    assert list(r.keys_for_tokens(tokens, model="base", lora="sql")) == block_keys(tokens, BS, model="base", lora="sql")
    assert list(r.keys_for_tokens(tokens, model="sql2")) == block_keys(tokens, BS, model="sql2")
    r.remove_worker("a")  # a membership change builds the map afresh: chat now has one base
    assert dict(r.adapter_bases()) == {"sql": "base", "chat": "other"}
