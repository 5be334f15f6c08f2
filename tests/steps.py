"""Driving a host's generator of steps (``evict_hint_steps`` and friends) as the daemon does."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any


def run_in_parts(steps: Generator[None, None, Any]) -> tuple[int, Any]:
    """Run ``steps`` to the end: how many parts it yielded between, and what it returned."""
    parts = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return parts, done.value
        parts += 1
