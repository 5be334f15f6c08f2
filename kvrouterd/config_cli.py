"""Check a config file, or print the configuration the daemon would run with.

    kvrouterd config check FILE
    kvrouterd config show [--config FILE] [serve's flags, e.g. --listen 0.0.0.0:50051]

`check` validates FILE as `serve` would (policy parameters included) and names the first
bad field. `show` prints the effective configuration as YAML: the embedded defaults, then the
file, then KVROUTERD_* variables, then the flags given. Exit status 0 when valid, 2 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import yaml

from .config import Config, load_config
from .errors import ConfigError

__all__ = ["add_arguments", "effective_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .server.app import add_arguments as add_serve_arguments

    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a config file as `serve` would")
    check.add_argument("file", metavar="FILE", help="the YAML config file")
    show = sub.add_parser("show", help="print the effective config (defaults < file < KVROUTERD_* < flags) as YAML")
    add_serve_arguments(show)


def effective_config(config: Config) -> dict[str, Any]:
    """The config as plain data, in the file's own shape (what `show` prints)."""
    return dataclasses.asdict(config)


def run(args: argparse.Namespace) -> int:
    from .server.app import _overrides

    try:
        if args.config_command == "check":
            load_config(args.file)
        else:
            config = load_config(args.config, _overrides(args))
    except ConfigError as exc:
        print(f"kvrouterd: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.config_command == "check":
        print(f"{args.file}: ok")
    else:
        sys.stdout.write(yaml.safe_dump(effective_config(config), sort_keys=False))
    return 0
