"""``kvrouterd`` command line: one subcommand per module, imported only when used.

    kvrouterd serve      run the gRPC daemon
    kvrouterd bridge     read ZMQ engine events once, republish them on the NATS bus
    kvrouterd bench      measure decision cost, gRPC throughput, ingest rate, memory
    kvrouterd policies   list routing/eviction policies and their parameters
    kvrouterd status     show a running daemon's workers, modes and index size
    kvrouterd config     check a config file, or print the effective config
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from .grpc_runtime import prefer_server_experiments

__all__ = ["SUBCOMMANDS", "add_command", "main"]

#: name -> (module, one-line help, the page that explains the details). Each module has
#: add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("kvrouterd.server.app", "run the gRPC daemon", "docs/deploy.md, docs/operations/configure.md"),
    "bridge": ("kvrouterd.server.bridge", "read ZMQ engine events once, republish them on the NATS bus (events.bus)",
               "docs/deploy.md (ZMQ engines on the bus)"),
    "bench": ("kvrouterd.benchmarks.cli", "benchmarks: decision cost, gRPC throughput, ingest rate, memory",
              "docs/operations/performance.md"),
    "policies": ("kvrouterd.policies.cli", "list routing and eviction policies with their parameters",
                 "README.md (Policies)"),
    "sim": ("kvrouterd.sim.cli", "offline simulation with the daemon's own policies", "docs/simulator.md"),
    "status": ("kvrouterd.admin", "show a running daemon's workers, modes and index size",
               "docs/operations/observe.md (Inspecting a running daemon)"),
    "config": ("kvrouterd.config_cli", "check a config file, or print the effective config",
               "docs/operations/configure.md (Checking a config file)"),
}

#: reST markup in the docstrings that become help text: ``literal``, :role:`target`, `ref`_, trailing ::
_REST_LITERAL = re.compile(r"``(.+?)``")
_REST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_REST_REFERENCE = re.compile(r"`([^`<]+?)(?: <[^>]+>)?`_")
_REST_LITERAL_BLOCK = re.compile(r"(\S)::$", re.MULTILINE)


def plain_text(text: str | None) -> str | None:
    """Help text as a terminal shows it: reST literal quotes, roles and link targets go."""
    if not text:
        return text
    text = _REST_ROLE.sub(r"\1", text)
    text = _REST_REFERENCE.sub(r"\1", text)
    text = _REST_LITERAL.sub(r"\1", text)
    return _REST_LITERAL_BLOCK.sub(r"\1:", text)


def _strip_markup(parser: argparse.ArgumentParser) -> None:
    """Every parser and subparser (the subcommands build their own) prints plain text."""
    parser.description = plain_text(parser.description)
    parser.epilog = plain_text(parser.epilog)
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain_text(choice.help)
            for child in set(action.choices.values()):
                _strip_markup(child)


def _examples(doc: str | None) -> list[str]:
    """The example command lines of a module docstring: its indented lines that start with
    ``kvrouterd``, with their backslash continuations."""
    examples: list[str] = []
    continued = False
    for line in (doc or "").splitlines():
        text = line.strip()
        if line.startswith("    ") and (text.startswith("kvrouterd ") or continued):
            examples.append(("      " if continued else "  ") + text)
            continued = text.endswith("\\")
        else:
            continued = False
    return examples


def add_command(sub: argparse._SubParsersAction, name: str, module: str, help_text: str, docs_page: str,
                dest: str = "_module") -> argparse.ArgumentParser:
    """A subcommand's parser, with its module's arguments. Help stays short: one line saying what
    the command does, the examples from the module docstring and the page with the details (the
    docstring's paragraphs are written for readers of the code). ``dest`` keeps the module to run."""
    mod = importlib.import_module(module)
    examples = _examples(mod.__doc__)
    epilog = ["examples:", *examples, ""] if examples else []
    p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                       epilog="\n".join([*epilog, f"Details: {docs_page}"]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(p)
    p.set_defaults(**{dest: mod})
    return p


def _version() -> str:
    from . import __version__

    return f"kvrouterd {__version__} (Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrouterd",
        description="KV-cache-aware router for LLM serving.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `kvrouterd COMMAND --help` for each command's options.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text, docs_page) in SUBCOMMANDS.items():
        add_command(sub, name, module, help_text, docs_page)
    _strip_markup(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # before build_parser imports the subcommands, grpc among them: gRPC reads it at import
    prefer_server_experiments()
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except BrokenPipeError:
        # `kvrouterd policies | head`: the reader left; say nothing more (and nothing at exit)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
