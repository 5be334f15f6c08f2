"""Cut one long engine batch into parts the router applies one loop turn each (issue #16 item 1).

vLLM and SGLang publish one batch per scheduler step. A step that prefills a long prompt
without chunked prefill stores the whole prompt at once: a 1M-token prompt is one
``BlockStored`` of 62.5k blocks, and ``Router.apply`` takes every block of a batch inside one
call on the event loop. ``split_events`` cuts such a batch into consecutive parts of at most
``max_blocks`` blocks, which the ZMQ source hands to the router as consecutive batches with the
loop free in between, so that applying the parts leaves the router where the whole batch would:

* events keep their order; an event that fits stays whole;
* a ``Stored`` chain is cut between engine pages: piece k names the engine hash of piece k-1's
  last page as its parent, its token ids, engine hashes and extra-key hashes are the slices of
  its pages, and every other field (block size, model, lora, salt, group and its kind) is the
  event's. The router finds piece k's parent where piece k-1 put it (the engine-hash map, or
  ``PageChains`` for pages that are not the router's blocks), so the keys chain on as in one
  call, and a hybrid group's presence (``GroupPresence``) is recorded for the same hashes.
  Pages that are not the router's blocks are cut only where the tokens before the cut fill
  whole router blocks (``block_size``), so a chain the router drops as an orphan counts the
  same ``orphan_blocks`` in pieces as whole;
* a ``Removed`` is cut anywhere: its hashes are dropped in order either way. A group the router
  refuses (out of range: counted once, the removal applies to every group) stays on the first
  piece only, the others name no group, which the router reads the same way uncounted;
* a ``Stored`` the router would refuse whole (page sizes that do not add up, a group out of
  range, no engine hashes or no page size to cut by) is never cut: refused whole, counted once.

What differs from one call is only what counts calls: ``batches_applied`` counts the parts,
and the stored-events-rejected streak (``REJECTING_AFTER``) sees parts.

The size of a part, in blocks (``event_blocks``): a stored chain counts its pages or its router
blocks, whichever is more (a 1-token page costs about what a block does to apply, a 64-token
page about four), a removal its hashes, a clear 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from ..protocols import CacheEvent, Removed, Stored
from ..router import MAX_KV_GROUPS

__all__ = ["DEFAULT_BLOCK_SIZE", "MAX_PART_BLOCKS", "batch_blocks", "event_blocks", "split_events"]

#: Blocks one part of an engine batch may carry: applying 4,096 stored blocks of a long chain
#: takes ~0.6-1 ms natively and ~5.5 ms in pure Python on the 2-core VM, more in the part where
#: a table doubles (docs/operations/limits.md, "Huge engine batches (ZMQ)"). The daemon and the bridge
#: pass ``limits.max_batch_blocks`` (the same default), the limit of a PublishEvents batch
MAX_PART_BLOCKS = 4096
#: the router's block size when a host does not say (the daemon passes its own)
DEFAULT_BLOCK_SIZE = 16


def event_blocks(ev: CacheEvent, block_size: int) -> int:
    """How much of a part ``ev`` takes (the module docstring), at least 1."""
    if type(ev) is Stored:
        tokens = len(ev.token_ids) // 4 if type(ev.token_ids) is bytes else len(ev.token_ids)
        return max(1, len(ev.engine_hashes or ()), tokens // block_size)
    if type(ev) is Removed:
        return max(1, len(ev.engine_hashes))
    return 1


def batch_blocks(events: Sequence[CacheEvent], block_size: int) -> int:
    return sum(event_blocks(ev, block_size) for ev in events)


def split_events(events: Sequence[CacheEvent], max_blocks: int, block_size: int) -> Iterator[tuple[CacheEvent, ...]]:
    """``events`` as consecutive parts of at most ``max_blocks`` blocks each (an event that
    cannot be cut, or one unit of a cut that is larger, makes a part of its own). Lazy: each
    part's slices are made when it is asked for, so cutting never holds the loop either."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    part: list[CacheEvent] = []
    used = 0
    for ev in events:
        blocks = event_blocks(ev, block_size)
        if used + blocks <= max_blocks:
            part.append(ev)
            used += blocks
            continue
        cut = _cuttable(ev, block_size)
        if cut is None:
            if part:
                yield tuple(part)
            part, used = [ev], blocks
            continue
        unit, unit_blocks, pages = cut
        start = 0
        while start < pages:
            take = max(0, max_blocks - used) // unit_blocks * unit
            if take == 0:
                if part:
                    yield tuple(part)
                    part, used = [], 0
                    continue
                take = unit  # one unit is more than a part: it goes alone
            end = min(pages, start + take)
            piece = _piece(ev, start, end, block_size)
            part.append(piece)
            used += event_blocks(piece, block_size)
            start = end
            if start < pages:  # this part is full
                yield tuple(part)
                part, used = [], 0
    if part:
        yield tuple(part)


def _cuttable(ev: CacheEvent, block_size: int) -> tuple[int, int, int] | None:
    """(pages per unit, blocks per unit, pages) of an event that may be cut between units,
    or None for one that may not."""
    if type(ev) is Removed:
        return (1, 1, len(ev.engine_hashes)) if len(ev.engine_hashes) > 1 else None
    if type(ev) is not Stored:
        return None
    hashes, page = ev.engine_hashes, ev.block_size
    if hashes is None or len(hashes) < 2 or page <= 0:
        return None
    tokens = len(ev.token_ids) // 4 if type(ev.token_ids) is bytes else len(ev.token_ids)
    if tokens != len(hashes) * page or (type(ev.token_ids) is bytes and len(ev.token_ids) % 4):
        return None
    if ev.group is not None and not 0 <= ev.group < MAX_KV_GROUPS:
        return None
    if ev.extra_hashes is not None and len(ev.extra_hashes) != len(hashes):
        return None
    # cut where the tokens before the cut fill whole router blocks: every lcm(page, block) tokens
    unit = block_size // math.gcd(page, block_size)
    return unit, max(unit, unit * page // block_size), len(hashes)


def _piece(ev: CacheEvent, start: int, end: int, block_size: int) -> CacheEvent:
    if type(ev) is Removed:
        group = ev.group
        if start and group is not None and not 0 <= group < MAX_KV_GROUPS:
            group = None  # counted on the first piece; every group, as the router reads it
        return Removed(ev.engine_hashes[start:end], group)
    assert type(ev) is Stored and ev.engine_hashes is not None
    width = ev.block_size * (4 if type(ev.token_ids) is bytes else 1)
    extras = ev.extra_hashes
    if extras is not None:
        extras = extras[start:end]
        if not any(extras):
            extras = None  # as engine_event says "no extras" (the keys are the same)
    return Stored(
        token_ids=ev.token_ids[start * width : end * width],
        engine_hashes=ev.engine_hashes[start:end],
        parent_engine_hash=ev.parent_engine_hash if start == 0 else ev.engine_hashes[start - 1],
        block_size=ev.block_size,
        model=ev.model,
        lora=ev.lora,
        group=ev.group,
        group_kind=ev.group_kind,
        salt=ev.salt,
        extra_hashes=extras,
    )
