"""Prefill/decode disaggregation (issue #31 items 3 and 6): one Route answers both hops, the
decode worker prefills locally when that pays, and a decode worker publishing no events is
said, not hidden (``kvrouterd.router.disagg``)."""

from __future__ import annotations

import pytest

from kvrouterd.clock import ManualClock
from kvrouterd.errors import ConfigError, InvalidRequest, NoEligibleWorker, NotFound
from kvrouterd.index.keys import block_keys
from kvrouterd.index.workers import WorkerSpec
from kvrouterd.protocols import CacheMode, Completion, EventBatch, RouteRequest, Stored, WorkerRole
from kvrouterd.router import Router, RouterSettings
from kvrouterd.router.disagg import prefill_hop_id
from kvrouterd.router.settings import DisaggregationSettings

BS = 4


def router(*specs: WorkerSpec, mode: str = "conditional", local: int = 8, busy: int = 0,
           routing: str = "cache_aware") -> Router:
    pd = DisaggregationSettings(mode=mode, local_prefill_max_uncached_tokens=local, prefill_busy_tokens=busy)
    r = Router(RouterSettings(block_size=BS, routing={"name": routing}, disaggregation=pd), ManualClock())
    for s in specs:
        r.add_worker(s)
    return r


def spec(wid: str, role: WorkerRole, mode: CacheMode = CacheMode.APPROXIMATE, models: tuple[str, ...] = ()) -> WorkerSpec:
    return WorkerSpec(id=wid, address=f"{wid}:8000", role=role, mode=mode, models=models)


def prompt(n: int, tokens: int = 16 * BS) -> list[int]:
    return list(range(n * 10_000, n * 10_000 + tokens))


def req(rid: str, tokens: list[int], model: str = "") -> RouteRequest:
    return RouteRequest(rid, block_keys(tokens, BS, model), len(tokens), model=model)


def pd_fleet(**kw: object) -> Router:
    return router(spec("p1", WorkerRole.PREFILL), spec("p2", WorkerRole.PREFILL),
                  spec("d1", WorkerRole.DECODE), spec("d2", WorkerRole.DECODE), **kw)  # type: ignore[arg-type]


def test_a_long_uncached_prompt_takes_both_hops_and_charges_each_worker_its_part() -> None:
    r = pd_fleet()
    result = r.route(req("r1", prompt(1)))
    d = result.decision
    assert d.pd_reason == "remote_prefill"
    assert result.worker.spec.role is WorkerRole.DECODE
    assert d.prefill is not None and result.prefill_worker is not None
    assert result.prefill_worker.id == d.prefill.worker_id and result.prefill_worker.spec.role is WorkerRole.PREFILL
    assert d.prefill.uncached_tokens == d.decode_uncached_tokens == 16 * BS
    # the prefill worker computes the prompt; the decode worker receives it, computing nothing
    assert result.prefill_worker.pending_prefill_tokens == 16 * BS and result.prefill_worker.inflight_requests == 1
    assert result.worker.pending_prefill_tokens == 0 and result.worker.inflight_requests == 1
    r.complete(Completion("r1", ttft_ms=50.0, e2e_ms=900.0, prefill_ms=40.0, kv_transfer_ms=5.0))
    assert all(w.inflight_requests == 0 and w.pending_prefill_tokens == 0 for w in r.workers)
    assert r.workers.inflight_count == 0


def test_the_prefill_hop_follows_the_prefix_cache_of_the_prefill_workers() -> None:
    r = pd_fleet()
    first = r.route(req("r1", prompt(1)))
    assert first.prefill_worker is not None
    r.complete(Completion("r1"))
    # the next turn extends the prompt: its prefix lives on the first turn's prefill worker
    # (approximate mode: the router assumes what it routed cached there)
    again = r.route(req("r2", prompt(1) + prompt(7, 16 * BS)))
    assert again.decision.prefill is not None
    assert again.decision.prefill.worker_id == first.prefill_worker.id
    assert again.decision.prefill.overlap_blocks == 16
    assert again.decision.prefill.uncached_tokens == 16 * BS


def test_a_decode_worker_holding_most_of_the_prompt_prefills_it_locally() -> None:
    r = pd_fleet(local=3 * BS)
    first = r.route(req("r1", prompt(1)))
    r.complete(Completion("r1"))
    # the decode worker holds the first turn (its KV arrived by transfer): two new blocks
    # are under the threshold, so no prefill hop
    again = r.route(req("r2", prompt(1) + prompt(3, 2 * BS)))
    assert again.worker.id == first.worker.id
    assert again.decision.prefill is None and again.prefill_worker is None
    assert again.decision.pd_reason == "decode_cached"
    assert again.decision.decode_uncached_tokens == 2 * BS
    assert again.worker.pending_prefill_tokens == 2 * BS  # it prefills them itself
    assert all(w.inflight_requests == 0 for w in r.workers if w.spec.role is WorkerRole.PREFILL)


def test_a_prefill_worker_joining_or_leaving_switches_the_next_decision_in_or_out_of_pd() -> None:
    # the selector reads whether any worker prefills once per membership, with the eligible ones
    r = router(spec("d1", WorkerRole.DECODE))
    assert r.decide(req("r1", prompt(1)))[0].pd_reason == ""
    r.add_worker(spec("p1", WorkerRole.PREFILL))
    assert r.decide(req("r2", prompt(2)))[0].pd_reason == "remote_prefill"
    r.remove_worker("p1")
    assert r.decide(req("r3", prompt(3)))[0].pd_reason == ""


def test_a_short_prompt_prefills_on_the_decode_worker() -> None:
    r = pd_fleet(local=8)
    d = r.route(req("r1", prompt(1, 2 * BS))).decision
    assert (d.prefill, d.pd_reason) == (None, "decode_cached")


def test_a_saturated_prefill_worker_sends_the_request_to_prefill_locally() -> None:
    r = router(spec("p1", WorkerRole.PREFILL), spec("d1", WorkerRole.DECODE), busy=20 * BS)
    assert r.route(req("r1", prompt(1))).decision.pd_reason == "remote_prefill"  # 16 blocks pending on p1
    assert r.route(req("r2", prompt(2))).decision.pd_reason == "remote_prefill"  # 32 blocks: now saturated
    third = r.route(req("r3", prompt(3)))
    assert (third.decision.prefill, third.decision.pd_reason) == (None, "prefill_saturated")
    # the prefill hop finished: the prefill worker is free again before the request completes
    assert r.release_prefill(Completion("r1", prefill_done=True, prefill_ms=30.0)) is not None
    assert r.release_prefill(Completion("r1", prefill_done=True)) is None  # released already
    assert r.workers.get("p1").pending_prefill_tokens == 16 * BS
    assert r.route(req("r4", prompt(4))).decision.pd_reason == "remote_prefill"
    r.complete(Completion("r1"))
    assert r.workers.get("d1").inflight_requests == 3 and r.workers.get("p1").inflight_requests == 2
    with pytest.raises(NotFound):
        r.release_prefill(Completion("r1", prefill_done=True))


def test_modes_always_and_never() -> None:
    always = pd_fleet(mode="always", local=1 << 20)
    assert always.route(req("r1", prompt(1, 2 * BS))).decision.pd_reason == "remote_prefill"
    never = pd_fleet(mode="never")
    result = never.route(req("r1", prompt(1)))
    assert (result.decision.prefill, result.decision.pd_reason) == (None, "never")
    assert result.worker.spec.role is WorkerRole.DECODE


def test_a_decode_worker_that_never_published_events_is_named_in_the_reason_and_counted() -> None:
    r = router(spec("p1", WorkerRole.PREFILL, CacheMode.EVENTS), spec("d1", WorkerRole.DECODE, CacheMode.EVENTS))
    assert r.decode_workers_without_events() == 1
    d = r.route(req("r1", prompt(1))).decision
    assert d.pd_reason == "remote_prefill+decode_cache_unknown"
    r.complete(Completion("r1"))
    # once it publishes, its cache is read: it holds the prompt, so the next turn stays local
    tokens = prompt(1)
    r.apply(EventBatch("d1", 0, (Stored(tuple(tokens), None),)))
    assert r.decode_workers_without_events() == 0
    assert r.workers.get("d1").last_event_at == r.clock.now()
    again = r.route(req("r2", tokens + prompt(2, BS))).decision
    assert (again.pd_reason, again.decode_uncached_tokens) == ("decode_cached", BS)


def test_only_the_model_pool_with_prefill_workers_is_disaggregated() -> None:
    r = router(spec("p1", WorkerRole.PREFILL, models=("A",)), spec("d1", WorkerRole.DECODE, models=("A",)),
               spec("b1", WorkerRole.BOTH, models=("B",)))
    assert r.route(req("a", prompt(1), "A")).decision.pd_reason == "remote_prefill"
    other = r.route(req("b", prompt(2), "B"))
    assert (other.worker.id, other.decision.pd_reason, other.decision.prefill) == ("b1", "", None)


def test_a_pool_of_prefill_workers_alone_cannot_decode() -> None:
    r = router(spec("p1", WorkerRole.PREFILL, models=("A",)), spec("d1", WorkerRole.DECODE, models=("B",)))
    with pytest.raises(NoEligibleWorker, match="only prefill"):
        r.route(req("a", prompt(1), "A"))


def test_the_hops_follow_every_membership_change_though_kept_per_candidate_list() -> None:
    # a pool's split into prefill and decode workers is kept per membership: a drain, a role
    # change and a return each reach the next decision
    r = pd_fleet()

    def hops(n: int) -> tuple[str, str | None]:
        d = r.decide(req(f"r{n}", prompt(n)))[0]
        return d.worker_id, d.prefill.worker_id if d.prefill else None

    assert hops(1) == ("d1", "p1") and hops(2) == ("d1", "p1")
    r.set_draining("p1", True)
    assert hops(3) == ("d1", "p2")
    r.add_worker(spec("d1", WorkerRole.PREFILL))  # re-registered in place as a prefill worker
    decode, prefill = hops(4)
    assert decode == "d2" and prefill in {"p2", "d1"}
    r.set_draining("d2", True)
    for n in (5, 6):  # asked twice: the second answer comes from the kept split
        with pytest.raises(NoEligibleWorker, match="only prefill"):
            r.decide(req(f"r{n}", prompt(n)))
    r.set_draining("d2", False)
    r.set_draining("p1", False)
    assert hops(7) == ("d2", "p1")


def test_a_request_id_cannot_collide_with_a_prefill_hop() -> None:
    r = pd_fleet()
    r.route(req("r1", prompt(1)))
    with pytest.raises(InvalidRequest, match="NUL"):
        r.route(req(prefill_hop_id("r1"), prompt(2)))


def test_an_expired_request_releases_both_hops() -> None:
    r = pd_fleet()
    r.route(req("r1", prompt(1)))
    r.clock.advance(r.settings.inflight_timeout_s + 1)  # type: ignore[attr-defined]
    assert len(r.expire_inflight()) == 2
    assert all(w.inflight_requests == 0 and w.pending_prefill_tokens == 0 for w in r.workers)


def test_bad_disaggregation_settings_fail_at_start() -> None:
    with pytest.raises(ConfigError, match="disaggregation.mode"):
        RouterSettings(disaggregation=DisaggregationSettings(mode="sometimes")).validate()
    with pytest.raises(ConfigError, match="local_prefill_max_uncached_tokens"):
        RouterSettings(disaggregation=DisaggregationSettings(local_prefill_max_uncached_tokens=-1)).validate()


def test_candidate_workers_naming_only_a_decode_worker_keep_the_pools_prefill_workers() -> None:
    # what an admission queue does: the request waited for d2, and is routed to it alone
    r = pd_fleet()
    pinned = req("r1", prompt(1))
    pinned.candidate_workers = ("d2",)
    result = r.route(pinned)
    assert result.worker.id == "d2" and result.decision.pd_reason == "remote_prefill"
    both = req("r2", prompt(2))
    both.candidate_workers = ("d1", "p2")
    result = r.route(both)
    assert (result.worker.id, result.prefill_worker.id if result.prefill_worker else None) == ("d1", "p2")


def test_a_busy_decode_worker_takes_the_prefill_hop_even_for_a_cached_prompt() -> None:
    pd = DisaggregationSettings(local_prefill_max_uncached_tokens=16 * BS, decode_busy_tokens=20 * BS)
    r = Router(RouterSettings(block_size=BS, disaggregation=pd), ManualClock())
    for s in (spec("p1", WorkerRole.PREFILL), spec("d1", WorkerRole.DECODE)):
        r.add_worker(s)
    assert r.route(req("r1", prompt(1))).decision.pd_reason == "decode_cached"  # 16 blocks local: d1 has 64 tokens
    second = r.route(req("r2", prompt(2))).decision
    assert (second.pd_reason, second.prefill is not None) == ("decode_busy", True)  # 128 > 80: not on d1
    r.complete(Completion("r1"))
    assert r.route(req("r3", prompt(3))).decision.pd_reason == "decode_cached"


# ---- speculative claims on both hops (speculative.ttl_s > 0) -------------------------------

def speculative_fleet(local: int = 8) -> Router:
    pd = DisaggregationSettings(local_prefill_max_uncached_tokens=local)
    r = Router(RouterSettings(block_size=BS, disaggregation=pd, speculative_ttl_s=5.0), ManualClock())
    for wid, role in (("p1", WorkerRole.PREFILL), ("p2", WorkerRole.PREFILL),
                      ("d1", WorkerRole.DECODE), ("d2", WorkerRole.DECODE)):
        r.add_worker(spec(wid, role, CacheMode.EVENTS))
    return r


def test_a_disaggregated_route_claims_its_prompt_on_both_hops_and_a_follow_up_finds_it_before_stored() -> None:
    r = speculative_fleet()
    first = r.route(req("r1", prompt(1)))
    assert first.decision.pd_reason.startswith("remote_prefill") and first.prefill_worker is not None
    p, d = first.prefill_worker.id, first.worker.id
    # the prefill worker computes the prompt, the decode worker receives and caches it
    assert {w.id: r.speculative.live_on(w.id) for w in r.workers} == {p: 16, d: 16} | {
        w.id: 0 for w in r.workers if w.id not in (p, d)}
    follow = r.route(req("r2", prompt(1) + prompt(5, 4 * BS)))
    hop = follow.decision.prefill
    assert hop is not None and (hop.worker_id, follow.worker.id) == (p, d)
    assert hop.overlap_blocks == 16
    # claimed blocks place the follow-up but price as uncached: its engine may compute them again
    assert hop.uncached_tokens == 20 * BS and follow.decision.decode_uncached_tokens == 20 * BS
    assert r.workers.get(p).pending_prefill_tokens == 16 * BS + 20 * BS
    # each engine's Stored confirms its own claims
    r.apply(EventBatch(p, 0, (Stored(tuple(prompt(1) + prompt(5, 4 * BS)), None),)))
    r.apply(EventBatch(d, 0, (Stored(tuple(prompt(1)), None),)))
    assert r.speculative.live_on(p) == 0 and r.speculative.live_on(d) == 4
    assert r.speculative.outcomes["confirmed"] == 20 + 16


def test_a_decode_worker_whose_kv_is_still_in_transfer_does_not_prefill_locally() -> None:
    """Its claimed blocks are not computed yet: a follow-up that would be cached enough to
    stay local once they are takes the prefill hop until its Stored arrives."""
    r = speculative_fleet(local=8 * BS)
    first = r.route(req("r1", prompt(1)))
    d = first.worker.id
    r.complete(Completion("r1"))
    follow = prompt(1) + prompt(5, 4 * BS)
    again = r.route(req("r2", follow)).decision
    assert (again.worker_id, again.pd_reason, again.decode_uncached_tokens) == (
        d, "remote_prefill+decode_cache_unknown", 20 * BS)
    r.complete(Completion("r2"))
    r.apply(EventBatch(d, 0, (Stored(tuple(follow), None),)))
    cached = r.route(req("r3", follow + prompt(6, 2 * BS))).decision
    assert (cached.worker_id, cached.pd_reason, cached.prefill) == (d, "decode_cached", None)


def test_a_failed_disaggregated_request_drops_the_claims_of_both_hops() -> None:
    r = speculative_fleet()
    first = r.route(req("r1", prompt(1)))
    assert first.prefill_worker is not None
    r.complete(Completion("r1", success=False))
    assert r.speculative.live == 0 and r.speculative.outcomes["dropped"] == 32
    assert r.indexed_blocks == 0


def test_a_prefill_released_early_keeps_its_claim_when_the_request_fails_later() -> None:
    """``prefill_done``: the prefill engine computed the prompt, and its Stored is on the way."""
    r = speculative_fleet()
    first = r.route(req("r1", prompt(1)))
    assert first.prefill_worker is not None
    p, d = first.prefill_worker.id, first.worker.id
    assert r.release_prefill(Completion("r1", prefill_done=True, prefill_ms=30.0)) is not None
    r.complete(Completion("r1", success=False))
    assert (r.speculative.live_on(p), r.speculative.live_on(d)) == (16, 0)
    r.clock.advance(5.0)
    r.tick()
    assert r.speculative.live == 0 and r.speculative.outcomes["expired"] == 16
