"""``kvrouterd bench --only fleet`` times the paths it names: each one's Routes take that path
(an adapter's tiers, both hops of a P/D pool, the named workers only, a reroute past capacity),
and every Route is completed, so the fleet it measures stays as idle as it says."""

from __future__ import annotations

import pytest

from kvrouterd.benchmarks.fleet_paths import PATHS, fleet_path_cost

REPEATS = 30


@pytest.mark.parametrize("path", PATHS)
def test_each_path_routes_as_it_says_and_leaves_nothing_in_flight(path: str) -> None:
    r = fleet_path_cost(path, 64, REPEATS)
    assert 0 < r["us_median"] <= r["us_p90"]
    assert sum(r["reasons"].values()) == REPEATS and r["left_in_flight"] == 0
    # past capacity every Route, the warm-up's 20 included, is rerouted; elsewhere none is
    assert r["rerouted"] == (REPEATS + 20 if path == "past_capacity" else 0)
    # an adapter's Routes go where it is loaded (an idle fleet never spills)
    assert r["lora_placements"] == ({"loaded": REPEATS} if path == "lora" else {})
    assert r["disaggregated"] == (REPEATS if path == "pd" else 0)
    if path == "named_8":
        assert r["workers_chosen"] <= 8
    if path == "lora":  # loaded on the four workers the fleet reported it on
        assert r["workers_chosen"] <= 4


@pytest.mark.parametrize(("policy", "reason"), [("lbgr", "min_estimate"), ("min_ttft", "min_ttft"),
                                                ("dualmap", "cold_fleet"), ("least_loaded", "min_pending_prefill")])
def test_a_cell_routes_every_route_with_the_policy_it_names(policy: str, reason: str) -> None:
    r = fleet_path_cost("plain", 64, REPEATS, policy)
    assert r["policy"] == policy
    assert r["reasons"] == {reason: REPEATS} and r["left_in_flight"] == 0
    assert fleet_path_cost("plain", 64, REPEATS)["policy"] == "cache_aware"
