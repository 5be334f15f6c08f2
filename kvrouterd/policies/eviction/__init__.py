"""Eviction policies; importing this package registers them all."""

from . import hybrid, lfu, lru

__all__ = ["hybrid", "lfu", "lru"]
