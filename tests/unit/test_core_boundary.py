"""The pure core must stay pure: no grpc, zmq, opentelemetry, asyncio or wire types.

The simulator and the tests drive index/, policies/ and router/ deterministically; an
import of I/O machinery there would quietly break that.
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "kvrouterd"
CORE = [
    *sorted((PKG / "index").rglob("*.py")),
    *sorted((PKG / "policies").rglob("*.py")),
    *sorted((PKG / "router").rglob("*.py")),
    PKG / "admission.py",
    PKG / "deadline.py",
    PKG / "protocols.py",
    PKG / "errors.py",
    PKG / "clock.py",
]
FORBIDDEN = ("grpc", "zmq", "opentelemetry", "asyncio", "uvloop", "msgpack", "google.protobuf", "kvrouterd._generated",
             "kvrouterd.server", "kvrouterd.telemetry", "kvrouterd.events", "kvrouterd.sim")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = path.relative_to(PKG.parent).with_suffix("").parts[: -node.level]
                names.append(".".join((*base, node.module or "")).rstrip("."))
            else:
                names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PKG)))
def test_core_module_imports_nothing_impure(path):
    bad = [n for n in _imports(path) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_core_module_list_is_not_empty():
    assert len(CORE) > 10
