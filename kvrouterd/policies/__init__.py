"""Routing and eviction policies behind one protocol and one registry."""

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
