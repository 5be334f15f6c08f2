"""The KV-event messages real engines put on the wire, encoded the way they encode them.

vLLM and SGLang declare their events as ``msgspec`` Structs and publish
``msgspec.msgpack.Encoder().encode(batch)``; these classes declare the same fields in the
same order with the same Struct options, per engine version, so the bytes our tests publish
are the bytes those engines publish (checked against ``vllm/distributed/kv_events.py`` and
``sglang/srt/disaggregation/kv_events.py``):

* ``vllm-0.11``: events ``array_like`` (positional, tag first), ``lora_id`` only, no groups;
  replay replies ``[b"", seq, payload]``.
* ``vllm-0.23``: still positional, with ``lora_name``.
* ``vllm-0.26``: events as maps (``{"type": ...}``), ``extra_keys``, ``group_idx`` and the
  cache-spec kind; replay replies carry the topic, ``[b"", topic, seq, payload]``.
* ``sglang``: positional, signed int64 hashes, pages of 1 token by default, no medium.

The batch envelope is ``array_like`` everywhere: ``[ts, events, data_parallel_rank]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# ---- vLLM <= 0.23 (and 0.11): positional events --------------------------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V11BlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None


class V11BlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class V23BlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


# ---- vLLM >= 0.24: events as maps ------------------------------------------------------------
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V26BlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class V26BlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# ---- SGLang: positional, no medium -----------------------------------------------------------
class SglBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None


class SglBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]


_ENCODER = msgspec.msgpack.Encoder()


def _signed(h: int) -> int:
    """SGLang publishes hashes as signed int64."""
    return h - (1 << 64) if h >= 1 << 63 else h


@dataclass(frozen=True)
class EngineWire:
    """One engine version's encoding: build its events, encode a batch like it does."""

    name: str
    default_page: int
    new_replay_layout: bool

    def stored(self, hashes: list[int], tokens: list[Any], parent: int | None = None, *, page: int | None = None,
               group: int | None = None, kind: str | None = None, lora_id: int | None = None,
               lora_name: str | None = None) -> Any:
        """A BlockStored; ``lora_name`` only in the layouts that carry it (vLLM 0.23 on)."""
        page = page or self.default_page
        if self.name == "vllm-0.11":
            return V11BlockStored(hashes, parent, tokens, page, lora_id, None)
        if self.name == "vllm-0.23":
            return V23BlockStored(hashes, parent, tokens, page, lora_id, None, lora_name)
        if self.name == "sglang":
            return SglBlockStored([_signed(h) for h in hashes], None if parent is None else _signed(parent), tokens,
                                  page, lora_id)
        return V26BlockStored(hashes, parent, tokens, page, lora_id, None, lora_name, group_idx=group,
                              kv_cache_spec_kind=kind)

    def removed(self, hashes: list[int], *, group: int | None = None) -> Any:
        if self.name == "sglang":
            return SglBlockRemoved([_signed(h) for h in hashes])
        if self.name == "vllm-0.26":
            return V26BlockRemoved(hashes, None, group_idx=group)
        return V11BlockRemoved(hashes, None)

    def cleared(self) -> Any:
        return MapAllBlocksCleared() if self.name == "vllm-0.26" else ArrayAllBlocksCleared()

    def batch(self, *events: Any, ts: float = 1.0, dp_rank: int | None = 0) -> bytes:
        return _ENCODER.encode(_Batch(ts, list(events), dp_rank))


VLLM_011 = EngineWire("vllm-0.11", 16, new_replay_layout=False)
VLLM_023 = EngineWire("vllm-0.23", 16, new_replay_layout=False)
VLLM_026 = EngineWire("vllm-0.26", 16, new_replay_layout=True)
SGLANG = EngineWire("sglang", 1, new_replay_layout=True)
ALL_ENGINES = (VLLM_011, VLLM_023, VLLM_026, SGLANG)
