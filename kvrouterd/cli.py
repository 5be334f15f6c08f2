"""``kvrouterd`` command line: one subcommand per module, imported only when used.

    kvrouterd serve      run the gRPC daemon
    kvrouterd bench      measure decision cost, gRPC throughput, ingest rate, memory
    kvrouterd policies   list routing/eviction policies and their parameters
    kvrouterd status     show a running daemon's workers, modes and index size
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "main"]

#: name -> (module, one-line help). Each module has add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvrouterd.server.app", "run the gRPC daemon"),
    "bench": ("kvrouterd.benchmarks.cli", "benchmarks: decision cost, gRPC throughput, ingest rate, memory"),
    "policies": ("kvrouterd.policies.cli", "list routing and eviction policies with their parameters"),
    "sim": ("kvrouterd.sim.cli", "offline simulation with the daemon's own policies"),
    "status": ("kvrouterd.admin", "show a running daemon's workers, modes and index size"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrouterd",
        description="KV-cache-aware router for LLM serving.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `kvrouterd COMMAND --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
