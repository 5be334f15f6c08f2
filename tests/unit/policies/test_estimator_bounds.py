"""Every online fit stays finite and within physical bounds, whatever numbers reach it (issue #28 item 1).

Eight ``Complete`` calls with ``ttft_ms=1e308`` once made every min-TTFT and Preble Route fail
(``OverflowError``). The Router now refuses such completions (``bounds.check_completion``), and
each estimator is robust by itself too: these properties drive them with arbitrary floats
(inf, NaN, huge, negative, subnormal) past the Router's checks and read every output.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrouterd.bounds import MAX_LATENCY_MS
from kvrouterd.errors import InvalidRequest
from kvrouterd.policies.eviction.tlru import MAX_TAIL_BLOCKS, TLRUParams, trim_tail
from kvrouterd.policies.latency import LatencyModel, LatencyParams, PowerLaw, RecursiveLeastSquares
from kvrouterd.protocols import Completion

from .routing.helpers import make_router, prompt, request

#: every float, the extremes drawn often
ANY = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                st.sampled_from([1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 0.0, -0.0, 4294967295.0]))
ANY_INT = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, -1]))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: what the used coefficients are held to (policies.latency)
PER_1K = (1e-3, 1e7)


@SETTINGS
@given(samples=st.lists(st.tuples(st.lists(ANY, min_size=2, max_size=2), ANY), max_size=40))
def test_least_squares_theta_and_covariance_stay_finite_and_bounded(samples) -> None:
    bounds = [(-1e6, 1e6), (0.0, 5.0)]
    fit = RecursiveLeastSquares([1.0, 2.0], 0.992, 1e6, bounds=bounds)
    for x, y in samples:
        fit.update(x, y)
        assert all(math.isfinite(t) and lo <= t <= hi for t, (lo, hi) in zip(fit.theta, bounds)), fit.theta
        assert all(math.isfinite(v) for row in fit._p for v in row)


@SETTINGS
@given(model=st.sampled_from(["linear", "power_law"]),
       samples=st.lists(st.tuples(ANY_INT, ANY_INT, ANY), max_size=30),
       budget=ANY, tokens=st.integers(0, 2**40), pending=st.integers(0, 2**40), inflight=st.integers(0, 2**20))
def test_latency_model_estimates_stay_finite_after_any_samples(model, samples, budget, tokens, pending, inflight) -> None:
    m = LatencyModel(LatencyParams(prefill_model=model, calibration_min_samples=1))
    for tokens_ahead, batch, ttft in samples:
        m.observe(tokens_ahead, batch, ttft)
        m.note_dispatch("r", tokens_ahead, batch)
        m.observe_completion("r", ttft)
    coefficients = m.coefficients()
    assert all(math.isfinite(c) for c in coefficients)
    if model == "linear":
        assert PER_1K[0] <= coefficients[0] <= PER_1K[1] and 0 <= coefficients[1] <= MAX_LATENCY_MS
    for estimate in (m.ttft_ms(tokens, pending, inflight), m.queue_ms(pending, inflight), m.prefill_ms(tokens, inflight)):
        assert math.isfinite(estimate) and estimate >= 0
    within = m.tokens_within(budget)
    assert isinstance(within, int) and 0 <= within <= math.exp(40)
    assert 1 <= m.prefill_rate() <= math.exp(40)


def test_a_subnormal_budget_buys_no_tokens_instead_of_a_domain_error() -> None:
    """The fuzzer's sample: 5e-324 ms over a = 3 ms underflowed to 0.0, whose log raised."""
    assert PowerLaw(2.999344215015449, 0.991, 1.018).tokens_within(5e-324) == 0
    assert PowerLaw(3.0, 1.0, 1.0).tokens_within(3.0) == 1  # the inverse where nothing underflows


@pytest.mark.parametrize("model", ["linear", "power_law"])
def test_the_prefill_rate_and_cost_follow_every_calibration_sample(model: str) -> None:
    """``prefill_rate`` and ``cost`` are kept between samples: each one that moves the fit moves them."""
    m = LatencyModel(LatencyParams(prefill_model=model, calibration_min_samples=1))
    rates, costs = [m.prefill_rate()], [m.cost()]
    for ttft_ms in (400.0, 90.0, 900.0):
        m.observe(8000, 1, ttft_ms)
        assert m.prefill_rate() == float(max(m.tokens_within(1000.0), 1))
        assert m.cost() == m._cost(m.coefficients())
        assert m.ttft_ms(4000, 2000, 3) == m._cost(m.coefficients()).ms(6000, 4)
        rates.append(m.prefill_rate())
        costs.append(m.cost())
    assert len(set(rates)) == len(rates) and len(set(costs)) == len(costs)  # the samples moved them each time


def test_one_huge_ttft_moves_the_linear_fit_only_within_its_bounds() -> None:
    """The fuzzer's sample: what made ``int(inf)`` in tokens_within now leaves a usable model."""
    m = LatencyModel(LatencyParams(calibration_min_samples=1))
    for _ in range(8):
        m.observe(2000, 1, 1e308)  # not a measurement: dropped
    assert m.samples == 0 and m.coefficients() == (40.0, 0.0)
    for _ in range(8):
        m.observe(1, 1, MAX_LATENCY_MS)  # the largest TTFT a Complete may report, for one token
    per_1k, intercept = m.coefficients()
    assert PER_1K[0] <= per_1k <= PER_1K[1] and 0 <= intercept <= MAX_LATENCY_MS
    assert m.tokens_within(5000.0) >= 0 and math.isfinite(m.ttft_ms(1000, 10**6, 3))


@pytest.mark.parametrize("policy", ["min_ttft", "preble", "dualmap", "lbgr"])
@SETTINGS
@given(completions=st.lists(st.tuples(ANY, ANY, ANY_INT, st.booleans()), min_size=1, max_size=12))
def test_policy_estimates_stay_finite_whatever_their_completion_hooks_were_fed(policy, completions) -> None:
    """Straight into each policy's ``on_complete`` (past the Router's checks), then a Route."""
    spec = {"name": policy, "calibrate": True, "calibration_min_samples": 1} if policy != "lbgr" else {"name": policy}
    router, clock = make_router(spec, 3)
    instance = router.routing_policy()
    for i, (ttft, e2e, output, success) in enumerate(completions):
        req = request(prompt(i % 3, 64, i), rid=f"q{i}")
        result = router.route(req)
        clock.advance(0.05)
        worker = router.workers.get(result.worker.id)
        instance.on_complete(worker, req, Completion(req.request_id, ttft_ms=ttft, e2e_ms=e2e, output_tokens=output,
                                                     success=success), clock.now())
    for i in range(3):
        decision = router.route(request(prompt(i, 64, 999 + i))).decision
        assert math.isfinite(decision.estimated_ttft_ms) and 0 <= decision.estimated_ttft_ms <= 1e30, decision
        for c in decision.candidates:
            assert math.isfinite(c.score) and all(math.isfinite(v) for v in c.terms.values()), c


@SETTINGS
@given(next_prompt=ANY, threshold=ANY, alpha=ANY)
def test_tlru_tail_is_a_bounded_int_for_any_floats(next_prompt, threshold, alpha) -> None:
    tail = trim_tail(next_prompt, threshold, alpha)
    assert isinstance(tail, int) and 0 <= tail <= MAX_TAIL_BLOCKS
    params = TLRUParams(latency_threshold_ms=threshold, prefill_ms_per_block=alpha, next_prompt_blocks=next_prompt)
    try:
        params.validate()
    except ValueError:
        return
    assert all(map(math.isfinite, (threshold, alpha, next_prompt)))


def test_tlru_tail_of_a_subnormal_alpha_is_the_bound_not_an_overflow() -> None:
    assert trim_tail(0.0, 200.0, 5e-324) == MAX_TAIL_BLOCKS  # xi/alpha = inf: every block is beyond budget
    assert trim_tail(3.0, 200.0, 1.6) == 122  # ceil(200 / 1.6 - 3), as before
    with pytest.raises(ValueError, match="latency_threshold_ms"):
        TLRUParams(latency_threshold_ms=math.inf).validate()


@pytest.mark.parametrize(("fields", "named"), [
    ({"ttft_ms": 1e308}, "ttft_ms"), ({"ttft_ms": math.inf}, "ttft_ms"), ({"e2e_ms": math.nan}, "e2e_ms"),
    ({"ttft_ms": -1.0}, "ttft_ms"), ({"output_tokens": 4294967295}, "output_tokens"),
    ({"cached_tokens": 2**63 - 1}, "cached_tokens"), ({"cached_tokens": -7}, "cached_tokens"),
])
@pytest.mark.parametrize("policy", ["min_ttft", "preble"])
@pytest.mark.parametrize("call", ["complete", "complete_anywhere"])
def test_the_router_refuses_absurd_completions_and_routing_goes_on(policy, call, fields, named) -> None:
    router, clock = make_router({"name": policy}, 2)
    for i in range(8):
        req = request(prompt(i, 64, i), rid=f"p{i}")
        router.route(req)
        with pytest.raises(InvalidRequest, match=named):
            getattr(router, call)(Completion(req.request_id, **{"ttft_ms": 50.0, **fields}))
        assert router.request(req.request_id) is not None  # refused: still in flight, nothing learned
    result = router.route(request(prompt(1, 64, 77)))
    assert math.isfinite(result.decision.estimated_ttft_ms)
