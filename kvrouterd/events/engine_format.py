"""Decode vLLM / SGLang KV-event payloads (msgpack) into the core vocabulary.

Pure functions, no I/O: ``zmq_source`` feeds them the payload frame of each ZMQ message.

Wire format (checked against vLLM's ``vllm/distributed/kv_events.py`` and SGLang's copy):

* batch: ``[ts, [event, ...], dp_rank]`` (``dp_rank`` absent in older engines); a map
  ``{"ts", "events", "data_parallel_rank"}`` is accepted too.
* event, vLLM >= 0.24 and SGLang: a map with ``"type"`` and named fields; vLLM <= 0.23: a
  positional array, type name first (msgspec ``array_like=True, tag=True``):

  - ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys, group_idx, ... (positional order as listed)
  - ``BlockRemoved``: block_hashes, medium
  - ``AllBlocksCleared``: (no fields; a ``medium`` is honoured when present)

Leniency, so a new engine version never takes the router down: every field except the type
and ``block_hashes`` is optional, unknown fields and trailing positional fields are ignored,
and unknown event types are skipped and counted (``DecodedBatch.skipped``). An event that
does not fit is counted by reason (``DecodedBatch.rejected``: ``malformed_stored``,
``malformed_removed``, ...) and the rest of its batch is still decoded: vLLM publishes one
batch per scheduler step, so a store we cannot read must never cost the removals beside it.
An unreadable event that may have been a removal or a clear sets ``lost_removal`` (the
subscriber then resyncs the worker). Only a batch whose envelope does not fit raises
``MalformedPayload``.

Decoding is typed, as vLLM itself decodes (``msgspec`` Structs per event form, below): the
batch envelope is read with its events left as raw msgpack, then each event is decoded into
its Struct. Anything the Structs do not describe (a map envelope, bytes map keys, an unknown
event type, a field of an unexpected type) falls back, for that batch envelope or that one
event only, to a generic msgpack decode with the checks below, so leniency and the reasons
events are counted under are the same either way; the typed path is only faster.

Block hashes arrive as unsigned 64-bit ints (vLLM default), signed int64 (SGLang) or raw
bytes (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). They are normalised to one
unsigned 64-bit int so that a store and its later removal always agree:

* int: ``h & (2**64 - 1)`` (two's complement for negatives: ``-1 -> 2**64 - 1``);
* bytes: ``int.from_bytes(b, "big") & (2**64 - 1)``, i.e. the last 8 bytes big-endian, the
  same value vLLM itself publishes when it converts its hashes to ints.

Media: events whose ``medium`` is absent or ``"GPU"`` (any case) describe the GPU cache and
become ``Stored`` / ``Removed`` / ``Cleared``. Other tiers (CPU, disk offload) become
``TierEvent`` s, which the subscriber tracks apart or drops by config; they never reach the
GPU view. Our keys are recomputed from ``token_ids`` by the router; the engine hashes are
only kept to apply removals. vLLM's per-block ``extra_keys`` (multimodal content hashes,
prompt-embedding hashes) are hashed and folded into that block's key, so two prompts that differ
only in image content never share a key; a cache salt (SGLang-style ``cache_salt``, or the plain
string vLLM puts in the first block's extras) salts the chain like ``model`` and ``lora``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import msgspec
import xxhash

from ..errors import InvalidRequest
from ..index import native
from ..index.keys import tokens_to_bytes
from ..protocols import CacheEvent, Cleared, Removed, Stored

__all__ = [
    "GPU_MEDIUM",
    "DecodedBatch",
    "MalformedPayload",
    "TierEvent",
    "UnmappedLora",
    "decode_event",
    "decode_payload",
    "normalize_hash",
    "peek_timestamp",
]

log = logging.getLogger("kvrouterd.events.engine")

GPU_MEDIUM = "GPU"
_MASK64 = (1 << 64) - 1
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)
_NO_LORA_IDS: Mapping[int, str] = {}
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_CLEARED_FIELDS = ("medium",)


class MalformedPayload(InvalidRequest):
    """An engine payload that cannot be decoded; the batch is counted and skipped."""

    #: the label it is counted under, when more precise than malformed_<event type>
    reason: str | None = None


class UnmappedLora(MalformedPayload):
    """A ``lora_id``-only store (vLLM 0.11) whose id ``events.lora_ids`` does not name."""

    reason = "unknown_lora_id"


@dataclass(slots=True, frozen=True)
class TierEvent:
    """An event for a non-GPU tier (CPU / disk offload), kept out of the GPU view."""

    medium: str
    kind: Literal["stored", "removed", "cleared"]
    engine_hashes: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class DecodedBatch:
    """One engine batch: GPU events for the router, other tiers apart, and what was skipped."""

    timestamp: float
    dp_rank: int | None
    events: tuple[CacheEvent, ...]
    tier_events: tuple[TierEvent, ...] = ()
    #: events of a type this version does not know (a newer engine); skipped on purpose
    skipped: int = 0
    #: events that could not be decoded, by reason; the rest of the batch still applies
    rejected: Mapping[str, int] = field(default_factory=dict)
    #: an undecodable event may have been a removal or a clear: the view may now be stale
    lost_removal: bool = False


def normalize_hash(value: object) -> int:
    """An engine block hash as an unsigned 64-bit int (see the module docstring)."""
    if isinstance(value, bool):  # bool is an int subclass; a hash is never a bool
        raise MalformedPayload(f"block hash must be an int or bytes, got {value!r}")
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise MalformedPayload("block hash is empty bytes")
        return int.from_bytes(raw, "big") & _MASK64
    raise MalformedPayload(f"block hash must be an int or bytes, got {type(value).__name__}")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise MalformedPayload(f"block_hashes must be a list, got {type(value).__name__}")
    return tuple(normalize_hash(h) for h in value)


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, Mapping[str, Any]]:
    """(type name, named fields) from either the map or the positional-array encoding."""
    if isinstance(raw, Mapping):
        # msgpack gives str keys; only a publisher that packs keys as bytes needs converting
        fields = raw if "type" in raw else {_text(k): v for k, v in raw.items()}
        kind = fields.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        kind = raw[0]
        fields = dict(zip(names, raw[1:]))
    else:
        raise MalformedPayload(f"event must be a map or a non-empty array, got {type(raw).__name__}")
    if not isinstance(kind, (str, bytes)) or not kind:
        raise MalformedPayload(f"event has no type name: {kind!r}")
    return _text(kind), fields


def _is_gpu(medium: object) -> bool:
    if medium is not None and not isinstance(medium, (str, bytes)):
        raise MalformedPayload(f"medium must be text, got {type(medium).__name__}")
    return medium is None or _text(medium).upper() == GPU_MEDIUM


def decode_event(raw: Any, model: str = "", lora_ids: Mapping[int, str] = _NO_LORA_IDS) -> CacheEvent | TierEvent | None:
    """One event; None for an unknown event type. ``model`` salts stored keys (engines do not
    say); ``lora_ids`` names the adapters of events that carry only a ``lora_id``."""
    if isinstance(raw, Mapping):
        kind = _text(raw.get("type", raw.get(b"type")))
    elif isinstance(raw, (list, tuple)) and raw:
        kind = _text(raw[0])
    else:
        raise MalformedPayload(f"event must be a map or a non-empty array, got {type(raw).__name__}")
    if kind == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        if "block_hashes" not in f:
            raise MalformedPayload("BlockStored without block_hashes")
        hashes = _hashes(f["block_hashes"])
        medium = f.get("medium")
        if not _is_gpu(medium):
            return TierEvent(_text(medium).upper(), "stored", hashes)
        return _stored(f, hashes, model, lora_ids)
    if kind == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        if "block_hashes" not in f:
            raise MalformedPayload("BlockRemoved without block_hashes")
        hashes = _hashes(f["block_hashes"])
        medium = f.get("medium")
        if not _is_gpu(medium):
            return TierEvent(_text(medium).upper(), "removed", hashes)
        return Removed(hashes, _group(f.get("group_idx")))
    if kind == "AllBlocksCleared":
        _, f = _fields(raw, _CLEARED_FIELDS)
        medium = f.get("medium")
        if not _is_gpu(medium):
            return TierEvent(_text(medium).upper(), "cleared")
        return Cleared()
    if not kind:
        raise MalformedPayload("event has no type name")
    return None


def _stored(f: Mapping[str, Any], hashes: tuple[int, ...], model: str, lora_ids: Mapping[int, str]) -> Stored:
    tokens = f.get("token_ids")
    return _stored_from(
        # token bytes are the typed path's reading of an int array; msgpack bin is not token ids
        hashes, None if isinstance(tokens, (bytes, bytearray)) else tokens, f.get("parent_block_hash"), f.get("block_size"), f.get("lora_name"),
        f.get("lora_id"), f.get("group_idx"), f.get("kv_cache_spec_kind"), f.get("cache_salt"), f.get("extra_keys"),
        model, lora_ids,
    )


def _stored_from(
    hashes: tuple[int, ...], tokens: Any, parent: Any, block_size: Any, lora_name: Any, lora_id: Any, group: Any,
    kind: Any, cache_salt: Any, extras: Any, model: str, lora_ids: Mapping[int, str],
) -> Stored:
    """A GPU ``BlockStored``'s fields, from either decoder, checked and turned into ``Stored``."""
    if not isinstance(tokens, (list, tuple, bytes)) or not tokens:
        # without tokens we cannot compute our keys; the router would reject it anyway
        raise MalformedPayload("BlockStored without token_ids")
    if type(tokens) is bytes:
        token_bytes = tokens  # the typed path's, read natively (_typed_tokens)
    else:
        try:
            token_bytes = tokens_to_bytes(tokens)  # array("I") checks each id is an int in range, in C
        except (TypeError, OverflowError):
            raise MalformedPayload("BlockStored token_ids must be integers in [0, 2**32)") from None
    block_size = block_size or 0
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise MalformedPayload(f"BlockStored block_size must be a non-negative int, got {block_size!r}")
    lora = _text(lora_name)
    if not lora and lora_id is not None:
        # vLLM 0.11 sends only the adapter's number; requests name the adapter, so the keys
        # must be salted with the name (events.lora_ids), never with the string "7"
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id not in lora_ids:
            raise UnmappedLora(f"BlockStored lora_id {lora_id!r} is not in events.lora_ids")
        lora = lora_ids[lora_id]
    salt, extra_hashes = _salt_and_extras(_text(cache_salt), extras, len(hashes), lora, parent is None)
    return Stored(
        token_ids=token_bytes,
        engine_hashes=hashes,
        parent_engine_hash=None if parent is None else normalize_hash(parent),
        block_size=block_size,
        model=model,
        lora=lora,
        group=_group(group),
        group_kind=None if kind is None else _text(kind),
        salt=salt,
        extra_hashes=extra_hashes,
    )


def _salt_and_extras(salt: str, extras: Any, blocks: int, lora: str, from_root: bool) -> tuple[str, tuple[int, ...] | None]:
    """The chain's cache salt and one extra-key hash per block.

    SGLang-style events name the salt (``cache_salt``). vLLM puts ``request.cache_salt`` in
    the extras of the block that starts at token 0, as the only plain string there besides
    the LoRA name (multimodal extras are ``(identifier, offset)`` pairs, prompt embeddings
    bytes), so a chain stored from the root takes its first block's strings as the salt:
    a Route carrying the same ``cache_salt`` then matches it."""
    if from_root and not salt and isinstance(extras, (list, tuple)) and extras:
        first = extras[0]
        if isinstance(first, (list, tuple)):
            strings = [e for e in first if isinstance(e, str) and e != lora]
            if strings:
                salt = "\x00".join(strings)
                extras = [[e for e in first if not (isinstance(e, str) and e != lora)], *extras[1:]]
    return salt, _extra_hashes(extras, blocks, lora)


def _extra_hashes(value: object, blocks: int, lora: str) -> tuple[int, ...] | None:
    """One hash per block of vLLM's ``extra_keys`` (a tuple per block, or None). vLLM puts
    the LoRA adapter's name in every block's extras; the router already salts the whole chain
    with it (so a Route naming the adapter matches), so it is left out here."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != blocks:
        raise MalformedPayload(f"extra_keys must be a list with one entry per block ({blocks})")
    if value.count(None) == blocks:
        return None  # vLLM's plain-text blocks: counted in C, not hashed a block at a time
    out = []
    for entry in value:
        if isinstance(entry, (list, tuple)) and lora:
            entry = [e for e in entry if e != lora]
        if entry is None or (isinstance(entry, (list, tuple)) and not entry):
            out.append(0)
        elif isinstance(entry, (list, tuple)):
            # the entry's own msgpack bytes name it: the same extras always hash the same
            out.append(xxhash.xxh3_64_intdigest(msgpack.packb(entry, use_bin_type=True)) or 1)
        else:
            raise MalformedPayload(f"extra_keys entries must be lists or null, got {type(entry).__name__}")
    return tuple(out) if any(out) else None


def _group(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedPayload(f"group_idx must be a non-negative int, got {value!r}")
    return value


# ---- the typed decoder (msgspec Structs, the layouts vLLM and SGLang declare) --------------
# Every field but the hashes has a default, so older engines' shorter events fit; msgspec
# ignores unknown map keys and trailing positional fields, so newer engines' events fit too.
# Field types are as loose as the generic checks below: those checks run on both paths.
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


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
# msgspec cannot mix positional and map Structs in one union: the event's first byte picks
_ARRAY_EVENT = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
_MAP_EVENT = msgspec.msgpack.Decoder(_MapStored | _MapRemoved | _MapCleared)
_STORED_TYPES = (_ArrayStored, _MapStored)
_REMOVED_TYPES = (_ArrayRemoved, _MapRemoved)


# A batch whose events are all of one form is decoded in one call, Structs included: reading the
# envelope with its events left raw, then each event, walked every byte twice (~10 ns a token
# each time on the test machine, the biggest part of a long prompt's decode once the token ids
# were read natively). Anything that one call does not describe takes the two steps below.
class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float | None
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float | None
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_ONE_FORM_BATCHES = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch))


def _typed_event(raw: msgspec.Raw) -> Any:
    """The event's Struct, ready for ``_from_typed``, or None when the Structs do not describe it
    (the generic path then decodes it, and says what is wrong if anything is)."""
    first = memoryview(raw)[0]
    # msgpack array: fixarray 0x90-0x9f, array16 0xdc, array32 0xdd; map: 0x80-0x8f, 0xde, 0xdf
    decoder = _ARRAY_EVENT if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD) else _MAP_EVENT
    try:
        ev = decoder.decode(raw)
    except msgspec.DecodeError:  # ValidationError included
        return None
    return ev if _ready(ev) else None


def _ready(ev: Any) -> bool:
    """Ready a decoded event Struct for ``_from_typed`` (a store's token ids read, ``_typed_tokens``),
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


def _from_typed(ev: Any, model: str, lora_ids: Mapping[int, str]) -> CacheEvent | TierEvent:
    """``decode_event`` for an event the typed decoder read: the same checks and results."""
    medium = ev.medium
    gpu = medium is None or medium.upper() == GPU_MEDIUM
    if isinstance(ev, _STORED_TYPES):
        hashes = _typed_hashes(ev.block_hashes)
        if not gpu:
            return TierEvent(medium.upper(), "stored", hashes)
        return _stored_from(
            hashes, ev.token_ids, ev.parent_block_hash, ev.block_size, ev.lora_name, ev.lora_id, ev.group_idx,
            ev.kv_cache_spec_kind, getattr(ev, "cache_salt", None), ev.extra_keys, model, lora_ids,
        )
    if isinstance(ev, _REMOVED_TYPES):
        hashes = _typed_hashes(ev.block_hashes)
        if not gpu:
            return TierEvent(medium.upper(), "removed", hashes)
        return Removed(hashes, _group(ev.group_idx))
    return Cleared() if gpu else TierEvent(medium.upper(), "cleared")


def _kind_of_typed(ev: Any) -> str:
    if isinstance(ev, _STORED_TYPES):
        return "BlockStored"
    return "BlockRemoved" if isinstance(ev, _REMOVED_TYPES) else "AllBlocksCleared"


def decode_payload(payload: bytes, model: str = "", lora_ids: Mapping[int, str] = _NO_LORA_IDS) -> DecodedBatch:
    """Decode one msgpack batch payload. Raises MalformedPayload; never anything else."""
    decoded = _decode_one_form(payload, model, lora_ids)
    if decoded is not None:
        return decoded
    try:
        envelope = _ENVELOPE.decode(payload)
    except msgspec.DecodeError:
        # a map envelope, or not a batch at all: the generic path decides (and says what is wrong)
        return _decode_generic(payload, model, lora_ids)
    batch = _Collector()
    for i, raw in enumerate(envelope.events):
        typed = _typed_event(raw)
        if typed is None:
            try:
                generic = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            except Exception as exc:  # e.g. text that is not UTF-8: this event only
                batch.reject(i, "", MalformedPayload(f"event is not readable msgpack: {exc}"))
                continue
            try:
                batch.add(decode_event(generic, model, lora_ids))
            except (MalformedPayload, TypeError, ValueError, UnicodeError) as exc:
                batch.reject(i, _event_kind(generic), exc)
            continue
        batch.add_typed(i, typed, model, lora_ids)
    return batch.result(envelope.ts, envelope.data_parallel_rank)


def _decode_one_form(payload: bytes, model: str, lora_ids: Mapping[int, str]) -> DecodedBatch | None:
    """``decode_payload`` for a batch of map events only (vLLM >= 0.24, SGLang) or positional
    ones only, every event a Struct and none that needs the generic decoder (extra keys, token
    ids that are not uint32s); None for anything else, which the event-by-event path reads
    (where the same events give the same results: one event's Struct is the same either way)."""
    for decoder in _ONE_FORM_BATCHES:
        try:
            envelope = decoder.decode(payload)
        except msgspec.DecodeError:  # ValidationError included
            continue
        if not all(_ready(ev) for ev in envelope.events):
            return None
        batch = _Collector()
        for i, ev in enumerate(envelope.events):
            batch.add_typed(i, ev, model, lora_ids)
        return batch.result(envelope.ts, envelope.data_parallel_rank)
    return None


class _Collector:
    """One batch's decoded events, as ``decode_payload`` returns them."""

    __slots__ = ("gpu", "tiers", "skipped", "rejected", "lost_removal")

    def __init__(self) -> None:
        self.gpu: list[CacheEvent] = []
        self.tiers: list[TierEvent] = []
        self.skipped = 0
        self.rejected: dict[str, int] = {}
        self.lost_removal = False

    def add(self, decoded: CacheEvent | TierEvent | None) -> None:
        if decoded is None:
            self.skipped += 1
        elif isinstance(decoded, TierEvent):
            self.tiers.append(decoded)
        else:
            self.gpu.append(decoded)

    def add_typed(self, i: int, ev: Any, model: str, lora_ids: Mapping[int, str]) -> None:
        """Event ``i``, a Struct ``_ready`` passed: added, or counted by why it cannot be."""
        try:
            self.add(_from_typed(ev, model, lora_ids))
        except (MalformedPayload, TypeError, ValueError, UnicodeError) as exc:
            self.reject(i, _kind_of_typed(ev), exc)

    def reject(self, i: int, kind: str, exc: Exception) -> None:
        # one bad event must not cost the others (a vLLM batch is a whole scheduler
        # step: removals travel beside stores); the caller counts it and, if it may have
        # been a removal, resyncs the worker
        reason = getattr(exc, "reason", None) or f"malformed_{_REASON_OF.get(kind, 'event')}"
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if kind != "BlockStored":
            self.lost_removal = True
        log.warning("undecodable KV event skipped: events[%d]: %s", i, _clip(str(exc)))

    def result(self, ts: float | None, rank: int | None) -> DecodedBatch:
        return DecodedBatch(float(ts or 0.0), rank, tuple(self.gpu), tuple(self.tiers), self.skipped, self.rejected,
                            self.lost_removal)


def _decode_generic(payload: bytes, model: str, lora_ids: Mapping[int, str]) -> DecodedBatch:
    """``decode_payload`` through generic msgpack objects: every envelope the typed one is not."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedPayload(f"payload is not msgpack: {exc}") from None
    if isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) >= 3 else None
    else:
        raise MalformedPayload(f"batch must be [ts, events, dp_rank] or a map, got {type(raw).__name__}")
    if not isinstance(events, (list, tuple)):
        raise MalformedPayload(f"batch events must be a list, got {type(events).__name__}")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise MalformedPayload(f"batch timestamp must be a number, got {ts!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise MalformedPayload(f"batch dp_rank must be an int, got {rank!r}")
    batch = _Collector()
    for i, ev in enumerate(events):
        try:
            batch.add(decode_event(ev, model, lora_ids))
        except (MalformedPayload, TypeError, ValueError, UnicodeError) as exc:
            batch.reject(i, _event_kind(ev), exc)
    return batch.result(ts, rank)


def peek_timestamp(payload: bytes) -> float | None:
    """The batch timestamp without decoding the events (None when it cannot be read cheaply:
    a map envelope, or not msgpack; ``decode_payload`` says what is wrong with it)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(payload[:64])
    try:
        if unpacker.read_array_header() < 2:
            return None
        ts = unpacker.unpack()
    except Exception:  # not an array, truncated, or not msgpack at all
        return None
    return float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None


_REASON_OF = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}


def _event_kind(raw: Any) -> str:
    """The type name of an event we could not decode, or "" if even that is unreadable."""
    try:
        if isinstance(raw, Mapping):
            return _text(raw.get("type", raw.get(b"type")))
        if isinstance(raw, (list, tuple)) and raw:
            return _text(raw[0])
    except Exception:  # a hostile key type; the kind stays unknown
        pass
    return ""


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
