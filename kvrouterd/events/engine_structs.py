"""The typed fast path of event decoding: msgspec Structs for the layouts vLLM and SGLang declare.

Every field but the hashes has a default, so older engines' shorter events fit; msgspec
ignores unknown map keys and trailing positional fields, so newer engines' events fit too.
Field types are as loose as the generic checks (``engine_event``): those checks run on both
paths. What the Structs do not describe, ``engine_format`` reads with the generic decoder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..index import native
from ..protocols import CacheEvent, Cleared, Removed
from .engine_event import GPU_MEDIUM, TierEvent, group_index, normalize_hash, stored_from

__all__ = ["ENVELOPE", "ONE_FORM_BATCHES", "from_typed", "kind_of_typed", "ready", "typed_event"]

_Hash = int | bytes


#: a BlockStored's token ids stay undecoded msgpack in the Structs: msgspec would make an int
#: object per token (~90 ns a token with the packing), and a step that prefills a 1M-token
#: prompt stores all of them in one event, decoded in one turn of the routing loop (issue #16)
_NO_TOKENS = msgspec.Raw()


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    ts: float | None
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _ArrayStored(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: msgspec.Raw = _NO_TOKENS  # read by _typed_tokens
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    medium: str | None = None


class _MapStored(msgspec.Struct, gc=False, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: msgspec.Raw = _NO_TOKENS  # read by _typed_tokens
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    cache_salt: str | None = None


class _MapRemoved(msgspec.Struct, gc=False, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, gc=False, tag="AllBlocksCleared"):
    medium: str | None = None


ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
# msgspec cannot mix positional and map Structs in one union: the event's first byte picks
_ARRAY_EVENT = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
_MAP_EVENT = msgspec.msgpack.Decoder(_MapStored | _MapRemoved | _MapCleared)
_STORED_TYPES = (_ArrayStored, _MapStored)
_REMOVED_TYPES = (_ArrayRemoved, _MapRemoved)


# A batch whose events are all of one form is decoded in one call, Structs included: reading the
# envelope with its events left raw, then each event, walked every byte twice (~10 ns a token
# each time on the test machine, the biggest part of a long prompt's decode once the token ids
# were read natively). Anything that one call does not describe takes the two steps
# (``engine_format.decode_payload``).
class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float | None
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float | None
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


ONE_FORM_BATCHES = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch))


def typed_event(raw: msgspec.Raw) -> Any:
    """The event's Struct, ready for ``from_typed``, or None when the Structs do not describe it
    (the generic path then decodes it, and says what is wrong if anything is)."""
    first = memoryview(raw)[0]
    # msgpack array: fixarray 0x90-0x9f, array16 0xdc, array32 0xdd; map: 0x80-0x8f, 0xde, 0xdf
    decoder = _ARRAY_EVENT if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD) else _MAP_EVENT
    try:
        ev = decoder.decode(raw)
    except msgspec.DecodeError:  # ValidationError included
        return None
    return ev if ready(ev) else None


def ready(ev: Any) -> bool:
    """Ready a decoded event Struct for ``from_typed`` (a store's token ids read, ``_typed_tokens``),
    or False where only the generic decoder reads it as it must be read: extra keys are hashed from
    their msgpack re-encoding, which only the generic objects reproduce exactly (msgspec decodes
    extension types differently), and token ids ``list[int]`` does not describe."""
    if isinstance(ev, _STORED_TYPES):
        if _has_extra_keys(ev.extra_keys):
            return False
        try:
            ev.token_ids = _typed_tokens(ev.token_ids)
        except msgspec.DecodeError:  # ValidationError included
            return False
    return True


_TOKEN_LIST = msgspec.msgpack.Decoder(list[int] | None)
_native_uint32s = getattr(native.module, "msgpack_uint32s", None)


def _typed_tokens(raw: msgspec.Raw) -> bytes | list[int] | None:
    """A typed BlockStored's token ids: little-endian uint32 bytes read natively from the msgpack
    array, else what ``token_ids: list[int] | None`` decodes to (raising msgspec's error for what
    that type does not describe), so every event keeps its path and its checks."""
    if not raw:
        return None  # the field is absent
    if _native_uint32s is not None:
        packed = _native_uint32s(raw)
        if packed is not None:
            return packed  # type: ignore[no-any-return]
    return _TOKEN_LIST.decode(raw)  # type: ignore[no-any-return]


def _has_extra_keys(extras: list[Any] | None) -> bool:
    """Whether a block of a typed BlockStored has extra keys. vLLM sends ``extra_keys`` with one
    entry per block, None for a block without any (plain text): such a list needs no generic
    decode, and taking one for it would cost every vLLM store an int object per token."""
    return extras is not None and extras.count(None) != len(extras)


def _typed_hashes(values: list[int | bytes]) -> tuple[int, ...]:
    # msgspec checked every int is within int64..uint64: only negatives (SGLang) need masking.
    # min() finds both in C: it raises TypeError where bytes and ints mix, and comparing a
    # bytes minimum with 0 does too
    try:
        if min(values) >= 0:
            return tuple(values)
    except (TypeError, ValueError):  # ValueError: no hashes
        pass
    return tuple(normalize_hash(h) for h in values)


def from_typed(ev: Any, model: str, lora_ids: Mapping[int, str]) -> CacheEvent | TierEvent:
    """``decode_event`` for an event the typed decoder read: the same checks and results."""
    medium = ev.medium
    gpu = medium is None or medium.upper() == GPU_MEDIUM
    if isinstance(ev, _STORED_TYPES):
        hashes = _typed_hashes(ev.block_hashes)
        if not gpu:
            return TierEvent(medium.upper(), "stored", hashes)
        return stored_from(
            hashes, ev.token_ids, ev.parent_block_hash, ev.block_size, ev.lora_name, ev.lora_id, ev.group_idx,
            ev.kv_cache_spec_kind, getattr(ev, "cache_salt", None), ev.extra_keys, model, lora_ids,
        )
    if isinstance(ev, _REMOVED_TYPES):
        hashes = _typed_hashes(ev.block_hashes)
        if not gpu:
            return TierEvent(medium.upper(), "removed", hashes)
        return Removed(hashes, group_index(ev.group_idx))
    return Cleared() if gpu else TierEvent(medium.upper(), "cleared")


def kind_of_typed(ev: Any) -> str:
    if isinstance(ev, _STORED_TYPES):
        return "BlockStored"
    return "BlockRemoved" if isinstance(ev, _REMOVED_TYPES) else "AllBlocksCleared"
