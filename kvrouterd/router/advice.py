"""Eviction advice for engines (EvictHint) and a worker's index exported to, or imported from, a peer replica.

An engine that must free KV blocks asks which of a worker's blocks matter least to the rest
of the fleet; the eviction policy ranks them (``EvictionPolicy.rank``, ``rank_steps``), never
a pinned block and never a block before a held child of it (``still_evictable``), and the
answer names them by the engine's own hashes (``engine_hashes``). Both the ranking and the
export run in parts a host yields between, so a large worker never stalls the routing loop
(issue #16 item 1). Exported blocks are listed parents first, so a replica warmed from a peer
imports them as the engine's events would have stored them; the blocks no worker holds that
a worker's blocks hang under (an engine evicted a chain's first blocks and kept the rest) come
along, so the replica's tree is the peer's, and a hit there once the engine stores them again
is a hit here too (issue #28 item 12).
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

from ..errors import InvalidRequest
from ..index.native import u64_map
from ..index.radix import Block
from ..policies.base import EvictionContext
from ..policies.eviction._leaves import score_leaves_steps, still_evictable
from ..policies.eviction._release import release_steps
from ..protocols import EvictAdvice, EvictRequest
from .access import NO_ACCESS_INFO
from .engine_hashes import EngineHashMaps, invert_steps
from .shared import Shared
from .speculative import SpeculativeBlocks

__all__ = ["Advisor"]

#: ``(key, parent key or None)`` of a block no worker holds that exported blocks hang under
Unheld = tuple[int, int | None]


class Advisor:
    """Answers eviction hints and exports or imports a worker's blocks; keeps no state of its
    own beyond the engine-hash maps it is given. Speculative blocks (``speculative``), which
    the engine does not hold yet, are neither advised nor exported."""

    def __init__(self, shared: Shared, hashes: EngineHashMaps, speculative: SpeculativeBlocks) -> None:
        self._shared = shared
        self._hashes = hashes
        self._speculative = speculative

    # ---- snapshots (warming a replica from a peer) -----------------------------------
    def export_blocks(self, worker_id: str) -> list[tuple[int, int | None, int]]:
        """``(key, parent key or None, engine hash or 0)`` of every block the worker holds,
        parents before children (a chain's top names a parent this worker does not hold)."""
        return [block for part in self.export_steps(worker_id) for block in part]

    def export_steps(
        self, worker_id: str, step: int = 1 << 62, unheld: list[Unheld] | None = None
    ) -> Iterator[list[tuple[int, int | None, int]]]:
        """``export_blocks`` in parts, each after visiting at most ``step`` blocks.

        With ``unheld``, each part first appends to it the blocks no worker holds that its
        blocks hang under (an engine evicted a chain's first blocks and kept the rest), parents
        first, each once, and only right before a block under it: an importer puts one back
        only where it stores something under it.

        The host may apply events between parts (ExportIndex yields to the loop so a large
        worker never stalls routing): blocks removed meanwhile are skipped, blocks stored
        under already visited ones are missed, and a removed worker ends the export. Every
        block is still listed once, after its parent (or naming a parent it never held).
        """
        workers = self._shared.workers
        worker = workers.get(worker_id)
        bit, slot, index = worker.bit, worker.slot, self._shared.index
        reverse = self._hashes.built(slot)
        if reverse is None:  # this worker never asked for a hint: its engine hashes, in parts too
            reverse = u64_map(len(worker.engine_keys))  # sized ahead: see EngineHashMaps._build
            for _ in invert_steps(worker.engine_keys, reverse, step):
                yield []
                if workers.find(worker_id) is not worker or worker.slot != slot:
                    return
        tops: list[Block] = []
        #: the worker's blocks and the unheld ones between or above them, as the climbs found them
        climbed: set[int] = set()

        def on_chain(node: Block) -> bool:
            holders = node.holders
            return bool(holders & bit) or not holders

        def climb(node: Block | None) -> int:
            """Walk up from a leaf to the top of its chain, through blocks nobody holds;
            returns the blocks visited."""
            visited = 0
            while node is not None and on_chain(node) and node.key not in climbed:
                climbed.add(node.key)
                visited += 1
                if node.parent is None or not on_chain(node.parent):
                    tops.append(node)
                node = node.parent
            return visited

        visited = 0
        for leaf in list(index.leaves(slot)):
            visited += climb(leaf)
            if visited >= step:
                visited = 0
                yield []
                if workers.find(worker_id) is not worker or worker.slot != slot:
                    return  # removed, or cleared (moved off the slot being walked)
        # leaves that appeared meanwhile (a removal exposes its parent): climbing them stops
        # at the first block already seen, so this costs what changed, plus a look at each leaf
        # (in steps too: 25k leaves against a set of 400k keys held the loop ~25 ms)
        late = list(index.leaves(slot))
        for start in range(0, len(late), step):
            for leaf in late[start : start + step]:
                if leaf.key not in climbed:
                    climb(leaf)
            if len(late) > step:
                yield []
                if workers.find(worker_id) is not worker or worker.slot != slot:
                    return
        stack, listed = tops, set()
        claimed = self._speculative.keys_on(worker_id)  # a peer would take them as stored for good
        #: unheld blocks passed on the way down and not listed yet (``_list_unheld``)
        passed: set[int] = set()
        out: list[tuple[int, int | None, int]] = []
        while stack:
            node = stack.pop()
            if node.key in listed or index.get(node.key) is not node or node.key in claimed:
                continue  # removed (or listed through a parent stored meanwhile), or not stored yet
            holders = node.holders
            if holders & bit:
                parent = node.parent
                if unheld is not None and parent is not None and parent.key in passed:
                    _list_unheld(parent, passed, unheld)
                out.append((node.key, parent.key if parent is not None else None, reverse.get(node.key, 0)))
            elif node.key not in climbed:
                continue  # not the worker's, nor between its blocks when the climbs ran
            elif not holders:
                passed.add(node.key)
            listed.add(node.key)
            # a block climbed through and taken since by another worker is still passed through:
            # the worker's blocks under it are listed, naming it as their parent
            stack.extend(c for c in node.iter_children() if c.holders & bit or c.key in climbed)
            if len(out) == step:
                yield out
                out = []
                if workers.find(worker_id) is not worker or worker.slot != slot:
                    return
        yield out

    def import_blocks(
        self, worker_id: str, blocks: Iterable[tuple[int, int | None, int]], unheld: Mapping[int, int | None] | None = None
    ) -> list[tuple[int, int | None, int]]:
        """Store exported blocks (parents first) for a registered worker, as a peer held them.

        ``unheld``: key -> parent key (None: a root) of the blocks no worker held on the peer
        that exported blocks hang under (every one the import has read so far); those a block
        is stored under are put back first, held by none, as the peer kept them. Returns the
        blocks whose parent is not in the index yet (held by a worker imported later): import
        them again once the others are in. The worker's event sequence is left alone, so its
        own publishers continue as usual.
        """
        shared = self._shared
        worker = shared.workers.get(worker_id)
        index, slot, now = shared.index, worker.slot, shared.clock.now()
        eviction = shared.policies.eviction
        deferred: list[tuple[int, int | None, int]] = []
        for key, parent, engine_hash in blocks:
            if parent is not None and parent not in index and not (unheld and self._put_back(parent, unheld)):
                deferred.append((key, parent, engine_hash))
                continue
            stored = index.store(slot, parent, (key,), now)
            eviction.on_stored(index, slot, stored, NO_ACCESS_INFO, now)
            if engine_hash and engine_hash != key:
                worker.engine_keys[engine_hash] = key
        return deferred

    def _put_back(self, key: int, unheld: Mapping[int, int | None]) -> bool:
        """Put the unheld blocks from ``key`` up to one in the index (or a root) back in it;
        False, changing nothing, while the chain does not reach one."""
        index = self._shared.index
        chain: list[int] = []
        up: int | None = key
        while up is not None and up not in index:
            if up not in unheld or len(chain) > len(unheld):  # not sent (yet), or a loop a peer sent
                return False
            chain.append(up)
            up = unheld[up]
        for k in reversed(chain):
            index.add_unheld(k, unheld[k])
        return True

    # ---- eviction hints -------------------------------------------------------------
    def evict_hint(self, req: EvictRequest, pinned_engine_hashes: Iterable[int] = ()) -> EvictAdvice:
        steps = self.evict_hint_steps(req, pinned_engine_hashes)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def evict_hint_steps(
        self, req: EvictRequest, pinned_engine_hashes: Iterable[int] = (), step: int | None = None
    ) -> Generator[None, None, EvictAdvice]:
        """``evict_hint`` with its work done in parts of about ``step`` entries, yielding between
        them (None: at once): the worker's first hint builds its engine-hash map
        (``EngineHashMaps.steps``); a policy with no order of its own for the worker (one named
        by a hint, not configured, sees no hooks) scores every leaf (``leaf_priority``); then the
        policy takes the blocks (``rank_steps``), up to ``limits.max_evict_blocks`` of them,
        which at 1,024 blocks held the loop 4-58 ms in one part (issue #16 item 1).

        The answer is advice about the worker as it was while it was ranked: events the host
        applies between parts may leave out blocks that became leaves meanwhile, but it never
        names a key the worker no longer holds when the answer is made, never a key twice, never
        a pinned key, and never a block before a held child of it (``still_evictable``).
        ``exhausted`` says the ranking ran out of evictable blocks (what events then took from
        the answer does not count). Raises NotFound if the worker goes away meanwhile; a worker
        cleared meanwhile (moved to another slot) is ranked again there."""
        shared = self._shared
        workers = shared.workers
        worker = workers.get(req.worker_id)
        if req.blocks <= 0:
            raise InvalidRequest("blocks to free must be > 0")
        policy = shared.policies.eviction_policy(req.policy)
        pinned = set(req.pinned_keys)
        for eh in pinned_engine_hashes:
            pinned.add(worker.engine_keys.get(eh, eh))
        pinned |= self._speculative.keys_on(worker.id)  # the engine has nothing to evict there yet
        frozen = frozenset(pinned)
        # never rank more than the worker holds or the configured cap (blocks=2**32-1 would
        # otherwise rank a whole worker on the loop); exhausted still means "nothing more to give"
        wanted = min(req.blocks, shared.settings.max_evict_blocks)
        if step is None:
            ctx = EvictionContext(shared.index, worker.slot, shared.clock.now(), worker.id)
            blocks = policy.rank(ctx, min(wanted, shared.index.count(worker.slot)), frozen)
            ranked = len(blocks)
        else:
            while True:
                yield from self._hashes.steps(workers.get(worker.id), step)
                worker = workers.get(req.worker_id)  # NotFound if it went away meanwhile
                ctx = EvictionContext(shared.index, worker.slot, shared.clock.now(), worker.id)
                leaf_priority = getattr(policy, "leaf_priority", None)
                priority = leaf_priority(ctx) if leaf_priority is not None else None
                runs: list[list[Any]] = []
                if priority is not None:
                    if not (yield from self._on_slot(_collect(score_leaves_steps(ctx, priority, frozen, step), runs),
                                                     req.worker_id, ctx.slot)):
                        continue  # cleared meanwhile (moved to another slot): rank it again there
                    ctx.scored = heapq.merge(*runs)
                count = min(wanted, shared.index.count(worker.slot))
                rank_steps = getattr(policy, "rank_steps", None)
                if rank_steps is None:
                    blocks = policy.rank(ctx, count, frozen)
                else:
                    ranking: list[list[Block]] = []
                    if not (yield from self._on_slot(_returned(rank_steps(ctx, count, frozen, step), ranking),
                                                     req.worker_id, ctx.slot)):
                        continue
                    blocks = ranking[0]
                ctx.scored = None
                yield from release_steps(runs, step)  # freeing 25k scored leaves at once took ~5 ms
                worker = workers.get(req.worker_id)
                if worker.slot == ctx.slot:
                    break
            ranked = len(blocks)
            blocks = still_evictable(ctx, blocks)
        keys = [b.key for b in blocks]
        for _ in self._hashes.steps(workers.get(worker.id)):  # what the host did not build in steps
            pass
        reverse = self._hashes.by_slot[worker.slot]
        return EvictAdvice(
            keys=keys,
            engine_hashes=[reverse.get(k, k) for k in keys],
            exhausted=ranked < wanted,
            policy=policy.name,
        )

    def _on_slot(self, steps: Iterator[None], worker_id: str, slot: int) -> Generator[None, None, bool]:
        """Run ``steps``, yielding after each part; False as soon as the worker is on another
        slot (cleared meanwhile), NotFound if it is gone: the rest would read a slot being emptied."""
        for _ in steps:
            yield
            if self._shared.workers.get(worker_id).slot != slot:
                return False
        return True

    def blocks_to_free(self, worker_id: str, tokens: int) -> int:
        """Blocks needed to free ``tokens`` tokens (rounded up)."""
        self._shared.workers.get(worker_id)
        return -(-tokens // self._shared.block_size)


def _list_unheld(node: Block, passed: set[int], into: list[Unheld]) -> None:
    """Append ``node`` and the unheld blocks above it not listed yet (all in ``passed``),
    parents first, and take them out of ``passed``."""
    chain = []
    up: Block | None = node
    while up is not None and up.key in passed:
        passed.discard(up.key)
        chain.append(up)
        up = up.parent
    into.extend((b.key, b.parent.key if b.parent is not None else None) for b in reversed(chain))


def _collect(parts: Iterator[list[Any]], into: list[list[Any]]) -> Iterator[None]:
    """``parts`` as bare steps, each part kept in ``into``."""
    for part in parts:
        into.append(part)
        yield


def _returned(steps: Generator[None, None, Any], into: list[Any]) -> Iterator[None]:
    """``steps`` as bare steps; what it returns is put in ``into``."""
    into.append((yield from steps))
