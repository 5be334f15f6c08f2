"""Read one engine KV event into the core vocabulary, with the checks both decoders share.

``decode_event`` reads an event decoded into generic msgpack objects (a map or a positional
array: ``engine_format`` describes the layouts); the typed fast path (``engine_structs``) passes
its Structs' fields through the same checks (``stored_from``, ``group_index``,
``normalize_hash``), so an event reads the same either way.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import xxhash

from ..errors import InvalidRequest
from ..index.keys import tokens_to_bytes
from ..protocols import CacheEvent, Cleared, Removed, Stored

__all__ = [
    "GPU_MEDIUM",
    "NO_LORA_IDS",
    "MalformedPayload",
    "TierEvent",
    "UnmappedLora",
    "decode_event",
    "event_kind",
    "group_index",
    "normalize_hash",
    "stored_from",
]

GPU_MEDIUM = "GPU"
_MASK64 = (1 << 64) - 1
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)
NO_LORA_IDS: Mapping[int, str] = {}
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


def decode_event(raw: Any, model: str = "", lora_ids: Mapping[int, str] = NO_LORA_IDS) -> CacheEvent | TierEvent | None:
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
        return Removed(hashes, group_index(f.get("group_idx")))
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
    return stored_from(
        # token bytes are the typed path's reading of an int array; msgpack bin is not token ids
        hashes, None if isinstance(tokens, (bytes, bytearray)) else tokens, f.get("parent_block_hash"), f.get("block_size"), f.get("lora_name"),
        f.get("lora_id"), f.get("group_idx"), f.get("kv_cache_spec_kind"), f.get("cache_salt"), f.get("extra_keys"),
        model, lora_ids,
    )


def stored_from(
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
        group=group_index(group),
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


def group_index(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedPayload(f"group_idx must be a non-negative int, got {value!r}")
    return value


def event_kind(raw: Any) -> str:
    """The type name of an event we could not decode, or "" if even that is unreadable."""
    try:
        if isinstance(raw, Mapping):
            return _text(raw.get("type", raw.get(b"type")))
        if isinstance(raw, (list, tuple)) and raw:
            return _text(raw[0])
    except Exception:  # a hostile key type; the kind stays unknown
        pass
    return ""
