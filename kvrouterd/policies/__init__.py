"""Routing and eviction policies behind one protocol and one registry.

Importing this package fills the registry from the lists the policy packages keep
(``routing.POLICIES``, ``eviction.POLICIES``), so ``registry`` itself imports no policy; the
names only the simulator runs (``eviction.SIMULATOR_ONLY``) are reserved there.
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
from .registry import build, build_params, describe, names, register, reserve

for _name, _cls, _params in routing.POLICIES:
    register("routing", _name, _params)(_cls)
for _name, _cls, _params in eviction.POLICIES:
    register("eviction", _name, _params)(_cls)
for _name, _why in eviction.SIMULATOR_ONLY:
    reserve("eviction", _name, _why)
del _name, _cls, _params, _why

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
