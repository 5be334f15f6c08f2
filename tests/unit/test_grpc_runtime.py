"""The gRPC experiments a kvrouterd server process runs with, and the operator's say over them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvrouterd import grpc_runtime
from kvrouterd.grpc_runtime import ENV, SERVER_EXPERIMENTS, prefer_server_experiments, server_experiments


def test_a_server_turns_off_the_event_engine_listener_when_the_operator_says_nothing():
    assert server_experiments("") == "-event_engine_listener"
    assert server_experiments(" , ") == "-event_engine_listener"


def test_the_operators_own_experiments_are_kept_and_ours_added():
    assert server_experiments("monitoring_experiment,-fuse_filters") == (
        "monitoring_experiment,-fuse_filters,-event_engine_listener"
    )


@pytest.mark.parametrize("theirs", [
    "event_engine_listener", "-event_engine_listener", "fuse_filters, event_engine_listener",
])
def test_an_experiment_the_operator_names_is_left_as_they_set_it(theirs):
    assert server_experiments(theirs) == ",".join(e.strip() for e in theirs.split(","))


def test_too_late_once_grpc_is_imported_and_nothing_changes():
    import grpc  # noqa: F401 - the point: gRPC has read its environment

    environ = {ENV: "fuse_filters"}
    assert not prefer_server_experiments(environ)
    assert environ == {ENV: "fuse_filters"}
    assert "before kvrouterd could add" in grpc_runtime.status


def _fresh_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


def test_set_before_grpc_is_imported_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = _fresh_python(
        "import os, sys\n"
        "from kvrouterd.grpc_runtime import prefer_server_experiments, status\n"
        "assert prefer_server_experiments()\n"
        "assert 'grpc' not in sys.modules\n"
        "print(os.environ['GRPC_EXPERIMENTS'])\n",
        env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ",".join(SERVER_EXPERIMENTS)


@pytest.mark.parametrize("experiment", SERVER_EXPERIMENTS)
def test_the_installed_grpc_knows_each_experiment_a_server_sets(experiment):
    # gRPC logs "Unknown experiment" and ignores one it has dropped: time to measure again
    env = {**os.environ, ENV: experiment, "GRPC_VERBOSITY": "ERROR"}
    out = _fresh_python("import grpc", env)
    assert out.returncode == 0, out.stderr
    assert "Unknown experiment" not in out.stderr
    # and the check itself sees an unknown one
    env[ENV] = "-no_such_kvrouterd_experiment"
    assert "Unknown experiment" in _fresh_python("import grpc", env).stderr
