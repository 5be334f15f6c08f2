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


def test_ext_proc_protos_live_inside_the_package_beside_a_working_otlp_exporter():
    """Envoy's ext_proc messages come from our own generated package, never a top-level ``envoy`` one
    (xds-protos, which shipped them, overwrote opentelemetry-proto's files with a stale copy)."""
    code = (
        "import sys\n"
        "from kvrouterd.server import ext_proc\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope\n"
        "top = {m.split('.')[0] for m in sys.modules}\n"
        "assert not top & {'envoy', 'xds', 'udpa', 'validate'}, top\n"
        "assert ext_proc.ep.DESCRIPTOR.package == 'envoy.service.ext_proc.v3'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
