"""Eviction policies; importing this package registers them all."""

from . import lru

__all__ = ["lru"]
