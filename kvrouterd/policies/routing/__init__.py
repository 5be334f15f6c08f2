"""Routing policies; importing this package registers them all."""

from . import cache_aware, least_loaded, random, round_robin

__all__ = ["cache_aware", "least_loaded", "random", "round_robin"]
