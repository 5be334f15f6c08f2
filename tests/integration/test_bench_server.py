"""``kvrouterd bench``'s servers run the code the benchmark itself runs.

A benchmark server is a child process started with ``python -m``, which puts its working
directory first on ``sys.path``: started from a directory holding another ``kvrouterd`` (a
checkout of another version, say), it would measure that one while the report names this
install. ``ServerProcess`` starts it from this package's own directory.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.benchmarks.grpc_bench import ServerProcess


def test_a_benchmark_server_runs_this_kvrouterd_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "kvrouterd" / "benchmarks"
    other.mkdir(parents=True)
    for package in (tmp_path / "kvrouterd", other):
        (package / "__init__.py").write_text("")
    (other / "grpc_bench.py").write_text("raise SystemExit('the working directory kvrouterd ran')\n")
    monkeypatch.chdir(tmp_path)
    server = ServerProcess("trivial")  # raises RuntimeError if the child exits before listening
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            route = channel.unary_unary("/kvrouter.v1.KVRouter/Route",
                                        request_serializer=pb.RouteRequest.SerializeToString,
                                        response_deserializer=pb.RouteResponse.FromString)
            answer = route(pb.RouteRequest(token_ids=[1, 2, 3]), timeout=10)
        assert isinstance(answer, pb.RouteResponse)
    finally:
        server.close()
