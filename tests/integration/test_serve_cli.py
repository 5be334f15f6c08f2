"""`kvrouterd serve` as a user runs it: a real process, health SERVING, clean SIGTERM shutdown."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd._generated.kvrouter.v1 import router_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.time() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise AssertionError(f"{target} never reported SERVING")


def test_serve_with_embedded_defaults_then_sigterm(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | {"KVROUTERD_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrouterd", "serve", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        wait_serving(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.KVRouterStub(ch)
            stub.RegisterWorker(pb.RegisterWorkerRequest(worker=pb.Worker(id="a", address="10.0.0.1:8000")))
            resp = stub.Route(pb.RouteRequest(token_ids=list(range(64))))
            assert resp.worker_id == "a" and resp.worker_address == "10.0.0.1:8000"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert '"msg": "serving"' in err and '"msg": "stopped"' in err
    # set before grpc was imported, so gRPC serves with it (kvrouterd.grpc_runtime)
    serving = next(json.loads(line) for line in err.splitlines() if '"msg": "serving"' in line)
    assert serving["grpc_experiments"] == "-event_engine_listener"


def test_bad_config_exits_2_naming_the_field(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("routing: {name: cache_aware, cache_threshold: 7}\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvrouterd", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "cache_threshold" in out.stdout + out.stderr


def test_help_documents_every_subcommand():
    from kvrouterd.cli import SUBCOMMANDS

    top = subprocess.run([sys.executable, "-m", "kvrouterd", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0
    for name in SUBCOMMANDS:
        assert name in top.stdout
        sub = subprocess.run([sys.executable, "-m", "kvrouterd", name, "--help"], capture_output=True, text=True, timeout=60)
        assert sub.returncode == 0 and "usage:" in sub.stdout, name


def test_json_logs_carry_the_request_id_of_a_rejected_call():
    port = free_port()
    env = {**os.environ, "KVROUTERD_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrouterd", "serve", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        wait_serving(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = router_pb2_grpc.KVRouterStub(ch)
            try:
                stub.Route(pb.RouteRequest(token_ids=list(range(64)), request_id="req-42"))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    import json

    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    (rejected,) = [r for r in records if r["msg"].startswith("Route rejected")]
    assert rejected["request_id"] == "req-42" and rejected["code"] == "UNAVAILABLE" and rejected["level"] == "info"
    assert rejected["rpc"] == "Route"
