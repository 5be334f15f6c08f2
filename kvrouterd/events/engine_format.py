"""Decode one vLLM / SGLang KV-event batch payload (msgpack) into the core vocabulary.

Pure functions, no I/O: ``sequencing`` feeds them the payload frame of each ZMQ message.

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

Decoding is typed, as vLLM itself decodes (``msgspec`` Structs per event form, in
``engine_structs``): the batch envelope is read with its events left as raw msgpack, then each
event is decoded into its Struct. Anything the Structs do not describe (a map envelope, bytes
map keys, an unknown event type, a field of an unexpected type) falls back, for that batch
envelope or that one event only, to a generic msgpack decode with the checks of
``engine_event`` (which also says how block hashes, media and extra keys are read), so leniency
and the reasons events are counted under are the same either way; the typed path is only faster.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec

from ..protocols import CacheEvent
from .engine_event import NO_LORA_IDS, MalformedPayload, TierEvent, decode_event, event_kind
from .engine_structs import ENVELOPE, ONE_FORM_BATCHES, from_typed, kind_of_typed, ready, typed_event

__all__ = ["DecodedBatch", "decode_payload", "peek_timestamp"]

log = logging.getLogger("kvrouterd.events.engine")


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


def decode_payload(payload: bytes, model: str = "", lora_ids: Mapping[int, str] = NO_LORA_IDS) -> DecodedBatch:
    """Decode one msgpack batch payload. Raises MalformedPayload; never anything else."""
    decoded = _decode_one_form(payload, model, lora_ids)
    if decoded is not None:
        return decoded
    try:
        envelope = ENVELOPE.decode(payload)
    except msgspec.DecodeError:
        # a map envelope, or not a batch at all: the generic path decides (and says what is wrong)
        return _decode_generic(payload, model, lora_ids)
    batch = _Collector()
    for i, raw in enumerate(envelope.events):
        typed = typed_event(raw)
        if typed is None:
            try:
                generic = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            except Exception as exc:  # e.g. text that is not UTF-8: this event only
                batch.reject(i, "", MalformedPayload(f"event is not readable msgpack: {exc}"))
                continue
            try:
                batch.add(decode_event(generic, model, lora_ids))
            except (MalformedPayload, TypeError, ValueError, UnicodeError) as exc:
                batch.reject(i, event_kind(generic), exc)
            continue
        batch.add_typed(i, typed, model, lora_ids)
    return batch.result(envelope.ts, envelope.data_parallel_rank)


def _decode_one_form(payload: bytes, model: str, lora_ids: Mapping[int, str]) -> DecodedBatch | None:
    """``decode_payload`` for a batch of map events only (vLLM >= 0.24, SGLang) or positional
    ones only, every event a Struct and none that needs the generic decoder (extra keys, token
    ids that are not uint32s); None for anything else, which the event-by-event path reads
    (where the same events give the same results: one event's Struct is the same either way)."""
    for decoder in ONE_FORM_BATCHES:
        try:
            envelope = decoder.decode(payload)
        except msgspec.DecodeError:  # ValidationError included
            continue
        if not all(ready(ev) for ev in envelope.events):
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
        """Event ``i``, a Struct ``ready`` passed: added, or counted by why it cannot be."""
        try:
            self.add(from_typed(ev, model, lora_ids))
        except (MalformedPayload, TypeError, ValueError, UnicodeError) as exc:
            self.reject(i, kind_of_typed(ev), exc)

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
            batch.reject(i, event_kind(ev), exc)
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


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
