"""The global radix tree of cached blocks, shared by all workers.

Keys are chained block hashes (``index.keys``), so a block's key names its whole prefix and
one flat ``dict`` finds any block in O(1); parent/child links are kept for what walks the
tree (leaf enumeration, pruning, eviction). Each block records which workers hold it as an
int bitmask over worker *slots*, so ``match`` intersects holder sets with one ``&`` per
block however many workers there are.

Per-(worker, block) recency and hit counts are stored as plain scalars while a block has
one holder (the common case once routing concentrates prefixes) and as ``{slot: value}``
dicts only for blocks several workers share; ``recency``/``hits`` hide the difference. This
keeps a block held by one worker near 150 bytes (see ``kvrouterd bench``).

For every slot the index keeps the set of its *leaves*: held blocks with no child held by
the same worker. Eviction candidates are exactly these (a parent becomes evictable when its
last cached child goes), and walking up from them reaches every block the worker holds.

Plain synchronous Python, no I/O: the daemon and the simulator drive it alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from ._walk import match_walk

__all__ = ["Block", "MatchResult", "RadixIndex"]


class Block:
    """One cached block. ``children`` is None, a single Block, or a dict key -> Block."""

    __slots__ = ("children", "hits", "holders", "key", "last_access", "parent")

    def __init__(self, key: int, parent: Block | None) -> None:
        self.key = key
        self.parent = parent
        self.children: None | Block | dict[int, Block] = None
        self.holders = 0
        self.last_access: float | dict[int, float] = 0.0
        self.hits: int | dict[int, int] = 0

    def iter_children(self) -> Iterator[Block]:
        c = self.children
        if c is None:
            return iter(())
        if type(c) is Block:
            return iter((c,))
        return iter(c.values())  # type: ignore[union-attr]

    def depth(self) -> int:
        """Blocks from the root to this one, inclusive (block 0 has depth 1)."""
        d = 0
        node: Block | None = self
        while node is not None:
            d += 1
            node = node.parent
        return d

    def __repr__(self) -> str:
        return f"Block({self.key:#x}, holders={self.holders:#b})"


class MatchResult:
    """Longest cached prefix per worker slot, found in one walk."""

    __slots__ = ("overlaps", "path")

    def __init__(self, overlaps: dict[int, int], path: list[Block]) -> None:
        #: slot -> number of leading request blocks that slot holds (only slots > 0)
        self.overlaps = overlaps
        #: the request's blocks present in the index, up to the deepest match
        self.path = path

    def overlap(self, slot: int) -> int:
        return self.overlaps.get(slot, 0)


def _held_child(node: Block, bit: int) -> bool:
    c = node.children
    if c is None:
        return False
    if type(c) is Block:
        return bool(c.holders & bit)  # type: ignore[union-attr]
    for child in c.values():  # type: ignore[union-attr]
        if child.holders & bit:
            return True
    return False


class RadixIndex:
    """Blocks held by each worker slot, as one prefix tree. See the module docstring."""

    def __init__(self) -> None:
        self._blocks: dict[int, Block] = {}
        self._leaves: dict[int, set[Block]] = {}
        self._counts: dict[int, int] = {}

    # ---- slots ---------------------------------------------------------------------
    def add_slot(self, slot: int) -> None:
        if slot in self._counts:
            raise ValueError(f"slot {slot} already in use")
        self._leaves[slot] = set()
        self._counts[slot] = 0

    def drop_slot(self, slot: int) -> int:
        """Forget everything ``slot`` holds and free it; returns the blocks dropped."""
        dropped = self.clear(slot)
        del self._leaves[slot]
        del self._counts[slot]
        return dropped

    # ---- queries -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def get(self, key: int) -> Block | None:
        return self._blocks.get(key)

    def count(self, slot: int) -> int:
        return self._counts[slot]

    def holds(self, slot: int, key: int) -> bool:
        node = self._blocks.get(key)
        return node is not None and bool(node.holders >> slot & 1)

    def leaves(self, slot: int) -> set[Block]:
        """The slot's evictable blocks. A live view: copy before mutating the index."""
        return self._leaves[slot]

    def blocks_of(self, slot: int) -> Iterator[Block]:
        """Every block the slot holds, each once, children before parents."""
        bit = 1 << slot
        seen: set[int] = set()
        for leaf in list(self._leaves[slot]):
            node: Block | None = leaf
            while node is not None and node.holders & bit and node.key not in seen:
                seen.add(node.key)
                yield node
                node = node.parent

    def match(self, keys: Sequence[int], slots_mask: int) -> MatchResult:
        """Per-slot longest prefix of ``keys`` held, for the slots in ``slots_mask``."""
        overlaps, path = match_walk(self._blocks, keys, slots_mask)
        return MatchResult(overlaps, path)

    # ---- per-(slot, block) statistics ------------------------------------------------
    @staticmethod
    def recency(node: Block, slot: int) -> float:
        la = node.last_access
        return la[slot] if type(la) is dict else la  # type: ignore[index,return-value]

    @staticmethod
    def hits(node: Block, slot: int) -> int:
        h = node.hits
        return h[slot] if type(h) is dict else h  # type: ignore[index,return-value]

    def touch(self, slot: int, nodes: Iterable[Block], now: float) -> None:
        """Record an access by ``slot`` to blocks it holds (a routed request reusing them)."""
        bit = 1 << slot
        for node in nodes:
            holders = node.holders
            if holders == bit:  # sole holder: scalar stats
                node.last_access = now
                node.hits += 1  # type: ignore[operator]
            elif holders & bit:
                node.last_access[slot] = now  # type: ignore[index]
                node.hits[slot] += 1  # type: ignore[index]

    def _add_stats(self, node: Block, slot: int, now: float) -> None:
        others = node.holders & ~(1 << slot)
        if not others:
            node.last_access, node.hits = now, 0
            return
        la = node.last_access
        if type(la) is not dict:
            first = others.bit_length() - 1  # the single previous holder
            node.last_access = {first: la}  # type: ignore[dict-item]
            node.hits = {first: node.hits}  # type: ignore[dict-item]
        node.last_access[slot] = now  # type: ignore[index]
        node.hits[slot] = 0  # type: ignore[index]

    @staticmethod
    def _drop_stats(node: Block, slot: int) -> None:
        la = node.last_access
        if type(la) is not dict:
            return
        del la[slot]  # type: ignore[arg-type]
        del node.hits[slot]  # type: ignore[union-attr]
        if len(la) == 1:  # type: ignore[arg-type]
            ((_, node.last_access),) = la.items()  # type: ignore[union-attr]
            ((_, node.hits),) = node.hits.items()  # type: ignore[union-attr]

    # ---- mutation ------------------------------------------------------------------
    def store(self, slot: int, parent_key: int | None, keys: Iterable[int], now: float) -> list[Block]:
        """``slot`` now holds the chain ``keys`` hanging under ``parent_key`` (None = root).

        Blocks already held are touched instead. Returns the chain's blocks. Raises
        KeyError if ``parent_key`` is not in the index (nothing is changed then).
        """
        blocks = self._blocks
        parent = None if parent_key is None else blocks[parent_key]
        bit = 1 << slot
        leaves = self._leaves[slot]
        chain: list[Block] = []
        added = 0
        for key in keys:
            node = blocks.get(key)
            if node is None:
                node = Block(key, parent)
                blocks[key] = node
                if parent is not None:
                    c = parent.children
                    if c is None:
                        parent.children = node
                    elif type(c) is Block:
                        parent.children = {c.key: c, key: node}  # type: ignore[union-attr]
                    else:
                        c[key] = node  # type: ignore[index]
            if node.holders & bit:
                self.touch(slot, (node,), now)
            else:
                self._add_stats(node, slot, now)
                node.holders |= bit
                added += 1
                if node.children is None or not _held_child(node, bit):
                    leaves.add(node)
                if parent is not None and parent.holders & bit:
                    leaves.discard(parent)
            chain.append(node)
            parent = node
        self._counts[slot] += added
        return chain

    def remove(self, slot: int, key: int) -> bool:
        """``slot`` no longer holds ``key``. False (and no change) if it did not."""
        node = self._blocks.get(key)
        bit = 1 << slot
        if node is None or not node.holders & bit:
            return False
        self._release(node, slot, bit)
        self._counts[slot] -= 1
        leaves = self._leaves[slot]
        leaves.discard(node)
        parent = node.parent
        if parent is not None and parent.holders & bit and not _held_child(parent, bit):
            leaves.add(parent)
        self._prune(node)
        return True

    def clear(self, slot: int) -> int:
        """``slot`` holds nothing any more. Returns how many blocks it held."""
        bit = 1 << slot
        held = list(self.blocks_of(slot))
        for node in held:
            self._release(node, slot, bit)
        for node in held:
            self._prune(node)
        self._leaves[slot].clear()
        self._counts[slot] = 0
        return len(held)

    def _release(self, node: Block, slot: int, bit: int) -> None:
        self._drop_stats(node, slot)
        node.holders &= ~bit

    def _prune(self, node: Block | None) -> None:
        """Delete blocks nobody holds and nothing hangs under, walking up."""
        blocks = self._blocks
        while node is not None and not node.holders and node.children is None:
            if blocks.get(node.key) is not node:
                return  # already pruned through another path
            del blocks[node.key]
            parent = node.parent
            if parent is not None:
                c = parent.children
                if type(c) is Block:
                    parent.children = None
                else:
                    del c[node.key]  # type: ignore[union-attr]
                    if len(c) == 1:  # type: ignore[arg-type]
                        (parent.children,) = c.values()  # type: ignore[union-attr]
            node.parent = None
            node = parent
