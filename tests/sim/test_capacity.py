"""``kvrouterd sim capacity``: the capacity search issue #27 measures policies by."""

from __future__ import annotations

import json

import pytest

from kvrouterd.cli import main
from kvrouterd.sim.capacity import find_capacity


def test_the_search_finds_the_highest_rate_meeting_the_target_in_steps():
    ran = []

    def measure(rate: float) -> tuple[float, float]:  # 90% held up to 13.7 req/s, then falling
        ran.append(rate)
        attainment = 1.0 if rate <= 13.7 else max(0.0, 0.95 - (rate - 13.7) / 10)
        return attainment, rate * attainment

    capacity, points, overload = find_capacity(measure, [4, 8, 12, 16, 20], 0.5, [1.5])
    assert capacity == 14.0  # 14.0 -> 92%; 14.5 -> 87%
    assert points[14.5][0] < 0.9 <= points[14.0][0]
    assert 20 not in ran  # the coarse grid stops at its first failure
    assert set(overload) == {1.5} and overload[1.5] == points[21.0][1]


def test_a_grid_every_rate_of_which_meets_the_target_says_so():
    assert find_capacity(lambda r: (1.0, r), [1, 2, 3], 0.5)[0] is None


def test_a_fleet_that_fails_the_first_rate_has_no_capacity():
    capacity, points, overload = find_capacity(lambda r: (0.5, r / 2), [4, 8], 0.5, [1.5])
    assert capacity == 0.0 and overload == {} and 4 in points  # the search narrows to 0.5 req/s


def test_the_command_runs_the_daemons_policies_and_reports_json(capsys):
    code = main(["sim", "capacity", "--workload", "gsp", "--workload-param", "groups=4", "--workload-param",
                 "queries_per_group=6", "--workers", "2", "--capacity-fraction", "0.3", "--slo-ms", "1000",
                 "--routing", "cache_aware", "--rate", "20,80,140,200,400", "--json", "--quiet"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    (pair,) = doc["pairs"]
    assert pair["pair"] == "cache_aware+lru" and pair["capacity"] > 0
    points = {float(r): tuple(v) for r, v in pair["points"].items()}
    cap = pair["capacity"]
    assert points[cap][0] >= 0.9 and points[cap + 0.5][0] < 0.9  # the step above it fails
    assert doc["meta"]["admission_deadline"] == "shed"  # the config's default, as the daemon runs


@pytest.mark.parametrize("argv", [["--pd", "1:1"], ["--step", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    assert main(["sim", "capacity", "--workload", "gsp", "--rate", "10", *argv]) == 2
    assert "sim capacity" in capsys.readouterr().err
