"""List every registered routing and eviction policy with its parameters and defaults."""

from __future__ import annotations

import argparse

from . import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["routing", "eviction"], help="only this kind")


def run(args: argparse.Namespace) -> int:
    kinds: list[registry.Kind] = [args.kind] if args.kind else ["routing", "eviction"]
    for kind in kinds:
        print(f"{kind} policies:")
        for name in registry.names(kind):
            print(f"  {name}")
            for fname, default, help_text in registry.describe(kind, name):
                print(f"      {fname} = {default!r}  {help_text}")
    return 0
