"""The global radix tree of cached blocks, shared by all workers.

Keys are chained block hashes (``index.keys``), so a block's key names its whole prefix and
one flat ``dict`` finds any block in O(1); parent/child links are kept for what walks the
tree (leaf enumeration, pruning, eviction). Each block records which workers hold it as an
int bitmask over worker *slots*, so ``match`` intersects holder sets with one ``&`` per
block however many workers there are.

Per-(worker, block) recency and hit counts are stored as plain scalars while a block has
one holder (the common case once routing concentrates prefixes) and as ``{slot: value}``
dicts only for blocks several workers share; ``recency``/``hits`` hide the difference. This
keeps a block held by one worker small (64 bytes natively, see ``kvrouterd bench``).

A routed request reuses a whole prefix, root to deepest matched block, and stamping every
block of it (250 blocks for a 4,000-token prompt) would cost more than the rest of a routing
decision. ``touch_path`` therefore records the access on the deepest block only, as *pending*:
it stands for the same access on every ancestor up to where the slot's chain of held blocks
starts. The true value of a block is its own stats folded with the pending accesses of its
held descendants (latest time, summed hits), so a leaf's is read in O(1) and an interior
block's by walking its held subtree. When a block stops being held its pending
accesses move up to its parent, which thus reads the same before and after. Storing a block
into a gap above held blocks first settles their pending accesses into their own stats, so
that accesses from before the gap existed do not reach the new block. Folding takes the
latest time, which is the last one because times never go backwards (``Clock``).

Pending accesses live in a side table on the index (``RadixIndex._pending``), not on the
Block: only the deepest blocks of recently routed prefixes have any, and another field would
move every Block to a larger allocator size class (+16 bytes per indexed block). So
whatever reads a block's stats goes through the index (``recency``, ``hits``, ``pending``),
and eviction hooks are handed it.

The tree's node is ``Block`` (``index.block``): the extension's C twin where it is built, else
the Python reference ``PyBlock``, which ``RadixIndex(pure=True)`` uses always.

A block no slot holds stays in the tree while held blocks hang under it (an engine evicted a
chain's first blocks and kept the rest): it is never a hit, but when the engine stores it again
the blocks below are matched through it at once. ``unheld`` counts such blocks, which
``add_unheld`` re-creates when a replica imports a peer's index.

For every slot the index keeps the set of its *leaves*: held blocks with no child held by
the same worker. Eviction candidates are exactly these (a parent becomes evictable when its
last cached child goes), and walking up from them reaches every block the worker holds.

Plain synchronous Python, no I/O: the daemon and the simulator drive it alike.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from types import MappingProxyType
from typing import Any, Final

from . import native
from ._walk import MatchResult, match_walk
from .block import Block, Pending, PyBlock, fold_pending
from .keys import chain_keys_array
from .native import block_table

__all__ = ["Block", "MatchResult", "Pending", "PyBlock", "RadixIndex", "fold_pending"]


#: the native engine-hash map, which BlockTable.store_hashed fills itself (None: no extension)
_U64Map = None if native.module is None else native.module.U64Map
#: ``touch_path``'s one step in C (None: no extension)
_touch_pending = None if native.module is None else native.module.touch_pending
#: a walk's MatchResult without a call of ``__init__`` (a Python frame on every decision)
_new_match_result = native.positional_constructor(MatchResult)


def _held_child(node: Block, bit: int) -> bool:
    c = node.children
    if c is None:
        return False
    if type(c) is not dict:
        return bool(c.holders & bit)  # type: ignore[union-attr]
    for child in c.values():  # type: ignore[union-attr]
        if child.holders & bit:
            return True
    return False


class RadixIndex:
    """Blocks held by each worker slot, as one prefix tree. See the module docstring."""

    def __init__(self, *, pure: bool = False) -> None:
        #: key -> Block (a native BlockTable where the extension is built: index.native);
        #: ``pure``: a dict of PyBlocks even then, the reference the native path is tested against
        self._blocks: MutableMapping[int, Block] = {} if pure else block_table()
        self._block: Any = PyBlock if pure else Block
        self._leaves: dict[int, set[Block]] = {}
        self._counts: dict[int, int] = {}
        #: slot -> ``count``, a live read-only view: for a caller reading several slots at
        #: once, where a call per slot costs more than the reading (an attribute: a property's
        #: read is a Python call, ~600 instructions, on every decision that breaks a tie)
        self.counts: Final[Mapping[int, int]] = MappingProxyType(self._counts)
        #: slot bit (1 << slot) -> blocks that slot alone holds: what leaves the routable index at
        #: once when the slot is retired (``count_alone``); kept where a block gains or loses a
        #: holder (``store``, ``_release``), keyed by bit as a lone holder's bit is its holders
        self._alone: dict[int, int] = {}
        #: block -> path accesses pending on it (module docstring): ``(last access, hits)``
        #: while one slot holds the block, else ``{slot: (last, hits)}``. Only blocks that have
        #: some are present; an entry goes when its last holder does (``_drop_stats``).
        self._pending: dict[Block, Pending | dict[int, Pending]] = {}
        #: blocks no slot holds, kept because held blocks hang under them (``unheld``)
        self._unheld = 0

    @property
    def native_blocks(self) -> bool:
        """Whether this index's blocks are the extension's ``Block`` (what native containers of
        blocks, such as the leaf tracker's ``LeafOrder``, hold)."""
        return self._block is not PyBlock

    # ---- slots ---------------------------------------------------------------------
    def add_slot(self, slot: int) -> None:
        if slot in self._counts:
            raise ValueError(f"slot {slot} already in use")
        self._leaves[slot] = set()
        self._counts[slot] = 0
        self._alone[1 << slot] = 0

    def drop_slot(self, slot: int) -> int:
        """Forget everything ``slot`` holds and free it; returns the blocks dropped."""
        dropped = self.clear(slot)
        del self._leaves[slot]
        del self._counts[slot]
        del self._alone[1 << slot]
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

    @property
    def unheld(self) -> int:
        """Blocks no slot holds, in the tree only because held blocks hang under them: never a hit."""
        return self._unheld

    def count_alone(self, slot: int) -> int:
        """Blocks ``slot`` holds and no other slot does."""
        return self._alone[1 << slot]

    def slots(self) -> Iterable[int]:
        """Every slot added and not dropped."""
        return self._counts.keys()

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
        return _new_match_result(overlaps, path)

    # ---- per-(slot, block) statistics ------------------------------------------------
    # A block's true stats for a slot: its own (set when stored, bumped by ``touch``) folded
    # with the pending path accesses of itself and its held descendants (module docstring).
    def recency(self, node: Block, slot: int) -> float:
        """When ``slot`` last stored or used ``node``: O(1) on a leaf, else O(held subtree)."""
        la = node.last_access
        if type(la) is dict:
            la = la[slot]  # type: ignore[index]
        # _pending_through written out: the leaf tracker reads this for every stored event's leaf
        up = self._pending.get(node)
        if type(up) is dict:
            up = up.get(slot)  # type: ignore[union-attr]
        if node.children is not None:
            up = fold_pending(up, self._pending_below(node, slot))  # type: ignore[arg-type]
        return up[0] if up is not None and up[0] > la else la  # type: ignore[index,operator,return-value]

    def hits(self, node: Block, slot: int) -> int:
        """Later uses of ``node`` by ``slot`` since it was stored (same costs as ``recency``)."""
        h = node.hits
        if type(h) is dict:
            h = h[slot]  # type: ignore[index]
        up = self._pending_through(node, slot)
        return h + up[1] if up is not None else h  # type: ignore[operator,return-value]

    def _pending_through(self, node: Block, slot: int) -> Pending | None:
        """The path accesses that count for ``node``: its own pending ones and its held descendants'."""
        up = self.pending(node, slot)
        if node.children is not None:
            up = fold_pending(up, self._pending_below(node, slot))
        return up

    def pending(self, node: Block, slot: int) -> Pending | None:
        """Path accesses recorded on ``node`` for ``slot`` that also count for its ancestors."""
        up = self._pending.get(node)
        return up.get(slot) if type(up) is dict else up  # type: ignore[union-attr,return-value]

    def _set_pending(self, node: Block, slot: int, value: Pending | None) -> None:
        table = self._pending
        up = table.get(node)
        if type(up) is dict:
            if value is not None:
                up[slot] = value  # type: ignore[index]
                return
            up.pop(slot, None)  # type: ignore[union-attr]
            if not up:
                del table[node]
        elif node.holders == 1 << slot:
            if value is not None:
                table[node] = value
            elif up is not None:
                del table[node]
        elif value is not None:
            table[node] = {slot: value}

    def _pending_below(self, node: Block, slot: int) -> Pending | None:
        """Pending accesses of ``node``'s held descendants (reached through held blocks)."""
        bit = 1 << slot
        pending = self.pending
        total: Pending | None = None
        stack = [c for c in node.iter_children() if c.holders & bit]
        while stack:
            n = stack.pop()
            total = fold_pending(total, pending(n, slot))
            if n.children is not None:
                stack.extend(c for c in n.iter_children() if c.holders & bit)
        return total

    def as_leaf(self, node: Block, slot: int, pending: Pending | None) -> Block:
        """A detached copy of ``node`` as ``slot`` would hold it once its held descendants were
        removed, given their pending accesses folded with ``node``'s own (``pending``).

        Eviction ranks a parent promoted after its children were chosen by this copy, so it
        scores as it will once they are gone, without walking the chosen subtree again. The
        copy is in no table: ``pending`` is folded into its own stats, which is what this
        index's ``recency``/``hits`` would read for it."""
        copy = self._block(node.key, node.parent)
        copy.holders = 1 << slot
        la, h = node.last_access, node.hits
        if type(la) is dict:
            la, h = la[slot], h[slot]  # type: ignore[index]
        if pending is not None:
            la = max(la, pending[0])  # type: ignore[type-var]
            h += pending[1]  # type: ignore[operator]
        copy.last_access, copy.hits = la, h
        return copy

    def touch(self, slot: int, nodes: Iterable[Block], now: float) -> None:
        """Record an access by ``slot`` to each of ``nodes`` it holds, and to nothing else.

        O(blocks): for a request reusing a prefix use ``touch_path``."""
        bit = 1 << slot
        for node in nodes:
            holders = node.holders
            if holders == bit:  # sole holder: scalar stats
                node.last_access = now
                node.hits += 1  # type: ignore[operator]
            elif holders & bit:
                node.last_access[slot] = now  # type: ignore[index]
                node.hits[slot] += 1  # type: ignore[index]

    def touch_path(self, slot: int, path: Sequence[Block], now: float) -> None:
        """Record an access by ``slot`` to every block of ``path`` in O(1).

        ``path`` is a chain of blocks ``slot`` holds, each the parent of the next, whose first
        block is a root or has a parent ``slot`` does not hold: a matched prefix. The access is
        kept pending on the last block and reaches the others when they are read
        (``recency``/``hits``), exactly as if each had been touched."""
        if path and (_touch_pending is None or _touch_pending(self._pending, slot, path[-1], now) is NotImplemented):
            self._touch_py(slot, path[-1], now)

    def _touch_py(self, slot: int, node: Block, now: float) -> None:
        """``touch_path``'s access of the path's last block ``node``: the reference of the native
        ``touch_pending`` (``_native.c``), which takes native Blocks."""
        holders = node.holders
        table = self._pending
        if holders == 1 << slot:
            up = table.get(node)
            table[node] = (now, 1) if up is None else (now, up[1] + 1)  # type: ignore[index,operator]
        elif holders >> slot & 1:
            up = table.get(node)
            if up is None:
                table[node] = {slot: (now, 1)}
            else:
                old = up.get(slot)  # type: ignore[union-attr]
                up[slot] = (now, 1) if old is None else (now, old[1] + 1)  # type: ignore[index]

    def _add_stats(self, node: Block, slot: int, now: float) -> None:
        others = node.holders & ~(1 << slot)
        if not others:  # nothing is pending on a block nobody held (see ``_drop_stats``)
            node.last_access, node.hits = now, 0
            return
        la = node.last_access
        if type(la) is not dict:
            first = others.bit_length() - 1  # the single previous holder
            node.last_access = {first: la}  # type: ignore[dict-item]
            node.hits = {first: node.hits}  # type: ignore[dict-item]
            up = self._pending.get(node)
            if up is not None:
                self._pending[node] = {first: up}  # type: ignore[dict-item]
        node.last_access[slot] = now  # type: ignore[index]
        node.hits[slot] = 0  # type: ignore[index]

    def _drop_stats(self, node: Block, slot: int) -> None:
        """Forget ``slot``'s stats of ``node``, pending accesses included (the caller has moved
        those up where they still count), so the side table keeps no entry for a lost holder."""
        table = self._pending
        la = node.last_access
        if type(la) is not dict:
            if table:
                table.pop(node, None)
            return
        del la[slot]  # type: ignore[arg-type]
        del node.hits[slot]  # type: ignore[union-attr]
        up = table.get(node)
        if up is not None:
            up.pop(slot, None)  # type: ignore[union-attr]
        if len(la) == 1:  # type: ignore[arg-type]
            ((last, node.last_access),) = la.items()  # type: ignore[union-attr]
            ((_, node.hits),) = node.hits.items()  # type: ignore[union-attr]
            if up is not None:
                rest = up.get(last)  # type: ignore[union-attr]
                if rest is None:
                    del table[node]
                else:
                    table[node] = rest
        elif up is not None and not up:
            del table[node]

    def _settle(self, top: Block, slot: int) -> Pending | None:
        """Fold the pending accesses of ``top``'s held subtree into each block's own stats, so
        none stay pending (every value is unchanged); returns what was pending in all of it."""
        bit = 1 << slot
        order = [top]  # parents before children; settled in reverse
        for node in order:
            if node.children is not None:
                order.extend(c for c in node.iter_children() if c.holders & bit)
        below: dict[int, Pending] = {}  # key -> pending of its held subtree, once settled
        total: Pending | None = None
        for node in reversed(order):
            total = self.pending(node, slot)
            if node.children is not None:
                for c in node.iter_children():
                    total = fold_pending(total, below.pop(c.key, None))
            if total is None:
                continue
            self._set_pending(node, slot, None)
            la = node.last_access
            if type(la) is dict:
                la[slot] = max(la[slot], total[0])  # type: ignore[index]
                node.hits[slot] += total[1]  # type: ignore[index]
            else:
                node.last_access = max(la, total[0])  # type: ignore[type-var]
                node.hits += total[1]  # type: ignore[operator]
            below[node.key] = total
        return total

    # ---- mutation ------------------------------------------------------------------
    def store(self, slot: int, parent_key: int | None, keys: Iterable[int], now: float) -> list[Block]:
        """``slot`` now holds the chain ``keys`` hanging under ``parent_key`` (None = root).

        Blocks already held are touched instead. Returns the chain's blocks. Raises
        KeyError if ``parent_key`` is not in the index (nothing is changed then).

        A block already indexed stays under the parent it has, which is the chain's previous
        block whenever the keys were hashed from tokens. Route takes block keys from clients as
        they come (an approximate-mode worker then stores them), so they may name blocks of
        other prompts, out of order: leaves are kept by the tree's links, never the chain's,
        or a held block would be lost from its slot's leaves and outlive its slot (issue #28
        item 2: ``KeyError(1 << slot)`` once the slot was dropped). ``keys`` as
        an ``array('Q')`` is read in place by the native table (no int object per key).
        """
        blocks = self._blocks
        parent = None if parent_key is None else blocks[parent_key]
        if type(keys) is not list and type(keys) is not array:
            keys = list(keys)
        bit = 1 << slot
        leaves = self._leaves[slot]
        chain: list[Block] = []
        added = alone = 0  # blocks this slot now holds, and of them those it alone holds
        alone_by_bit = self._alone
        # the native table runs this loop itself (BlockTable.store_chain), up to a block it
        # leaves to the loop below: one filling a gap above blocks the slot holds (_settle),
        # or one nobody holds (self._unheld)
        store_chain = getattr(blocks, "store_chain", None)
        i, n = 0, len(keys)
        while i < n:
            if store_chain is not None:
                start = i
                i, stored, stored_alone = store_chain(self._block, parent, keys, i, slot, now, leaves, chain,
                                                      self._pending, alone_by_bit)
                added += stored
                alone += stored_alone
                if i > start:
                    parent = chain[-1]
                if i == n:
                    break
            key = keys[i]
            i += 1
            node = blocks.get(key)
            if node is None:
                # a new block (the common case: engines report what they just computed): no
                # other holder, no children, so it is a leaf with fresh stats and no pending
                node = self._block(key, parent)
                blocks[key] = node
                if parent is not None:
                    c = parent.children
                    if c is None:
                        parent.children = node
                    elif type(c) is not dict:
                        parent.children = {c.key: c, key: node}  # type: ignore[union-attr]
                    else:
                        c[key] = node  # type: ignore[index]
                    if parent.holders & bit:
                        leaves.discard(parent)
                node.last_access = now
                node.holders = bit
                leaves.add(node)
                added += 1
                alone += 1
                chain.append(node)
                parent = node
                continue
            if node.holders & bit:
                self.touch(slot, (node,), now)
            else:
                if node.children is not None and _held_child(node, bit):
                    # filling a gap: accesses pending below it predate it and stop here
                    for child in node.iter_children():
                        if child.holders & bit:
                            self._settle(child, slot)
                else:
                    leaves.add(node)
                self._add_stats(node, slot, now)
                holders = node.holders
                if not holders:  # a gap's block nobody held: now this slot's alone
                    alone += 1
                    self._unheld -= 1
                elif not holders & (holders - 1):  # its one holder no longer holds it alone
                    alone_by_bit[holders] -= 1
                node.holders = holders | bit
                added += 1
                # the block's own parent stops being a leaf, which need not be the chain's
                # previous block (see the docstring: keys a client sent)
                above = node.parent
                if above is not None and above.holders & bit:
                    leaves.discard(above)
            chain.append(node)
            parent = node
        self._counts[slot] += added
        alone_by_bit[bit] += alone
        return chain

    def store_hashed(self, slot: int, parent_key: int | None, data: bytes, block_size: int, seed: int, now: float,
                     engine_keys: MutableMapping[int, int] | None = None, hashes: Sequence[int] | None = None,
                     ) -> tuple[array, list[Block]]:
        """A stored event's chain from its tokens: ``keys = chain_keys_array(data, block_size, seed)``,
        ``store(slot, parent_key, keys, now)``, then ``engine_keys[h] = k`` for each pair of
        ``hashes`` (the publisher's hash of each block) and ``keys`` where ``h != k``. Returns
        ``(keys, blocks)``.

        Where the extension is built and ``engine_keys`` is None or a native ``U64Map``, the three
        are one native call (``BlockTable.store_hashed``) unless a block fills a gap above blocks
        the slot holds or nobody holds it (``store``); the Python below is the reference it is
        tested against."""
        store_hashed = getattr(self._blocks, "store_hashed", None)
        if store_hashed is not None and (engine_keys is None or type(engine_keys) is _U64Map):
            parent = None if parent_key is None else self._blocks[parent_key]
            chain: list[Block] = []
            # the counts (store's _counts and _alone) are added in the call
            keys, stop = store_hashed(self._block, parent, data, block_size, seed, slot, now, self._leaves[slot],
                                      chain, self._pending, self._alone, self._counts, engine_keys, hashes)
            if stop == len(keys):
                return keys, chain  # the engine hashes are mapped too
            # a block left to store's loop: on from there as store goes (chain[-1] is its parent)
            chain += self.store(slot, chain[-1].key if chain else parent_key, keys[stop:], now)
            if engine_keys is not None and hashes is not None:
                engine_keys.map_pairs(hashes, keys)  # type: ignore[attr-defined]  # the loop below, in C
            return keys, chain
        keys = chain_keys_array(data, block_size, seed)
        chain = self.store(slot, parent_key, keys, now)
        if engine_keys is not None and hashes is not None:
            for eh, key in zip(hashes, keys):
                if eh != key:
                    engine_keys[eh] = key
        return keys, chain

    @property
    def stores_events(self) -> bool:
        """Whether ``store_events`` is available (the extension's table holds this index)."""
        return hasattr(self._blocks, "store_events")

    def store_events(self, slot: int, events: tuple[Any, ...], start: int, block_size: int, page: int, now: float,
                     engine_keys: MutableMapping[int, int], reverse: MutableMapping[int, int] | None,
                     hook: tuple[Any, Any] | None,
                     trace: list[tuple[int | None, array]] | None,
                     ) -> tuple[int, int, int, tuple[int | None, array, list[Block]] | None]:
        """Store the plain Stored events of ``events`` from ``start`` on, natively, in one call
        (``BlockTable.store_events``, only where ``stores_events``): each one's parent resolved
        through ``engine_keys`` (a native ``U64Map``; an engine's parent hash, else our key
        the slot holds, else its blocks are orphans), its chain hashed and stored as
        ``store_hashed`` does, its engine hashes mapped (and each key to its engine hash in
        ``reverse``, None or a ``U64Map``), then ``order.stored(self, slot, blocks, priority)``
        for ``hook = (order, priority)``. ``trace`` gets ``(parent key, keys)`` of
        every event stored. ``page``: the publisher's page size where an event names none.

        Returns ``(next, blocks stored, orphan blocks, partial)``: ``events[next]`` is the first
        event not applied (not plain: the caller's per-event path applies it), and ``partial``
        is None, or ``(parent_key, keys, blocks)`` of ``events[next - 1]``, whose store ended in
        ``store``'s Python loop (a block filling a gap above blocks the slot holds, or one
        nobody holds): stored, but its engine hashes are not mapped either way nor its hook run.
        ``router.events.EventApplier``'s per-event path is the reference."""
        order, priority = hook if hook is not None else (None, None)
        nxt, stored, orphans, partial = self._blocks.store_events(  # type: ignore[attr-defined]
            self._block, events, start, slot, now, block_size, page, self._leaves[slot], self._pending, self._alone,
            self._counts, engine_keys, reverse, order, priority, self, trace)
        if partial is None:
            return nxt, stored, orphans, None
        keys, chain, stop, parent_key = partial
        # on from there as store goes (chain[-1] is its parent), as store_hashed does
        chain += self.store(slot, chain[-1].key if chain else parent_key, keys[stop:], now)
        return nxt + 1, stored, orphans, (parent_key, keys, chain)

    def add_unheld(self, key: int, parent_key: int | None) -> Block:
        """Put ``key`` under ``parent_key`` (None = root) held by no slot, as a block an engine
        evicted above blocks it kept: a replica importing a peer's index re-creates such blocks
        right before it stores what hangs under them. Returns the block (the one in place if
        ``key`` is indexed already). Raises KeyError if ``parent_key`` is not in the index."""
        blocks = self._blocks
        node = blocks.get(key)
        if node is not None:
            return node
        parent = None if parent_key is None else blocks[parent_key]
        node = self._block(key, parent)
        blocks[key] = node
        if parent is not None:
            c = parent.children
            if c is None:
                parent.children = node
            elif type(c) is not dict:
                parent.children = {c.key: c, key: node}  # type: ignore[union-attr]
            else:
                c[key] = node  # type: ignore[index]
        self._unheld += 1
        return node

    def remove(self, slot: int, key: int) -> bool:
        """``slot`` no longer holds ``key``. False (and no change) if it did not."""
        node = self._blocks.get(key)
        bit = 1 << slot
        if node is None or not node.holders & bit:
            return False
        # the native table does all of what follows itself for a lone leaf (the usual eviction)
        remove_held = getattr(self._blocks, "remove_held", None)
        before = len(self._blocks)
        if remove_held is not None and remove_held(node, bit, self._leaves[slot], self._pending):
            # besides the block, it pruned the unheld blocks above it that nothing else hangs under
            self._unheld -= before - 1 - len(self._blocks)
            self._counts[slot] -= 1
            self._alone[bit] -= 1  # it did: the slot was the block's only holder
            return True
        parent = node.parent
        held_parent = parent is not None and parent.holders & bit
        if held_parent:  # the parent keeps the accesses pending here and below
            up = self.pending(node, slot)
            if node.children is not None:
                up = fold_pending(up, self._pending_below(node, slot))
            if up is not None:
                self._set_pending(parent, slot, fold_pending(self.pending(parent, slot), up))  # type: ignore[arg-type]
        self._release(node, slot, bit)
        self._counts[slot] -= 1
        leaves = self._leaves[slot]
        leaves.discard(node)
        if held_parent and not _held_child(parent, bit):  # type: ignore[arg-type]
            leaves.add(parent)  # type: ignore[arg-type]
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

    def clear_steps(self, slot: int, step: int) -> Iterator[int]:
        """``clear`` in parts of at most ``step`` blocks, leaves first; yields the blocks
        dropped by each part. Between parts the index is consistent (each part is a run of
        ``remove``), so a host can serve other calls while a large slot empties."""
        leaves = self._leaves[slot]
        while leaves:
            part = list(itertools.islice(leaves, step))
            for node in part:
                self.remove(slot, node.key)
            yield len(part)

    def _release(self, node: Block, slot: int, bit: int) -> None:
        self._drop_stats(node, slot)
        holders = node.holders & ~bit
        node.holders = holders
        if not holders:
            self._alone[bit] -= 1
            self._unheld += 1  # until _prune deletes it, if nothing hangs under it
        elif not holders & (holders - 1):  # its one holder left holds it alone now
            self._alone[holders] += 1

    def _prune(self, node: Block | None) -> None:
        """Delete blocks nobody holds and nothing hangs under, walking up."""
        blocks = self._blocks
        while node is not None and not node.holders and node.children is None:
            if blocks.get(node.key) is not node:
                return  # already pruned through another path
            del blocks[node.key]
            self._unheld -= 1
            parent = node.parent
            if parent is not None:
                c = parent.children
                if type(c) is not dict:
                    parent.children = None
                else:
                    del c[node.key]  # type: ignore[union-attr]
                    if len(c) == 1:  # type: ignore[arg-type]
                        (parent.children,) = c.values()  # type: ignore[union-attr]
            node.parent = None
            node = parent


if native.module is not None:
    # the lru leaf tracker's priority: LeafOrder.stored (its hook, once per stored event)
    # computes it itself for a leaf with no children and no pending accesses; the method above
    # is the reference, and answers every other case
    native.module.set_leaf_recency(RadixIndex.recency)
