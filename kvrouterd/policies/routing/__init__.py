"""Routing policies; importing this package registers them all."""

from . import cache_affinity, cache_aware, compose, dualmap, kv_cost, lbgr, least_loaded, min_ttft, preble, random, round_robin

__all__ = [
    "cache_affinity",
    "cache_aware",
    "compose",
    "dualmap",
    "kv_cost",
    "lbgr",
    "least_loaded",
    "min_ttft",
    "preble",
    "random",
    "round_robin",
]
