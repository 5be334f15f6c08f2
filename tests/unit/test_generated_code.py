"""The checked-in protobuf code must be exactly what proto/generate.py produces."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_current():
    result = subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_imports_inside_the_package():
    from kvrouterd._generated.kvrouter.v1 import router_pb2, router_pb2_grpc

    assert router_pb2.DESCRIPTOR.package == "kvrouter.v1"
    assert hasattr(router_pb2_grpc, "KVRouterServicer")
