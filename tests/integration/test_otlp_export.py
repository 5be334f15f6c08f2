"""OTLP export from ``kvrouterd serve`` as a process, to a real OTLP receiver on loopback, over
both protocols the chart's ``otel.protocol`` offers; and ``config check`` refuses an exporter
that ``serve`` could not build."""

from __future__ import annotations

import sys

import pytest

from kvrouterd.cli import main
from tests.otlp import check_daemon_exports_decision_spans, clean_env, otel_env, running_receiver

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("protocol", "per_signal"), [
    ("grpc", False), ("http/protobuf", False), ("http/protobuf", True), ("grpc", True),
])
def test_decision_spans_reach_an_otlp_receiver(protocol: str, per_signal: bool) -> None:
    with running_receiver() as receiver:
        env = {**clean_env(), **otel_env(receiver, protocol, per_signal)}
        if per_signal:  # the traces-only variable wins over a general one naming the other protocol
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc" if protocol == "http/protobuf" else "http/protobuf"
        check_daemon_exports_decision_spans([sys.executable, "-m", "kvrouterd"], env, receiver, protocol)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "kvrouterd.yaml"
    path.write_text("telemetry: {traces: otlp}\n")
    return str(path)


def test_config_check_builds_the_otlp_exporter(config_file, monkeypatch, capsys):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert main(["config", "check", config_file]) == 0
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert main(["config", "check", config_file]) == 2
    assert "OTEL_EXPORTER_OTLP_PROTOCOL: unsupported OTLP protocol 'http/json'" in capsys.readouterr().err


def test_config_check_refuses_an_exporter_that_does_not_import(config_file, monkeypatch, capsys):
    # what a stale opentelemetry-proto copy did: the exporter module fails to import
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    assert main(["config", "check", config_file]) == 2
    err = capsys.readouterr().err
    assert "traces exporter otlp (grpc) cannot be built: ModuleNotFoundError" in err
