"""``kvrouterd sim``: offline simulation with the daemon's own Router and policy objects, one
subcommand per module (``SIM_COMMANDS``)."""

from __future__ import annotations

import argparse

from ..cli import add_command

#: name -> (module, help, the page that explains the details). Each module has
#: add_arguments(parser) and run(args) -> int.
SIM_COMMANDS: dict[str, tuple[str, str, str]] = {
    "cache": ("kvrouterd.sim.cache", "replay a trace into one cache and report its hit ratio",
              "docs/simulator.md (One cache: kvrouterd sim cache)"),
    "cluster": ("kvrouterd.sim.cluster_cli", "simulate engines behind the router: compare routing x eviction pairs",
                "docs/simulator.md"),
    "capacity": ("kvrouterd.sim.capacity", "find each policy's capacity (90 percent within SLO) and goodput past it",
                 "docs/simulator.md (Capacity: kvrouterd sim capacity)"),
    "reproduce": ("kvrouterd.sim.reproduce", "regenerate every table of docs/results.md: paper, ours, verdict",
                  "docs/simulator.md (Reproducing docs/results.md)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)
    for name, (module, help_text, docs_page) in SIM_COMMANDS.items():
        add_command(sub, name, module, help_text, docs_page, dest="_sim_module")


def run(args: argparse.Namespace) -> int:
    return int(args._sim_module.run(args) or 0)
