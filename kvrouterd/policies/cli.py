"""List every registered routing and eviction policy: a one-line summary, then each parameter
with its default, allowed values and meaning.

    kvrouterd policies
    kvrouterd policies --kind eviction
    kvrouterd policies --json          # the same as one JSON object, for tools
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from typing import Any, Literal

from . import registry

__all__ = ["add_arguments", "catalogue", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=["routing", "eviction"], help="only this kind")
    parser.add_argument("--json", action="store_true", help="print {kind: {policy: {summary, parameters}}} as JSON")


def summary(kind: registry.Kind, name: str) -> str:
    """The first sentence of the policy module's docstring, without its ``name``: prefix."""
    cls = registry.policy_class(kind, name)
    doc = sys.modules[cls.__module__].__doc__ or cls.__doc__ or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    paragraph = re.sub(rf"^``{re.escape(name)}``:\s*", "", paragraph)
    first = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0]
    return first.replace("``", "")


def allowed(params_cls: type, field_name: str) -> str:
    """Allowed values of one parameter: its choices, or its type."""
    want = typing.get_type_hints(params_cls).get(field_name)
    if typing.get_origin(want) is Literal:
        return " | ".join(map(str, typing.get_args(want)))
    if want is bool:
        return "true | false"
    origin = typing.get_origin(want)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(want, "__name__", str(want))


def catalogue(kinds: list[registry.Kind]) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in kinds:
        out[kind] = {}
        for name in registry.names(kind):
            params_cls = type(registry.build_params(kind, name, {}))
            out[kind][name] = {
                "summary": summary(kind, name),
                "parameters": [
                    {"name": fname, "default": default, "allowed": allowed(params_cls, fname), "help": help_text}
                    for fname, default, help_text in registry.describe(kind, name)
                ],
            }
    return out


def run(args: argparse.Namespace) -> int:
    kinds: list[registry.Kind] = [args.kind] if args.kind else ["routing", "eviction"]
    data = catalogue(kinds)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    for kind, policies in data.items():
        print(f"{kind} policies:")
        for name, info in policies.items():
            print(f"  {name}: {info['summary']}")
            for p in info["parameters"]:
                print(f"      {p['name']} = {p['default']!r}  ({p['allowed']})  {p['help']}")
    return 0
