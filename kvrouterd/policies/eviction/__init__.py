"""Eviction policies; importing this package registers them all."""

from . import hybrid, lfu, lru, rlt, tlru, unicache

__all__ = ["hybrid", "lfu", "lru", "rlt", "tlru", "unicache"]
