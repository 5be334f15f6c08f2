"""Routing and eviction policies behind one protocol and one registry.

Importing this package fills the registry from the lists the policy packages keep
(``routing.POLICIES``, ``eviction.POLICIES``), so ``registry`` itself imports no policy.
"""

from __future__ import annotations

from . import eviction, routing
from .base import (
    AccessInfo,
    EvictionContext,
    EvictionPolicy,
    EvictionPolicyBase,
    RoutingContext,
    RoutingPolicy,
    RoutingPolicyBase,
)
from .registry import build, build_params, describe, names, register

for _name, _cls, _params in routing.POLICIES:
    register("routing", _name, _params)(_cls)
for _name, _cls, _params in eviction.POLICIES:
    register("eviction", _name, _params)(_cls)
del _name, _cls, _params

__all__ = [
    "AccessInfo",
    "EvictionContext",
    "EvictionPolicy",
    "EvictionPolicyBase",
    "RoutingContext",
    "RoutingPolicy",
    "RoutingPolicyBase",
    "build",
    "build_params",
    "describe",
    "names",
    "register",
]
