"""The radix index's node, ``Block`` (the extension's C twin where built, else ``PyBlock``), and its pending accesses.

Where the extension is built, ``Block`` is its C twin (``_native.c``): the same attributes and
methods in 64 bytes, key stored inline, outside the cycle collector. The Python class below is
the reference (``PyBlock``), used by the pure-Python path and by ``RadixIndex(pure=True)``.
``index.radix`` re-exports both, as the index's own vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import native

__all__ = ["Block", "Pending", "PyBlock", "fold_pending"]


class PyBlock:
    """One cached block. ``children`` is None, a single Block, or a dict key -> Block."""

    __slots__ = ("children", "hits", "holders", "key", "last_access", "parent")

    def __init__(self, key: int, parent: PyBlock | None) -> None:
        self.key = key
        self.parent = parent
        self.children: None | PyBlock | dict[int, PyBlock] = None
        self.holders = 0
        self.last_access: float | dict[int, float] = 0.0
        self.hits: int | dict[int, int] = 0

    def iter_children(self) -> Iterator[PyBlock]:
        c = self.children
        if c is None:
            return iter(())
        if type(c) is not dict:
            return iter((c,))
        return iter(c.values())

    def depth(self) -> int:
        """Blocks from the root to this one, inclusive (block 0 has depth 1)."""
        d = 0
        node: PyBlock | None = self
        while node is not None:
            d += 1
            node = node.parent
        return d

    def __repr__(self) -> str:
        return f"Block({self.key:#x}, holders={self.holders:#b})"


if TYPE_CHECKING:
    Block = PyBlock
else:
    #: the index's node type: the C twin where the extension is built, else the Python class
    Block = PyBlock if native.module is None else native.module.Block


#: path accesses not yet folded into ancestors: (latest time, how many)
Pending = tuple[float, int]


def fold_pending(a: Pending | None, b: Pending | None) -> Pending | None:
    """Both sets of accesses as one: the later time, the hits added."""
    if a is None:
        return b
    if b is None:
        return a
    return (max(a[0], b[0]), a[1] + b[1])
