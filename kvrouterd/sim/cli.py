"""Offline simulation with the daemon's own Router and policy objects.

    kvrouterd sim cache     replay a trace into one cache and report its hit ratio
    kvrouterd sim cluster   simulate a cluster of engines behind the router
    kvrouterd sim reproduce regenerate docs/results.md's tables (paper figure, ours, verdict)
"""

from __future__ import annotations

import argparse
import importlib

#: name -> (module, help). Each module has add_arguments(parser) and run(args) -> int.
SIM_COMMANDS: dict[str, tuple[str, str]] = {
    "cache": ("kvrouterd.sim.cache", "replay a trace into one cache and report its hit ratio"),
    "cluster": ("kvrouterd.sim.cluster_cli", "simulate engines behind the router: compare routing x eviction pairs"),
    "reproduce": ("kvrouterd.sim.reproduce", "regenerate every table of docs/results.md: paper, ours, verdict"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)
    for name, (module, help_text) in SIM_COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_sim_module=mod)


def run(args: argparse.Namespace) -> int:
    return int(args._sim_module.run(args) or 0)
