"""Check a config file, or print the configuration the daemon would run with.

    kvrouterd config check FILE
    kvrouterd config show [--config FILE] [serve's flags, e.g. --listen 0.0.0.0:50051]

`check` validates FILE as `serve` would and names every bad field, one per line: the values
(policy parameters included), then what `serve` reads before it listens: the TLS and token
files, the token variable, the trace and metric exporters, and the libraries the enabled
features need. `show` prints the effective configuration as YAML: the embedded defaults, then
the file, then KVROUTERD_* variables, then the flags given. Exit status 0 when valid, 2 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import yaml

from .config import Config, load_config
from .errors import ConfigError

__all__ = ["add_arguments", "effective_config", "run", "startup_problems"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .server.app import add_arguments as add_serve_arguments

    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate a config file as `serve` would, listing every bad field")
    check.add_argument("file", metavar="FILE", help="the YAML config file")
    show = sub.add_parser("show", help="print the effective config (defaults < file < KVROUTERD_* < flags) as YAML")
    add_serve_arguments(show)


def effective_config(config: Config) -> dict[str, Any]:
    """The config as plain data, in the file's own shape (what `show` prints)."""
    return dataclasses.asdict(config)


#: (whether the feature is on, the module it imports, the field that turns it on, how to install it)
_LIBRARIES: tuple[tuple[Callable[[Config], bool], str, str, str], ...] = (
    (lambda c: c.discovery.kubernetes.enabled, "kubernetes_asyncio", "discovery.kubernetes.enabled",
     "the kubernetes_asyncio package"),
    (lambda c: c.events.bus.enabled, "nats", "events.bus", "pip install 'kvrouterd[nats]'"),
    (lambda c: bool(c.ext_proc.tokenizer), "tokenizers", "ext_proc.tokenizer", "pip install 'kvrouterd[tokenizer]'"),
)


def startup_problems(config: Config) -> list[str]:
    """What `serve` would refuse at start-up that the values alone do not show, one per field.

    Runs the daemon's own start-up readers (so the two cannot disagree) without listening,
    connecting or exporting anything.
    """
    from .server.security import CertificateFiles, TokenSource
    from .telemetry.metrics import build_meter_provider
    from .telemetry.tracing import build_tracer_provider

    out: list[str] = []

    def check(call: Callable[[], object], field: str) -> None:
        try:
            call()
        except ConfigError as exc:
            out.extend(exc.problems)
        except (ImportError, OSError, ValueError) as exc:
            out.append(f"{field}: {type(exc).__name__}: {exc}")

    if config.tls.enabled:
        check(lambda: CertificateFiles(config.tls), "tls")
    if config.auth.enabled:
        check(lambda: TokenSource(config.auth), "auth")

    def tracer() -> None:
        if (provider := build_tracer_provider(config.telemetry.service_name, config.telemetry.traces)) is not None:
            provider.shutdown()

    def meter() -> None:
        build_meter_provider(config.telemetry.service_name).shutdown()

    check(tracer, "telemetry.traces (or OTEL_TRACES_EXPORTER)")
    check(meter, "OTEL_METRICS_EXPORTER")
    for enabled, module, field, install in _LIBRARIES:
        if enabled(config) and importlib.util.find_spec(module) is None:
            out.append(f"{field}: needs the {module} library, which is not installed ({install})")
    return out


def _check(path: str) -> list[str]:
    try:
        config = load_config(path)
    except ConfigError as exc:
        return exc.problems
    return startup_problems(config)


def run(args: argparse.Namespace) -> int:
    from .server.app import _overrides

    if args.config_command == "check":
        if problems := _check(args.file):
            print(f"kvrouterd: {args.file}: {len(problems)} configuration error{'s' * (len(problems) > 1)}:",
                  file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return 2
        print(f"{args.file}: ok")
        return 0
    try:
        config = load_config(args.config, _overrides(args))
    except ConfigError as exc:
        print(f"kvrouterd: configuration error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(effective_config(config), sort_keys=False))
    return 0
