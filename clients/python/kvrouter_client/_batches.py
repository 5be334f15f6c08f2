"""Cutting recorded events into batches the router takes whole (its ``limits``).

kvrouterd reads and applies one event batch in one turn of its routing loop, so it bounds what
a batch may carry and refuses more with RESOURCE_EXHAUSTED: ``limits.max_event_batch_bytes``
(the serialized ``EventBatch``) and ``limits.max_batch_blocks`` (a stored event counts its
pages, a removed event its hashes, every event at least 8: its own cost). The publishers cut what they
buffer under both, so no engine has to know the limits:

* events are packed in order into batches, each under the event count, block and byte limits;
* a ``Removed`` event with more hashes than a batch takes becomes several, in order;
* a ``Stored`` chain longer than a batch takes becomes several chains, cut at page
  boundaries, each the next one's parent: part k's ``parent_engine_hash`` is the hash of part
  k-1's last page (with ``engine_hashes=None``, the kvrouterd key of that block, from
  ``keys.chain_keys``: the router takes a parent it holds under that key). The router's index
  then ends exactly as it would after the whole chain in one event.

Byte sizes are bounded from above (every varint counted at its longest), so a batch is never
over the limit, at the price of batches a little under it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ._types import Cleared, Event, Removed, Stored
from .keys import chain_keys, namespace_seed, tokens_to_bytes

__all__ = ["BatchLimits", "DEFAULT_MAX_BATCH_BLOCKS", "DEFAULT_MAX_EVENT_BATCH_BYTES", "check_limits",
           "check_stored_fits", "pack_batches"]

#: kvrouterd's defaults (``limits.max_event_batch_bytes``, ``limits.max_batch_blocks``)
DEFAULT_MAX_EVENT_BATCH_BYTES = 512 * 1024
DEFAULT_MAX_BATCH_BLOCKS = 4096
#: the least one event counts against max_batch_blocks (kvrouterd's ``convert.EVENT_BLOCKS``)
EVENT_BLOCKS = 8

#: the longest a tag plus a length (or a tag plus a uint64 varint) takes on the wire
_TAG_LEN = 1 + 5
_TAG_U64 = 1 + 10
_U64 = 10


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one batch may carry: events, blocks (``block_units``) and serialized bytes."""

    max_events: int
    max_blocks: int
    max_bytes: int

    def envelope(self, worker_id: str) -> int:
        """The most bytes an EventBatch takes besides its events (worker id, sequence, timestamp)."""
        return _TAG_LEN + len(worker_id.encode()) + _TAG_U64 + 1 + 8


def block_units(ev: Event, block_size: int) -> int:
    """An event's blocks as the router counts them against ``max_batch_blocks``."""
    if isinstance(ev, Stored):
        n = len(ev.token_ids) // block_size
    elif isinstance(ev, Removed):
        n = len(ev.engine_hashes)
    else:
        n = 0
    return max(n, EVENT_BLOCKS)


def _stored_fixed(ev: Stored) -> int:
    """Bytes of a serialized Stored event (its CacheEvent framing included) besides its pages."""
    return (2 * _TAG_LEN + _TAG_U64 + _TAG_LEN + 2 * _TAG_LEN  # event and stored framing, parent, block_size
            + len(ev.model.encode()) + len(ev.lora.encode()) + len(ev.cache_salt.encode())  # model, lora, salt
            + 3 * _TAG_LEN)  # the salt's, the hashes' and the tokens' framing


def page_bytes(block_size: int, hashes: bool) -> int:
    return 4 * block_size + (_U64 if hashes else 0)


def event_bytes(ev: Event, block_size: int) -> int:
    """The most bytes an event takes in a serialized EventBatch."""
    if isinstance(ev, Stored):
        pages = len(ev.token_ids) // block_size
        return _stored_fixed(ev) + pages * page_bytes(block_size, ev.engine_hashes is not None)
    if isinstance(ev, Removed):
        return 3 * _TAG_LEN + _U64 * len(ev.engine_hashes)
    return 2 * _TAG_LEN


def _split_stored(ev: Stored, block_size: int, room_blocks: int, room_bytes: int) -> list[Stored]:
    """``ev`` as consecutive chains of at most ``room_blocks`` pages and ``room_bytes`` bytes each."""
    per_page = page_bytes(block_size, ev.engine_hashes is not None)
    pages = len(ev.token_ids) // block_size
    step = min(room_blocks, (room_bytes - _stored_fixed(ev)) // per_page)
    if step >= pages:
        return [ev]
    keys: list[int] | None = None
    if ev.engine_hashes is None:
        # the router keys these blocks itself (kvrouterd keys are the engine's hashes): a part's
        # parent is the key of the block before it, chained from the chain's parent or its namespace
        seed = (ev.parent_engine_hash if ev.parent_engine_hash is not None
                else namespace_seed(ev.model, ev.lora, ev.cache_salt))
        keys = chain_keys(tokens_to_bytes(ev.token_ids), block_size, seed)
    parts: list[Stored] = []
    parent = ev.parent_engine_hash
    for start in range(0, pages, step):
        end = min(start + step, pages)
        hashes = None if ev.engine_hashes is None else ev.engine_hashes[start:end]
        parts.append(Stored(ev.token_ids[start * block_size : end * block_size], hashes, parent, ev.model, ev.lora,
                            ev.cache_salt))
        parent = keys[end - 1] if keys is not None else ev.engine_hashes[end - 1]  # type: ignore[index]
    return parts


def _split_removed(ev: Removed, room_blocks: int, room_bytes: int) -> list[Removed]:
    step = min(room_blocks, (room_bytes - 3 * _TAG_LEN) // _U64)
    hashes = ev.engine_hashes
    if step >= len(hashes):
        return [ev]
    return [Removed(hashes[i : i + step]) for i in range(0, len(hashes), step)]


def _parts(ev: Event, block_size: int, limits: BatchLimits, room_bytes: int) -> Sequence[Event]:
    if isinstance(ev, Stored):
        return _split_stored(ev, block_size, limits.max_blocks, room_bytes)
    if isinstance(ev, Removed):
        return _split_removed(ev, limits.max_blocks, room_bytes)
    assert isinstance(ev, Cleared)
    return (ev,)


def check_limits(limits: BatchLimits, block_size: int, worker_id: str) -> None:
    """ValueError when a batch of one page (or one hash) would not fit ``limits``."""
    if limits.max_events <= 0 or limits.max_blocks < EVENT_BLOCKS:
        raise ValueError(f"max_batch_events must be > 0 and max_batch_blocks >= {EVENT_BLOCKS} (what one event counts)")
    room = limits.max_bytes - limits.envelope(worker_id)
    # the largest one-page Stored: model and lora are the caller's (checked as they come)
    if room < _stored_fixed(Stored((), (), None)) + page_bytes(block_size, True):
        raise ValueError(f"max_event_batch_bytes={limits.max_bytes} cannot hold one page of {block_size} tokens")


def check_stored_fits(ev: Stored, block_size: int, limits: BatchLimits, worker_id: str) -> None:
    """ValueError for a Stored event whose model, lora and salt alone leave no room for a page."""
    if _stored_fixed(ev) + page_bytes(block_size, True) > limits.max_bytes - limits.envelope(worker_id):
        named = len(ev.model) + len(ev.lora) + len(ev.cache_salt)
        raise ValueError(f"model, lora and cache_salt of {named} characters leave no room for a "
                         f"page within max_event_batch_bytes={limits.max_bytes}")


def pack_batches(events: Sequence[Event], block_size: int, limits: BatchLimits, worker_id: str) -> Iterator[list[Event]]:
    """``events`` in order, in batches under ``limits`` (events cut as the module docstring says).
    ValueError for a Stored event ``check_stored_fits`` refuses (the publishers check at record time)."""
    room_bytes = limits.max_bytes - limits.envelope(worker_id)
    batch: list[Event] = []
    blocks = size = 0
    for ev in events:
        if isinstance(ev, Stored):
            check_stored_fits(ev, block_size, limits, worker_id)
        for part in _parts(ev, block_size, limits, room_bytes):
            units, nbytes = block_units(part, block_size), event_bytes(part, block_size)
            if batch and (len(batch) >= limits.max_events or blocks + units > limits.max_blocks
                          or size + nbytes > room_bytes):
                yield batch
                batch, blocks, size = [], 0, 0
            batch.append(part)
            blocks += units
            size += nbytes
    if batch:
        yield batch
