"""Releasing a worker's eviction state piece by piece (issue #16 item 1).

A policy's state for a worker of 400k blocks is dicts and sets of that many entries, and
conversations by the ten thousand: dropping it at once (``on_cleared``) held the routing loop
for 10-125 ms depending on the policy (CPython frees a container and everything only it
refers to in one call). When a worker is removed or its cache is cleared, the router moves it
off its slot first, so nothing reads the old slot's state any more and it can go in parts:
``clear_steps`` detaches it and ``release_steps`` empties the detached containers at most
``step`` entries at a time, the host yielding to its loop between parts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["release_steps"]


def release_steps(containers: list[Any], step: int) -> Iterator[None]:
    """Empty ``containers`` (dicts, sets, lists; a dict's or list's values that are large
    containers themselves are emptied in turn) in parts of at most ``step`` entries, yielding
    after each part. Nothing else may refer to them: emptying is what frees their entries."""
    stack = list(containers)
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            while obj:
                for _ in range(min(step, len(obj))):
                    _, value = obj.popitem()
                    if _is_big(value):
                        stack.append(value)
                yield
        elif isinstance(obj, set):
            while obj:
                for _ in range(min(step, len(obj))):
                    obj.pop()
                yield
        elif isinstance(obj, list):
            while obj:
                for value in obj[-step:]:
                    if _is_big(value):
                        stack.append(value)
                del obj[-step:]
                yield
        else:  # a SortedList: emptied at once (a list of lists of ~1,000 tuples each)
            obj.clear()
            yield


def _is_big(value: object) -> bool:
    """Worth emptying piece by piece: a container of more than a few entries."""
    return isinstance(value, dict | set | list) and len(value) > 64
