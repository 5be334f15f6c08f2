"""docs/modules.md, the module map: every module of the package and the one job its docstring names.

Regenerate after adding, moving or re-describing a module:

    .venv/bin/python -m tests.module_map > docs/modules.md

``tests/unit/test_module_map.py`` fails while the map and the code disagree.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvrouterd"
SKIPPED = ("_generated",)

HEADER = """# Module map

Every module of `kvrouterd/`, folder by folder, with the one job its docstring's first line names
(generated code under `kvrouterd/_generated/` aside). The data flows as the README's diagram shows:
engines' events through `events/` into `index/`, asked by `router/`, which asks `policies/`; `server/`
and `sim/` are the two hosts of the same `Router`. Regenerate with
`.venv/bin/python -m tests.module_map > docs/modules.md` (a test fails while this page and the code
disagree).
"""


def modules() -> list[Path]:
    """Every Python module of the package, generated code aside, in path order."""
    return sorted(p for p in PACKAGE.rglob("*.py") if not any(part in SKIPPED for part in p.parts))


def job(path: Path) -> str:
    """The first line of the module's docstring ("" when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return doc.strip().splitlines()[0].strip() if doc else ""


def render() -> str:
    lines = [HEADER]
    folder = None
    for path in modules():
        rel = path.relative_to(ROOT)
        if rel.parent != folder:
            folder = rel.parent
            lines += ["", f"## `{folder}/`", "", "| module | its one job |", "|---|---|"]
        lines.append(f"| `{rel.name}` | {job(path).replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
