"""One registry of policies, used by config validation, the daemon and the simulator alike.

    register("routing", "round_robin", NoParams)(RoundRobinPolicy)

    build("routing", {"name": "cache_aware", "cache_threshold": 0.5}, rng)

Params are frozen dataclasses whose fields carry defaults and ``metadata={"help": ...}``;
a ``validate()`` method checks ranges. A bad name, field or value raises ConfigError naming
the policy and the field.

Imports run one way: the registry imports no policy. Each policy package lists its policies
(``routing.POLICIES``, ``eviction.POLICIES``: name, class, Params) and
``kvrouterd/policies/__init__.py`` registers those lists, so the table is full once anything
under ``kvrouterd.policies`` is imported. Policy modules never import the registry to
register themselves; ``compose`` imports it only as a client, to build its two inner
policies by name.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

from ..errors import ConfigError, quote
from .base import NoParams

__all__ = [
    "Kind", "NoParams", "build", "build_params", "describe", "names", "not_built", "policy_class", "register", "reserve",
]

Kind = Literal["routing", "eviction"]
_KINDS: tuple[Kind, ...] = ("routing", "eviction")
_REGISTRY: dict[tuple[str, str], tuple[type, type]] = {}
#: (kind, name) -> why no daemon can build it: a policy only the simulator runs (``reserve``)
_RESERVED: dict[tuple[str, str], str] = {}

T = TypeVar("T")


def register(kind: Kind, name: str, params: type = NoParams) -> Callable[[type[T]], type[T]]:
    """Enter a class in the table as ``name`` with its Params and set its ``name``:
    ``register(kind, name, Params)(cls)``, or as a decorator on a class outside this package."""
    if kind not in _KINDS:
        raise ValueError(f"unknown policy kind {kind!r}")
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"{name}: params must be a dataclass")

    def decorate(cls: type[T]) -> type[T]:
        if (kind, name) in _REGISTRY and _REGISTRY[(kind, name)][0] is not cls:
            raise ValueError(f"{kind} policy {name!r} registered twice")
        cls.name = name  # type: ignore[attr-defined]
        _REGISTRY[(kind, name)] = (cls, params)
        return cls

    return decorate


def reserve(kind: Kind, name: str, why: str) -> None:
    """Keep ``name`` out of the table with the reason no daemon can build it (``why`` completes
    "<kind> policy '<name>' ..."): a policy the simulator alone runs, such as the clairvoyant
    ``belady`` (``sim.belady``), so that naming it says so instead of "unknown"."""
    if kind not in _KINDS:
        raise ValueError(f"unknown policy kind {kind!r}")
    _RESERVED[(kind, name)] = why


def names(kind: Kind) -> list[str]:
    return sorted(n for k, n in _REGISTRY if k == kind)


def not_built(kind: Kind, name: str) -> str:
    """Why no policy ``name`` can be built: a reserved name's reason, else that it is unknown."""
    why = _RESERVED.get((kind, name))
    if why is not None:
        return f"{kind} policy {quote(name)} {why}"
    return f"unknown {kind} policy {quote(name)}; known: {', '.join(names(kind))}"


def _lookup(kind: Kind, name: str) -> tuple[type, type]:
    try:
        return _REGISTRY[(kind, name)]
    except KeyError:
        raise ConfigError(not_built(kind, name)) from None


def policy_class(kind: Kind, name: str) -> type:
    """The class registered as ``name`` (ConfigError naming the known ones if none is)."""
    return _lookup(kind, name)[0]


def params_class(kind: Kind, name: str) -> type:
    """The Params dataclass of policy ``name`` (ConfigError naming the known ones if none is)."""
    return _lookup(kind, name)[1]


def _coerce(policy: str, f: dataclasses.Field, value: Any, hints: dict[str, Any]) -> Any:
    want = hints.get(f.name, f.type)
    where = f"{policy}.{f.name}"
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if want is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if want is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if want is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    origin = typing.get_origin(want)
    if origin is Literal:
        if value not in typing.get_args(want):
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, typing.get_args(want)))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(value)
    return value


def build_params(kind: Kind, name: str, values: Mapping[str, Any]) -> Any:
    """Validated params for policy ``name`` from a mapping of overrides."""
    _, params_cls = _lookup(kind, name)
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"{kind} policy {name!r}: unknown parameter {unknown[0]!r}; "
            f"known: {', '.join(sorted(fields)) or '(none)'}"
        )
    hints = typing.get_type_hints(params_cls)
    kwargs = {k: _coerce(name, fields[k], v, hints) for k, v in values.items()}
    try:
        params = params_cls(**kwargs)
        validate = getattr(params, "validate", None)
        if validate is not None:
            validate()
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{kind} policy {name!r}: {exc}") from None
    return params


def build(kind: Kind, spec: str | Mapping[str, Any], rng: random.Random | None = None) -> Any:
    """A policy object from ``"name"`` or ``{"name": ..., param: value, ...}``."""
    if isinstance(spec, str):
        name, values = spec, {}
    else:
        values = dict(spec)
        name = values.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{kind} policy spec needs a 'name', got {dict(spec)!r}")
    cls, _ = _lookup(kind, name)
    params = build_params(kind, name, values)
    return cls(params, rng if rng is not None else random.Random(0))


def describe(kind: Kind, name: str) -> list[tuple[str, Any, str]]:
    """(field, default, help) for each parameter of a policy, for --help and docs."""
    _, params_cls = _lookup(kind, name)
    out = []
    for f in dataclasses.fields(params_cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out.append((f.name, default, str(f.metadata.get("help", ""))))
    return out
