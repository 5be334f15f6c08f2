"""Routing policies; importing this package registers them all."""

from . import cache_aware, dualmap, least_loaded, random, round_robin

__all__ = ["cache_aware", "dualmap", "least_loaded", "random", "round_robin"]
