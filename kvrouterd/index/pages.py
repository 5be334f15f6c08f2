"""Engine pages of any size mapped onto the router's blocks.

The router keys prompts in blocks of ``block_size`` tokens (16 by default); engines cache in
pages of their own size: SGLang's default page is 1 token (one ``BlockStored`` hash per
token), vLLM may run 32- or 64-token blocks. Because the router hashes tokens itself, the
page size does not have to match: each stored chain's tokens are re-chunked into router
blocks, and every engine page remembers which router blocks its tokens are part of, so a
later removal of that page still applies.

One ``PageChains`` per worker whose engine pages differ from the router's blocks. For each
engine page it keeps a ``PageState``:

* ``anchor``: the router key of the last complete router block ending at or before the
  page's last token (None: the chain's root, nothing complete yet);
* ``tail`` / ``tail_pages``: the tokens after ``anchor`` up to the page's end (fewer than
  ``block_size``) and the engine pages they came from, so the page that completes the next
  router block can tell every contributing page about it;
* ``blocks``: the router blocks this page's tokens are part of.

Removing a page removes every router block it overlaps: the engine can no longer serve a
prefix through that page, so a router block containing any of its tokens is no longer fully
cached. The router may then under-count a hit by less than one block, never over-count.

Memory: one small tuple-backed object per engine page, so a 1-token-page engine costs about
``block_size`` entries per router block. That is the price of knowing exactly which removal
touches which block; docs/engine-events.md says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .keys import chain_keys, chain_keys_with_extras

__all__ = ["PageChains", "PageState", "StoredChunk"]


@dataclass(slots=True)
class PageState:
    anchor: int | None
    tail: bytes
    tail_pages: tuple[int, ...]
    seed: int
    blocks: list[int]
    #: extra-key hashes of the pages in the tail, folded into the block they complete
    tail_extra: int = 0


@dataclass(slots=True, frozen=True)
class StoredChunk:
    """Router blocks completed by a stored chain: hang ``keys`` under ``parent_key``."""

    parent_key: int | None
    keys: list[int]


class PageChains:
    """Engine page hash -> where its tokens sit among the router's blocks (one worker)."""

    __slots__ = ("_pages", "block_size")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pages: dict[int, PageState] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, engine_hash: int) -> bool:
        return engine_hash in self._pages

    def clear(self) -> None:
        self._pages.clear()

    def store(
        self,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_bytes: bytes,
        page_size: int,
        root_seed: int,
        parent_held: Callable[[int], bool],
        extra_hashes: Sequence[int] | None = None,
    ) -> StoredChunk | None:
        """Record a stored chain of engine pages; returns the router blocks it completes.

        ``token_bytes`` holds ``len(engine_hashes) * page_size`` tokens (little-endian
        uint32). ``parent_held(key)`` says whether the worker still holds a router block.
        ``extra_hashes`` (one per page, 0 = none) are folded into the first router block a
        page's tokens complete, as ``chain_keys_with_extras`` does for router-sized pages.
        Returns None when the parent page is unknown or its router block is gone (an
        orphan: nothing is recorded, as for a chain of router-sized blocks).
        """
        if parent_engine_hash is None:
            anchor, tail, tail_pages, seed, tail_extra = None, b"", (), root_seed, 0
        else:
            parent = self._pages.get(parent_engine_hash)
            if parent is None or (parent.anchor is not None and not parent_held(parent.anchor)):
                return None
            anchor, tail, tail_pages, seed = parent.anchor, parent.tail, parent.tail_pages, parent.seed
            tail_extra = parent.tail_extra
        step = self.block_size * 4
        page_bytes = page_size * 4
        first_parent = anchor
        completed: list[int] = []
        pages = self._pages
        for i, eh in enumerate(engine_hashes):
            data = tail + token_bytes[i * page_bytes : (i + 1) * page_bytes]
            whole = len(data) - len(data) % step
            extra = tail_extra ^ (extra_hashes[i] if extra_hashes else 0)
            start = seed if anchor is None else anchor
            if not whole:
                keys = []
            elif extra:
                keys = chain_keys_with_extras(data[:whole], self.block_size, start, (extra,))
            else:
                keys = chain_keys(data[:whole], self.block_size, start)
            if keys:
                for contributor in tail_pages:
                    state = pages.get(contributor)
                    if state is not None:
                        state.blocks.append(keys[0])  # the tail only reaches into the first new block
                completed.extend(keys)
                anchor = keys[-1]
                tail = data[whole:]
                tail_pages = (eh,) if tail else ()
                tail_extra = 0
            else:
                tail = data
                tail_pages = (*tail_pages, eh)
                tail_extra = extra
            pages[eh] = PageState(anchor, tail, tail_pages, seed, list(keys), tail_extra)
        return StoredChunk(first_parent, completed)

    def remove(self, engine_hash: int) -> list[int] | None:
        """Forget a page; the router blocks it overlapped (None: an unknown page)."""
        state = self._pages.pop(engine_hash, None)
        return None if state is None else state.blocks
