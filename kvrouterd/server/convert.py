"""The one module that touches generated protobuf classes: wire <-> core vocabulary.

Everything here validates shape (which fields are set, sizes) and raises InvalidRequest;
semantic checks (known worker, sequence order) stay in the Router.
Token ids come packed (``token_ids_le32``: little-endian uint32 bytes, what the SDK sends), which
is already the buffer the block hash reads, or repeated (``token_ids``, older clients and grpcurl),
converted with numpy: ``np.asarray(repeated_field)`` reads upb's packed buffer
directly (3 us for 4,000 tokens here) where ``array('I', field)`` iterates it (250 us).
Engine hashes and block keys end up as Python ints anyway, so they are sliced out of the field
(a list built in C): a numpy round trip costs more than that for the tens of hashes an event
carries (a third of the conversion's instructions per stored block, by callgrind).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from google.protobuf.message import DecodeError

from .._generated.kvrouter.v1 import router_pb2 as pb
from ..errors import InvalidRequest, KVRouterError, Overloaded, quote
from ..index import native
from ..index.keys import chain_keys_array, namespace_seed
from ..index.workers import Worker, WorkerSpec
from ..protocols import (
    CacheEvent,
    CacheMode,
    Cleared,
    Completion,
    Dispatch,
    EventBatch,
    EvictRequest,
    Removed,
    RouteRequest,
    Stored,
    TaskCategory,
    WorkerState,
)
from ..router import Router, RouteResult

__all__ = [
    "EVENT_BLOCKS",
    "BatchLimits",
    "BatchTooLarge",
    "batch_blocks",
    "check_id",
    "check_split",
    "completion",
    "deserializer",
    "dispatched_delta",
    "completed_delta",
    "load_delta",
    "marker_delta",
    "event_batch",
    "event_batch_bytes",
    "event_batch_message",
    "length_delimited",
    "varint",
    "evict_request",
    "pb",
    "route_message",
    "route_stream_message",
    "route_request",
    "route_response",
    "HashedPrompt",
    "SplitRoute",
    "SplitStream",
    "STREAM_ROUTE",
    "StreamPrompt",
    "hash_route",
    "hash_stream",
    "refusal",
    "Refused",
    "split_route_request",
    "WirePrompt",
    "hash_wire_prompt",
    "worker_message",
    "worker_spec",
]

_MODE_FROM_PB = {pb.CACHE_STATE_MODE_EVENTS: CacheMode.EVENTS, pb.CACHE_STATE_MODE_APPROXIMATE: CacheMode.APPROXIMATE}
_MODE_TO_PB = {v: k for k, v in _MODE_FROM_PB.items()}
_STATE_TO_PB = {
    WorkerState.READY: pb.WORKER_STATE_READY,
    WorkerState.DEGRADED: pb.WORKER_STATE_DEGRADED,
    WorkerState.DRAINING: pb.WORKER_STATE_DRAINING,
}
_TASKS = {int(t): t for t in TaskCategory}
_M = TypeVar("_M")
_S = TypeVar("_S")
#: dtype objects, not strings: numpy parses a dtype string on every call (1.5 us of 4.8 for 4,000 tokens)
_U32_LE = np.dtype("<u4")


def _le_u32(field: Iterable[int]) -> bytes:
    return np.asarray(field, dtype=_U32_LE).tobytes()


def _packed_count(name: str, packed: bytes | int) -> int:
    """Token ids in a ``token_ids_le32`` field (or its length): 4 bytes each, so any other length is malformed."""
    size = packed if isinstance(packed, int) else len(packed)
    if size % 4:
        raise InvalidRequest(f"{name} holds {size} bytes, not a multiple of 4 (little-endian uint32 token ids)")
    return size // 4


def _stored_tokens(st: pb.StoredBlocks, i: int) -> bytes:
    """A stored event's tokens as little-endian uint32 bytes, from either token field: the packed
    one is already that buffer (no per-token decoding at all), the repeated one goes through numpy."""
    packed = st.token_ids_le32
    if not packed:
        return _le_u32(st.token_ids)
    if len(st.token_ids):
        raise InvalidRequest(f"events[{i}].stored: set exactly one of token_ids and token_ids_le32, not both")
    _packed_count(f"events[{i}].stored.token_ids_le32", packed)
    return packed


def check_id(name: str, value: str, limit: int) -> str:
    """``value`` if it is at most ``limit`` characters (``limits.max_id_length``), else
    INVALID_ARGUMENT quoting its start: a megabyte id must not become a megabyte message."""
    if len(value) > limit:
        raise InvalidRequest(f"{name} {quote(value)} is longer than limits.max_id_length={limit}")
    return value


#: the answer to a Route carrying more than one form of its prompt (checked on both Route paths)
_ONE_PROMPT_FORM = "set exactly one of token_ids, token_ids_le32 and block_keys, not several"


def _route_task(msg: pb.RouteRequest, router: Router) -> TaskCategory:
    """The checks after the prompt's form: a known task, ids within limits."""
    task = _TASKS.get(msg.task)
    if task is None:
        raise InvalidRequest(f"unknown task category {msg.task}")
    id_limit = router.settings.max_id_length
    if len(msg.model) > id_limit or len(msg.lora) > id_limit or len(msg.cache_salt) > id_limit:
        check_id("model", msg.model, id_limit)  # before they salt the hash
        check_id("lora", msg.lora, id_limit)
        check_id("cache_salt", msg.cache_salt, id_limit)
    return task


def route_request(msg: pb.RouteRequest, router: Router, hashed: HashedPrompt | None = None) -> RouteRequest:
    """A RouteRequest with block keys, from token ids or from caller-computed keys.

    Checks run in this order (the first failing one answers): exactly one prompt form, a known
    task, the prompt-size limit. The limit is checked before hashing so an oversized prompt
    costs nothing; the Router checks it again for callers that build RouteRequests themselves.
    ``hashed``: the prompt of a ``SplitRoute`` (``msg`` then carries no token ids), already
    counted and hashed off the event loop by ``hash_wire_prompt``.
    """
    tokens = msg.token_ids
    n_keys = len(msg.block_keys)
    if hashed is not None:
        packed = b""
        n_tokens = hashed.tokens
        if n_keys:
            raise InvalidRequest(_ONE_PROMPT_FORM)
    elif packed := msg.token_ids_le32:
        if len(tokens) or n_keys:
            raise InvalidRequest(_ONE_PROMPT_FORM)
        n_tokens = _packed_count("token_ids_le32", packed)
    else:
        n_tokens = len(tokens)
        if n_tokens and n_keys:
            raise InvalidRequest(_ONE_PROMPT_FORM)
        if not n_tokens and not n_keys:
            raise InvalidRequest("the prompt is empty: set token_ids, token_ids_le32 or block_keys")
    task = _route_task(msg, router)
    if n_tokens:
        limit = router.settings.max_prompt_tokens
        if n_tokens > limit:
            raise Overloaded(f"prompt of {n_tokens} tokens exceeds max_prompt_tokens={limit}")
        if hashed is not None:
            assert hashed.keys is not None  # hash_wire_prompt leaves them out only past the limit
            keys = hashed.keys
        else:
            keys = router.keys_for_tokens(packed or _le_u32(tokens), msg.model, msg.lora, msg.cache_salt)
        prompt_tokens = n_tokens
    else:
        keys = msg.block_keys[:]  # a list of ints, as from the hash (see the module docstring)
        prompt_tokens = msg.prompt_tokens or n_keys * router.block_size
    candidates = msg.candidate_workers
    return RouteRequest(
        request_id=msg.request_id,
        keys=keys,
        prompt_tokens=prompt_tokens,
        session_id=msg.session_id,
        task=task,
        ttft_slo_ms=msg.ttft_slo_ms,
        expected_output_tokens=msg.expected_output_tokens,
        policy=msg.policy,
        candidate_workers=tuple(candidates) if len(candidates) else (),
        model=msg.model,
    )


# ---- huge prompts: hashed off the event loop (issue #16 item 1) ------------------------------
#
# A 1M-token Route held the loop ~12 ms (packed) / ~33 ms (repeated) and every other Route
# waited: upb parsing the prompt field, reading ``msg.token_ids_le32`` (a fresh 4 MiB copy each
# time), numpy, hashing. A Route whose prompt field reaches ``limits.off_loop_prompt_bytes`` is
# split instead: its top-level fields are walked on the wire (a handful of them) to find the
# prompt's payload, the rest is parsed by upb as usual, and the payload is decoded and hashed
# straight from the received bytes by ``_native.wire_prompt_keys`` on a worker thread, the GIL
# released. The decision itself (match, policy, commit) still runs on the loop in one step, so
# it sees the index as it stands when the hash is done, exactly as a small Route would.

#: RouteRequest's prompt fields (router.proto)
_TOKEN_IDS_FIELD = 2
_TOKEN_IDS_LE32_FIELD = 14
#: top-level fields walked before a huge message is refused: RouteRequest has 14, plus up to
#: 64 candidate workers; a message of many tiny fields must not cost a Python loop per field
MAX_SPLIT_FIELDS = 256


@dataclass(frozen=True, slots=True)
class WirePrompt:
    """Where a Route's token ids lie in the received message: the one ``token_ids_le32``
    payload (``packed``), or the packed-varint ``token_ids`` chunks in order. ``route``: where
    the Route message itself lies in ``data`` (a RouteStream message's ``route`` field may come
    in several pieces, which merge), read whole by the pure-Python path. ``both``: the Route
    set ``token_ids_le32`` too (cut out as well): its checks refuse it, its chunks are still
    read for malformed ids, which upb would refuse first."""

    data: bytes
    spans: tuple[tuple[int, int], ...]
    packed: bool
    route: tuple[tuple[int, int], ...]
    both: bool = False

    @property
    def size(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass(frozen=True, slots=True)
class SplitRoute:
    """A Route message whose prompt is still wire bytes (``route_message``): ``msg`` holds every
    other field, or is None when they do not parse (upb refuses the message; ``refusal`` finds
    its words off the loop)."""

    msg: pb.RouteRequest | None
    prompt: WirePrompt


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    tokens: int
    #: None when ``tokens`` is over the limit (nothing was hashed)
    keys: array | None


class _Unsplittable(Exception):
    """The walk met an encoding it does not read (``reason``: which): a group, unpacked token ids,
    more fields than its budget, ... (see "odd encodings" below). ``message_id``: a RouteStream
    message's id, when its top level was walked whole before (else None: unknown)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.message_id: int | None = None


#: the reason a walk that used up its budget gives (its caller says how many fields that is)
_TOO_MANY_FIELDS = "more fields than the walk takes"
_UNPACKED_IDS = "unpacked token_ids (a field per id)"


class _Corrupt(Exception):
    """upb refuses the field being walked (its framing is broken), whatever follows it."""


def _varint(data: bytes, i: int, end: int, limit: int = 10) -> tuple[int, int]:
    """The varint at ``data[i]`` of at most ``limit`` bytes, ending by ``end`` (upb reads tags and
    lengths as at most 5, other varints as at most 10; longer ones are corrupt, as is one cut short)."""
    value = shift = 0
    stop = min(i + limit, end)
    while True:
        if i >= stop:
            raise _Corrupt
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


#: one field as walked: (number, wire type, where it starts, where its payload starts, its end)
_Field = tuple[int, int, int, int, int]


def _walk(data: bytes, start: int, end: int, budget: list[int], route: bool = False) -> list[_Field]:
    """The fields of ``data[start:end]``, each framed as upb reads it, up to the first one upb
    refuses (a tag or length cut short or too long, a field running past ``end``, field 0, wire
    type 4, 6 or 7) where ``end`` is the end of ``data``: upb stops there, so from there on the
    bytes are kept as they are and their error is upb's to give. _Unsplittable for such a field
    inside a submessage with bytes after it (upb reads a string running past its submessage's
    end before it finds the overrun: whether the error is "bad UTF-8" depends on those bytes),
    for anything upb might read otherwise (groups), or when the walk has used up ``budget[0]``
    fields, or (``route``: the fields of a RouteRequest) at a token field that is not
    length-delimited (``_check_token_field``)."""
    fields: list[_Field] = []
    i = start
    try:
        while i < end:
            budget[0] -= 1
            if budget[0] < 0:
                raise _Unsplittable(_TOO_MANY_FIELDS)
            at = i
            tag, i = _varint(data, i, end, 5)
            number, wire_type = tag >> 3, tag & 7
            payload = i
            if wire_type == 0:
                _, i = _varint(data, i, end)
            elif wire_type == 1:
                i += 8
            elif wire_type == 5:
                i += 4
            elif wire_type == 2:
                length, payload = _varint(data, i, end, 5)
                i = payload + length
            elif wire_type == 3 and number:  # a group: legal for an unknown field, but read field by field
                raise _Unsplittable(f"a group (field {number}, wire type 3)")
            else:  # an end-group tag outside a group, or no wire type at all
                raise _Corrupt
            if i > end or number == 0 or tag > 0xFFFFFFFF:
                raise _Corrupt
            if route and (number == _TOKEN_IDS_FIELD or number == _TOKEN_IDS_LE32_FIELD):
                _check_token_field(number, wire_type)  # at the first unpacked id, not after 256 fields of them
            fields.append((number, wire_type, at, payload, i))
    except _Corrupt:
        if end != len(data):
            raise _Unsplittable("a field protobuf cannot frame inside a submessage, with bytes after it") from None
    return fields


def _budget_named(exc: _Unsplittable, budget: int) -> _Unsplittable:
    """``exc`` with a used-up walk budget's reason naming the budget (``_walk`` sees only what is left)."""
    return _Unsplittable(f"more than {budget} fields") if exc.reason == _TOO_MANY_FIELDS else exc


def _check_token_field(number: int, wire_type: int) -> None:
    """_Unsplittable unless a token field (``token_ids``, ``token_ids_le32``) is length-delimited:
    unpacked token ids (legal, no encoder sends them: a field per id) or a mismatch."""
    if wire_type != 2:
        raise _Unsplittable(_UNPACKED_IDS if number == _TOKEN_IDS_FIELD and wire_type == 0
                            else f"{'token_ids' if number == _TOKEN_IDS_FIELD else 'token_ids_le32'} "
                                 f"of wire type {wire_type}")


#: a ``token_ids`` field whose one varint is cut short: what stands in for a prompt's first
#: malformed chunk in the small message upb is asked for its error (``refusal``)
_CORRUPT_IDS = b"\x12\x01\x80"


def _route_prompt(data: bytes, pieces: list[list[_Field]], route: tuple[tuple[int, int], ...], bad: int = -1,
                  ) -> tuple[list[bytes], WirePrompt | None]:
    """A Route given as ``pieces`` (the fields of each payload ``route`` of one merged Route
    message, walked with ``route``: their token fields are length-delimited): each payload
    without its token fields, and where they were; no prompt for a Route without one. Both forms:
    the ids, ``WirePrompt.both``. The ``token_ids`` chunk whose payload starts at ``bad`` becomes
    ``_CORRUPT_IDS``.

    Protobuf's rules for the two fields: the last ``token_ids_le32`` wins (a singular field
    given twice), all ``token_ids`` chunks concatenate; an empty payload is no prompt."""
    rests: list[bytes] = []
    packed: tuple[int, int] | None = None
    chunks: list[tuple[int, int]] = []
    for fields, (kept, piece_end) in zip(pieces, route):
        rest: list[bytes] = []
        for number, _, start, payload, end in fields:
            if number == _TOKEN_IDS_FIELD or number == _TOKEN_IDS_LE32_FIELD:
                if number == _TOKEN_IDS_FIELD:
                    chunks.append((payload, end))
                else:
                    packed = (payload, end)
                rest.append(data[kept:start])
                if payload == bad:
                    rest.append(_CORRUPT_IDS)
                kept = end
        rest.append(data[kept:piece_end])  # past the last field: bytes upb refuses, if any
        rests.append(b"".join(rest))
    has_packed = packed is not None and packed[1] > packed[0]
    has_ids = any(end > start for start, end in chunks)
    if not has_packed and not has_ids:
        return [], None
    if not has_ids:
        assert packed is not None
        return rests, WirePrompt(data, (packed,), True, route)
    return rests, WirePrompt(data, tuple(c for c in chunks if c[1] > c[0]), False, route, has_packed)


# ---- odd encodings of huge messages: refused, not parsed whole (issue #16 items 1 and 4) -------
#
# upb never releases the GIL, so a huge message it parses whole holds the loop for as long as
# it has fields and varints: 37-75 ms for a 14.6 MiB Route of 4M unpacked token ids, 140 ms for
# a RouteStream complete of 7M fields. So at or above limits.off_loop_prompt_bytes no Route or
# RouteStream message is parsed whole: the walk reads every message in it upb would parse (a
# RouteStream message's completes and the occurrences a later oneof member discards too, within
# the same field budget) and cuts the prompts out, or refuses the message with INVALID_ARGUMENT
# when it meets an encoding it does not read: unpacked token ids, a group, more fields than
# MAX_SPLIT_FIELDS (Route) or MAX_STREAM_SPLIT_FIELDS (RouteStream, every level together), a
# kind or batch items field of another wire type, a batch inside a batch item, framing upb
# refuses inside a submessage with bytes after it (upb's error there depends on those bytes),
# or off_loop_prompt_bytes of token ids left in Routes a later oneof member discards. No
# encoder writes any of those. What the walk finds first answers, even where upb would refuse
# the message for something else too (finding that out is the whole parse avoided): such a
# message gets this refusal, INVALID_ARGUMENT either way. Below off_loop_prompt_bytes upb
# parses every message whole, as before (~1 ms at 256 KiB).


@dataclass(frozen=True, slots=True)
class Refused:
    """A huge Route or RouteStream message in an encoding the split does not read, as its
    deserializer hands it over: ``message``, INVALID_ARGUMENT's. ``id``: a RouteStream message's
    id, to answer it on the stream with (None for a unary Route, or when the walk refused the
    message's top level, so its id is unknown: the stream then ends with the error)."""

    id: int | None
    message: str


def _size(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"


def _odd_encoding(message: type[pb.RouteRequest] | type[pb.RouteStreamRequest], size: int, min_prompt_bytes: int,
                  reason: str) -> str:
    return (f"{message.DESCRIPTOR.name} of {_size(size)} is encoded in a form the router reads only below "
            f"limits.off_loop_prompt_bytes ({min_prompt_bytes} bytes): {reason}; encode it as protobuf encoders do "
            "(token_ids packed, as every proto3 encoder writes them, or token_ids_le32)")


def split_route(data: bytes, bad: int = -1) -> tuple[bytes, WirePrompt] | None:
    """``(the message without its token fields, where they were)``; None when it has no prompt
    (upb reads it whole: every field it has was walked, at most MAX_SPLIT_FIELDS). ``bad``: as
    for ``_route_prompt``. _Unsplittable for an encoding the walk does not read."""
    try:
        fields = _walk(data, 0, len(data), [MAX_SPLIT_FIELDS], True)
    except _Unsplittable as exc:
        raise _budget_named(exc, MAX_SPLIT_FIELDS) from None
    rests, prompt = _route_prompt(data, [fields], ((0, len(data)),), bad)
    return None if prompt is None else (rests[0], prompt)


def route_message(data: bytes, min_prompt_bytes: int) -> pb.RouteRequest | SplitRoute | Refused:
    """A Route's request as received: parsed, or split (``SplitRoute``) when its prompt takes
    ``min_prompt_bytes`` (``limits.off_loop_prompt_bytes``; 0 = never) or more on the wire, or
    ``Refused`` when a message of that size is in an encoding the split does not read (see
    "odd encodings" below). Raises DecodeError for bytes that do not parse."""
    if not min_prompt_bytes or len(data) < min_prompt_bytes:
        return pb.RouteRequest.FromString(data)
    try:
        split = split_route(data)
    except _Unsplittable as exc:
        return Refused(None, _odd_encoding(pb.RouteRequest, len(data), min_prompt_bytes, exc.reason))
    if split is None or split[1].size < min_prompt_bytes:
        return pb.RouteRequest.FromString(data)
    rest, prompt = split
    try:
        return SplitRoute(pb.RouteRequest.FromString(rest), prompt)
    except DecodeError:
        if prompt.packed:  # packed ids are any bytes, so upb's first error in the message is the rest's
            raise
        return SplitRoute(None, prompt)  # unless a malformed id comes first: read off the loop (``refusal``)


# ---- huge prompts on RouteStream: the same split, one level down ------------------------------
#
# A RouteStream message (RouteStreamRequest) carries a Route in its ``route`` field or in its
# batch's items' ``route`` fields. A message of ``off_loop_prompt_bytes`` or more has its fields
# walked down to those Routes; each Route's token fields are cut out (where they were is kept,
# as for a unary Route) and the rest of the message, re-framed with the new lengths, is parsed by
# upb, which so applies every rule of the format itself: the repeated ``route`` occurrences of
# one message merge, the last oneof member wins, batch occurrences append their items, unknown
# fields are kept or skipped. Only two rules are ours, about the parts cut out: the token fields
# of a merged Route's occurrences combine as in one Route (``_route_prompt``), and only the
# occurrences upb keeps are cut (an occurrence a later oneof member discards stays whole, so
# upb still checks it, as it would have; it and every complete are walked all the same, so
# their fields count, ``_Walk.skim``). Framing upb refuses ends the walk of its level, kept as
# it is for upb to refuse (``_walk``). Anything odder is refused (see "odd encodings" above). A
# message upb refuses (its rest, or token ids that are malformed varints, found while hashing
# off the loop) gets upb's own error without a whole parse (``refusal``).

#: RouteStreamRequest's fields (router.proto): the kind oneof, and RouteStreamRequestBatch.items
_STREAM_ROUTE_FIELD = 2
_STREAM_COMPLETE_FIELD = 3
_STREAM_KIND_FIELDS = frozenset((2, 3, 5))
_STREAM_BATCH_FIELD = 5
_BATCH_ITEMS_FIELD = 1
#: fields walked in one RouteStream message, at every level, before a huge one is refused: a
#: batch of 256 items (MAX_STREAM_BATCH_ITEMS) of ~10 fields each, with room to spare
MAX_STREAM_SPLIT_FIELDS = 4096
#: the place of a stream message's own Route among ``SplitStream.routes`` (batch items: 0, 1, ...)
STREAM_ROUTE = -1


@dataclass(frozen=True, slots=True)
class SplitStream:
    """A RouteStream message whose Routes' prompts are still wire bytes (``route_stream_message``):
    ``msg`` holds everything else (None: it does not parse, as ``SplitRoute.msg``); ``routes``
    the split Routes by place (``STREAM_ROUTE``, or the index of a batch item), each
    ``SplitRoute.msg`` a part of ``msg``; ``data`` as received."""

    msg: pb.RouteStreamRequest | None
    routes: dict[int, SplitRoute]
    data: bytes


def varint(value: int) -> bytes:
    """A protobuf varint (``value`` >= 0)."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: a cut-out Route's new frame (its length changed)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def _kept_kind(fields: list[_Field]) -> list[int]:
    """Which of a RouteStreamRequest's ``fields`` make up its kind once parsed: the occurrences
    of the last oneof member seen, from the last occurrence of another member on (those merge)."""
    kept: list[int] = []
    kind = 0
    for i, (number, wire_type, *_) in enumerate(fields):
        if number in _STREAM_KIND_FIELDS:
            if wire_type != 2:  # upb would take it as an unknown field: too odd to follow
                raise _Unsplittable(f"a {_KIND_NAMES[number]} field of wire type {wire_type}")
            if number != kind:
                kept.clear()
                kind = number
            kept.append(i)
    return kept


_KIND_NAMES = {_STREAM_ROUTE_FIELD: "route", _STREAM_COMPLETE_FIELD: "complete", _STREAM_BATCH_FIELD: "batch"}


def _reframed(data: bytes, fields: list[_Field], start: int, end: int, new: dict[int, bytes]) -> bytes:
    """``data[start:end]`` (framed as ``fields``) with the fields indexed in ``new`` (in order) replaced."""
    out: list[bytes] = []
    kept = start
    for i, payload in new.items():
        _, _, at, _, after = fields[i]
        out.append(data[kept:at])
        out.append(payload)
        kept = after
    out.append(data[kept:end])
    return b"".join(out)


class _Walk:
    """One RouteStream message's walk: the fields it may still take (``budget``, shared by every
    level) and the token-id bytes left in for upb to parse (``uncut``, at most ``most_uncut``)."""

    __slots__ = ("data", "budget", "uncut", "most_uncut", "bad")

    def __init__(self, data: bytes, most_uncut: int, bad: int) -> None:
        self.data = data
        self.budget = [MAX_STREAM_SPLIT_FIELDS]
        self.uncut = 0
        self.most_uncut = most_uncut
        self.bad = bad

    def fields(self, start: int, end: int, route: bool = False) -> list[_Field]:
        return _walk(self.data, start, end, self.budget, route)

    def skim(self, number: int, start: int, end: int) -> None:
        """Walk a kind field's payload that upb parses as it is (a complete, an occurrence a later
        oneof member discards, a batch of those): its fields are counted, and so are the bytes of
        its Routes' token ids, which upb would decode on the loop."""
        fields = self.fields(start, end, number == _STREAM_ROUTE_FIELD)
        if number == _STREAM_ROUTE_FIELD:
            for field, wire_type, _, payload, after in fields:
                if field == _TOKEN_IDS_FIELD:  # length-delimited: the walk refused any other
                    self.uncut += after - payload
            if 0 <= self.most_uncut <= self.uncut:
                raise _Unsplittable(f"{self.uncut} bytes of token ids in routes that a later route, complete or "
                                    "batch field of their message discards")
        elif number == _STREAM_BATCH_FIELD:
            for field, wire_type, _, payload, after in fields:
                if field == _BATCH_ITEMS_FIELD:
                    if wire_type != 2:
                        raise _Unsplittable(f"batch items of wire type {wire_type}")
                    item, _ = self.item_fields(payload, after)
                    self.kinds(item, [])

    def kinds(self, fields: list[_Field], kept: list[int]) -> None:
        """Skim every kind occurrence of ``fields`` but the ``kept`` Route or batch occurrences
        (their caller walks those: a kept Route's prompt is cut)."""
        walked = set(kept) if kept and fields[kept[0]][0] != _STREAM_COMPLETE_FIELD else set()
        for i, (number, _, _, payload, after) in enumerate(fields):
            if number in _STREAM_KIND_FIELDS and i not in walked:
                self.skim(number, payload, after)

    def item_fields(self, start: int, end: int) -> tuple[list[_Field], list[int]]:
        """A batch item's fields, and which make up its kind; a batch in it is refused (upb would
        parse all it holds, just to answer the item with an error)."""
        fields = self.fields(start, end)
        if any(number == _STREAM_BATCH_FIELD for number, *_ in fields):
            raise _Unsplittable("a batch inside a batch item")
        return fields, _kept_kind(fields)

    def route(self, fields: list[_Field], kept: list[int], new: dict[int, bytes]) -> WirePrompt | None:
        """Cut the prompt out of a message's ``route`` occurrences ``kept`` (they merge into one
        Route), their new frames into ``new``; None (nothing cut) when that Route has no prompt."""
        data = self.data
        pieces = [self.fields(fields[i][3], fields[i][4], True) for i in kept]
        rests, prompt = _route_prompt(data, pieces, tuple((fields[i][3], fields[i][4]) for i in kept), self.bad)
        if prompt is not None:
            for i, rest in zip(kept, rests):
                new[i] = length_delimited(_STREAM_ROUTE_FIELD, rest)
        return prompt

    def item(self, start: int, end: int) -> tuple[bytes, WirePrompt | None]:
        """A kept batch's item (a RouteStreamRequest of its own) re-framed without its Route's prompt."""
        data = self.data
        fields, kept = self.item_fields(start, end)
        self.kinds(fields, kept)
        if not kept or fields[kept[0]][0] != _STREAM_ROUTE_FIELD:
            return data[start:end], None
        new: dict[int, bytes] = {}
        prompt = self.route(fields, kept, new)
        return (data[start:end], None) if prompt is None else (_reframed(data, fields, start, end, new), prompt)


def _stream_id(data: bytes, fields: list[_Field]) -> int:
    """A RouteStreamRequest's id from its walked top level: the last varint field 1 (upb keeps
    the low 64 bits; a field 1 of another wire type is an unknown field to it)."""
    value = 0
    for number, wire_type, _, payload, _ in fields:
        if number == 1 and wire_type == 0:
            value = _varint(data, payload, len(data))[0] & 0xFFFFFFFFFFFFFFFF
    return value


def split_stream(data: bytes, bad: int = -1, most_uncut: int = -1) -> tuple[bytes, dict[int, WirePrompt]] | None:
    """``(the message without its Routes' token fields, where they were by place)``; None when it
    has no prompt (upb reads it whole: every message in it was walked, at most
    MAX_STREAM_SPLIT_FIELDS fields, with fewer than ``most_uncut`` bytes of token ids left in;
    -1: any). ``bad``: as for ``_route_prompt``. _Unsplittable for an encoding the walk does not
    read (its ``message_id`` set when the top level was walked)."""
    walk = _Walk(data, most_uncut, bad)
    prompts: dict[int, WirePrompt] = {}
    try:
        fields = walk.fields(0, len(data))
    except _Unsplittable as exc:
        raise _budget_named(exc, MAX_STREAM_SPLIT_FIELDS) from None
    try:
        kept = _kept_kind(fields)
        walk.kinds(fields, kept)
        new: dict[int, bytes] = {}
        if kept and fields[kept[0]][0] == _STREAM_ROUTE_FIELD:
            prompt = walk.route(fields, kept, new)
            if prompt is not None:
                prompts[STREAM_ROUTE] = prompt
        elif kept and fields[kept[0]][0] == _STREAM_BATCH_FIELD:
            item = 0  # the items of every kept batch occurrence append, in order
            for i in kept:
                batch = walk.fields(fields[i][3], fields[i][4])
                items: dict[int, bytes] = {}
                for j, (number, wire_type, _, payload, end) in enumerate(batch):
                    if number != _BATCH_ITEMS_FIELD:
                        continue  # unknown: kept as it is
                    if wire_type != 2:
                        raise _Unsplittable(f"batch items of wire type {wire_type}")
                    rest, prompt = walk.item(payload, end)
                    if prompt is not None:
                        prompts[item] = prompt
                        items[j] = length_delimited(_BATCH_ITEMS_FIELD, rest)
                    item += 1
                if items:
                    new[i] = length_delimited(_STREAM_BATCH_FIELD,
                                               _reframed(data, batch, fields[i][3], fields[i][4], items))
    except _Unsplittable as exc:
        exc = _budget_named(exc, MAX_STREAM_SPLIT_FIELDS)
        exc.message_id = _stream_id(data, fields)
        raise exc from None
    if not prompts:
        return None
    return _reframed(data, fields, 0, len(data), new), prompts


def route_stream_message(data: bytes, min_prompt_bytes: int) -> pb.RouteStreamRequest | SplitStream | Refused:
    """A RouteStream message as received: parsed, or split (``SplitStream``) when it takes
    ``min_prompt_bytes`` (``limits.off_loop_prompt_bytes``; 0 = never) or more and its Routes'
    prompts together do too, or ``Refused`` when a message of that size is in an encoding the
    split does not read. Raises DecodeError for bytes that do not parse."""
    if not min_prompt_bytes or len(data) < min_prompt_bytes:
        return pb.RouteStreamRequest.FromString(data)
    try:
        split = split_stream(data, most_uncut=min_prompt_bytes)
    except _Unsplittable as exc:
        return Refused(exc.message_id, _odd_encoding(pb.RouteStreamRequest, len(data), min_prompt_bytes, exc.reason))
    if split is None or sum(p.size for p in split[1].values()) < min_prompt_bytes:
        return pb.RouteStreamRequest.FromString(data)
    rest, prompts = split
    try:
        msg = pb.RouteStreamRequest.FromString(rest)
    except DecodeError:
        if all(p.packed for p in prompts.values()):  # as for a unary Route (``route_message``)
            raise
        return SplitStream(None, {place: SplitRoute(None, p) for place, p in prompts.items()}, data)
    items = msg.batch.items
    routes = {place: SplitRoute(msg.route if place == STREAM_ROUTE else items[place].route, prompt)
              for place, prompt in prompts.items()}
    return SplitStream(msg, routes, data)


@dataclass(frozen=True, slots=True)
class StreamPrompt:
    """A split Route's prompt as hashed off the loop (``hash_stream``, ``hash_route``), or the
    error ``route_request``'s checks answer it with; ``seconds``: the hashing, counted in a
    RouteStream Route's latency as the parsed path counts its hashing on the loop."""

    hashed: HashedPrompt | KVRouterError
    seconds: float


def _checked_hash(route: SplitRoute, router: Router, hash_prompt: Callable[[SplitRoute, int, int], HashedPrompt],
                  ) -> StreamPrompt:
    """``route_request``'s checks of a split Route (``check_split``), then its prompt hashed. A
    Route they reject is not hashed, but its ids are still read: malformed ones refuse the whole
    message, as upb's parse would have (InvalidRequest, what ``hash_wire_prompt`` raises for them)."""
    try:
        check_split(route, router)
    except KVRouterError as exc:  # answered in the Route's own turn (and span), as route_request's
        if not route.prompt.packed:  # packed bytes are any bytes; varints may be malformed
            hash_prompt(route, router.block_size, 0)
        return StreamPrompt(exc, 0.0)
    started = time.perf_counter()
    hashed = hash_prompt(route, router.block_size, router.settings.max_prompt_tokens)
    return StreamPrompt(hashed, time.perf_counter() - started)


def hash_route(split: SplitRoute, router: Router,
               hash_prompt: Callable[[SplitRoute, int, int], HashedPrompt] | None = None) -> StreamPrompt:
    """A unary Route's ``hash_stream``: its prompt hashed (or the error its checks answer), on a
    worker thread. Raises upb's DecodeError (``refusal``) for a message upb refuses."""
    try:
        if split.msg is not None:
            return _checked_hash(split, router, hash_prompt or hash_wire_prompt)
    except InvalidRequest:  # malformed ids (check_split's errors are answered above)
        pass
    raise refusal(split.prompt.data, (split.prompt,), pb.RouteRequest, split.msg is not None)


def hash_stream(
    split: SplitStream, router: Router, hash_prompt: Callable[[SplitRoute, int, int], HashedPrompt] | None = None,
) -> dict[int, StreamPrompt]:
    """Check each split Route of a RouteStream message and hash its prompt (``hash_prompt``,
    default ``hash_wire_prompt``), on a worker thread, all in one hand-off (``_checked_hash``).
    Raises upb's DecodeError (``refusal``) for a message upb refuses."""
    hash_prompt = hash_prompt or hash_wire_prompt
    try:
        if split.msg is not None:
            return {place: _checked_hash(route, router, hash_prompt) for place, route in split.routes.items()}
    except InvalidRequest:  # malformed ids (check_split's errors are answered in their Routes' turns)
        pass
    raise refusal(split.data, (route.prompt for route in split.routes.values()), pb.RouteStreamRequest,
                  split.msg is not None)


# ---- a huge message upb refuses: its error without a whole parse (issue #16 items 1 and 4) -----
#
# A message upb refuses gets upb's own error (``decoding.describe``), as if parsed whole. That
# parse would hold the GIL for the whole prompt (~45 ms for 13 MiB of token ids, before it meets
# an error after them), so it is not done: upb stops at a message's first error, and token ids
# can only be malformed varints ("Wire format was corrupt"). So the message with its prompts cut
# out (as split), but its first malformed ``token_ids`` chunk standing in as one cut-short varint
# (``_CORRUPT_IDS``), has the same first error; upb parses that small stand-in instead. The
# chunks are read by the native decoder, the GIL released (pure Python: by upb, one at a time).


def _malformed_ids(data: bytes, start: int, end: int) -> bool:
    """Whether the packed varints ``data[start:end]`` are malformed, as upb would find them."""
    if native.module is not None:
        try:
            native.module.wire_prompt_keys(data, ((start, end),), False, 1, 0, 0)  # counted only
        except ValueError:
            return True
        return False
    try:
        pb.RouteRequest.FromString(length_delimited(_TOKEN_IDS_FIELD, data[start:end]))
    except DecodeError:
        return True
    return False


def refusal(data: bytes, prompts: Iterable[WirePrompt], message: type[pb.RouteRequest] | type[pb.RouteStreamRequest],
            ids_refused: bool) -> DecodeError:
    """upb's error for ``data``, a split ``message`` (split with ``prompts``) that upb refuses:
    its rest did not parse, or (``ids_refused``) the decoder found malformed ids in a prompt,
    then the last chunk is not read again if no other is. See the comment above."""
    chunks = sorted(span for p in prompts if not p.packed for span in p.spans)
    last = chunks.pop() if ids_refused and chunks else (-1, -1)
    bad = next((start for start, end in chunks if _malformed_ids(data, start, end)), last[0])
    split = split_route(data, bad) if message is pb.RouteRequest else split_stream(data, bad)
    assert split is not None, "it split before"
    try:
        message.FromString(split[0])
    except DecodeError as exc:
        return exc
    raise AssertionError("upb accepted a stand-in built to be refused")


def split_route_request(msg: pb.RouteRequest, router: Router, prompt: StreamPrompt | None) -> RouteRequest:
    """``route_request`` of a RouteStream Route (``msg``), with its prompt from ``hash_stream``
    when its message was split (None: parsed whole)."""
    if prompt is None:
        return route_request(msg, router)
    hashed = prompt.hashed
    if isinstance(hashed, KVRouterError):
        raise hashed
    return route_request(msg, router, hashed)


def deserializer(parse: Callable[[bytes], _M], split: Callable[[bytes, int], _M | _S],
                 min_prompt_bytes: int) -> Callable[[bytes], _M | _S]:
    """A request deserializer: ``split(data, min_prompt_bytes)`` (``route_message``,
    ``route_stream_message``) for messages of ``min_prompt_bytes`` or more, upb's ``parse`` for
    the rest. Small messages pay one Python call and a length check (~860 instructions, callgrind;
    calling ``split`` itself cost them ~2,400); with 0 (never split) it is ``parse`` itself."""
    if not min_prompt_bytes:
        return parse

    def deserialize(data: bytes) -> _M | _S:
        return parse(data) if len(data) < min_prompt_bytes else split(data, min_prompt_bytes)

    return deserialize


def check_split(split: SplitRoute, router: Router) -> None:
    """``route_request``'s checks, in its order, as far as they go before the prompt is decoded:
    a request they reject costs no hashing (the size limit is applied while hashing)."""
    if split.prompt.both or len(split.msg.block_keys):
        raise InvalidRequest(_ONE_PROMPT_FORM)
    if split.prompt.packed:
        _packed_count("token_ids_le32", split.prompt.size)
    _route_task(split.msg, router)


def hash_wire_prompt(split: SplitRoute, block_size: int, max_tokens: int) -> HashedPrompt:
    """Count and hash a split Route's prompt (on a worker thread: the native path releases the
    GIL). Past ``max_tokens`` nothing is hashed. Keys equal ``Router.keys_for_tokens`` of the
    same ids; malformed varints are InvalidRequest."""
    msg, prompt = split.msg, split.prompt
    seed = namespace_seed(msg.model, msg.lora, msg.cache_salt)
    if native.module is not None:
        try:
            tokens, raw = native.module.wire_prompt_keys(prompt.data, prompt.spans, prompt.packed, block_size,
                                                         seed, max_tokens)
        except ValueError as exc:
            raise InvalidRequest(f"request is not a valid kvrouter.v1.RouteRequest message: {exc}") from None
        if raw is None:
            return HashedPrompt(tokens, None)
        keys = array("Q")
        keys.frombytes(raw)
        return HashedPrompt(tokens, keys)
    # pure Python (KVROUTERD_PURE_PYTHON): the ids as upb decodes them, then the reference hash
    if prompt.packed:
        start, end = prompt.spans[0]
        ids = prompt.data[start:end]
    else:
        pieces = prompt.route
        whole = prompt.data if pieces == ((0, len(prompt.data)),) else b"".join(prompt.data[a:b] for a, b in pieces)
        try:  # the whole Route: its other fields parsed already, so only the chunks can fail
            ids = _le_u32(pb.RouteRequest.FromString(whole).token_ids)
        except DecodeError as exc:
            raise InvalidRequest(f"request is not a valid kvrouter.v1.RouteRequest message: {exc}") from None
    tokens = len(ids) // 4
    if tokens > max_tokens:
        return HashedPrompt(tokens, None)
    return HashedPrompt(tokens, chain_keys_array(ids, block_size, seed))


def route_response(result: RouteResult, block_size: int, into: pb.RouteResponse | None = None) -> pb.RouteResponse:
    """The RouteResponse for ``result``, written into ``into`` when given: a RouteStream reply's
    own ``route`` field, filled in place, costs half of building a message and copying it in."""
    d = result.decision
    worker = result.worker
    overlap = d.overlap_blocks
    msg = pb.RouteResponse() if into is None else into
    msg.request_id = result.request.request_id
    msg.worker_id = worker.id
    msg.worker_address = worker.address
    msg.matched_blocks = overlap
    msg.matched_tokens = overlap * block_size
    msg.prompt_blocks = len(result.request.keys)
    msg.policy = d.policy
    msg.reason = d.reason
    msg.estimated_ttft_ms = d.estimated_ttft_ms
    alt = result.alternative
    if alt is not None:
        msg.alternative_worker_id = alt.id
        msg.alternative_worker_address = alt.address
    return msg


def completion(msg: pb.CompleteRequest, max_id_length: int = 0) -> Completion:
    """``max_id_length`` 0: unchecked (a replica's load delta, checked where the call came in)."""
    if not msg.request_id:
        raise InvalidRequest("request_id is required")
    if max_id_length:
        check_id("request_id", msg.request_id, max_id_length)
    if msg.ttft_ms < 0 or msg.e2e_ms < 0:
        raise InvalidRequest("ttft_ms and e2e_ms must be >= 0")
    return Completion(
        request_id=msg.request_id,
        ttft_ms=msg.ttft_ms,
        e2e_ms=msg.e2e_ms,
        cached_tokens=msg.cached_tokens,
        output_tokens=msg.output_tokens,
        success=msg.success,
        session_ended=msg.session_ended,
    )


def worker_spec(msg: pb.Worker) -> WorkerSpec:
    if msg.mode == pb.CACHE_STATE_MODE_UNSPECIFIED:
        mode = CacheMode.EVENTS if msg.kv_events_endpoint else CacheMode.APPROXIMATE
    elif msg.mode in _MODE_FROM_PB:
        mode = _MODE_FROM_PB[msg.mode]
    else:
        raise InvalidRequest(f"unknown cache state mode {msg.mode}")
    return WorkerSpec(
        id=msg.id,
        address=msg.address,
        capacity_blocks=msg.capacity_blocks,
        block_size=msg.block_size,
        labels=dict(msg.labels),
        mode=mode,
        kv_events_endpoint=msg.kv_events_endpoint,
    )


def worker_message(worker: Worker, cached_blocks: int, block_size: int) -> pb.Worker:
    s = worker.spec
    return pb.Worker(
        id=s.id,
        address=s.address,
        capacity_blocks=s.capacity_blocks,
        block_size=s.block_size or block_size,
        labels=dict(s.labels),
        state=_STATE_TO_PB[worker.state],
        mode=_MODE_TO_PB[s.mode],
        cached_blocks=cached_blocks,
        inflight_requests=worker.inflight_requests,
        pending_prefill_tokens=max(0, worker.pending_prefill_tokens),
        kv_events_endpoint=s.kv_events_endpoint,
        state_reason=worker.state_reason,
        events_rejected=worker.events_rejected,
    )


#: Stored(*every field in order), built natively without the frozen __init__ (index.native)
_new_stored = native.positional_constructor(Stored)


def _events(msgs: Iterable[pb.CacheEvent]) -> tuple[CacheEvent, ...]:
    out: list[CacheEvent] = []
    for i, ev in enumerate(msgs):
        kind = ev.WhichOneof("event")
        if kind == "stored":
            st = ev.stored
            hashes = st.engine_hashes
            hashes = tuple(hashes[:]) if len(hashes) else None
            out.append(
                _new_stored(
                    _stored_tokens(st, i),  # token_ids
                    hashes,  # engine_hashes
                    st.parent_engine_hash if st.HasField("parent_engine_hash") else None,
                    st.block_size,
                    st.model,
                    st.lora,
                    None,  # group: one KV-cache group
                    None,  # group_kind
                    st.cache_salt,  # salt
                    None,  # extra_hashes
                )
            )
        elif kind == "removed":
            out.append(Removed(tuple(ev.removed.engine_hashes[:])))
        elif kind == "cleared":
            out.append(Cleared())
        else:
            raise InvalidRequest(f"events[{i}] has no event set")
    return tuple(out)


#: Batches count +1 from 0, so no publisher reaches 2**63; a larger number would be applied and
#: then not fit the int64 ``WorkerSequence.last_sequence`` the answer reports it in (the fuzz test
#: found that as an UNKNOWN status after the batch had changed the index).
MAX_EVENT_SEQUENCE = 2**63 - 1


# ---- how much one event batch may carry (issue #16 items 1 and 3) ------------------------------
#
# A batch is read, converted and applied in one turn of the event loop (grpc.aio runs the
# deserializer on the loop, and upb and the native reader hold the GIL, so a thread would not
# help): one PublishEvents message of 219k blocks held the loop 23-35 ms reading natively,
# 84-97 ms parsing on the reference path, then 66-100 ms applying. So its size is bounded
# twice, and more is RESOURCE_EXHAUSTED before the work: its bytes (``limits.max_event_batch_bytes``,
# on len(data) before any parsing: bounds what upb parses) and its blocks
# (``limits.max_batch_blocks``, ``batch_blocks``: bounds the ints made and what the router
# applies; counted before a hash is read). The SDK splits what it sends under both.
#
# An event costs more than a block by itself (natively ~6.5 us to convert and apply a one-block
# stored event, ~0.26 us a block of a long one; a removal ~1.1 us, a clear ~2.7 us), so every
# event counts at least EVENT_BLOCKS: without that, 4,096 one-block events held the loop 27 ms.
# 8, not the ~25 the costs suggest: the SDK's batches of up to 512 small events (its default
# max_batch_events, before it cut batches to the limits) still fit the default 4,096, and 512
# one-block events hold the loop ~3.5 ms.

#: the least one event counts against limits.max_batch_blocks (the SDK counts the same)
EVENT_BLOCKS = 8


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one event batch may carry (config ``limits``); ``block_size``: the router's, which
    a stored event without its own block_size counts its blocks in."""

    max_events: int
    max_id_length: int
    max_bytes: int
    max_blocks: int
    block_size: int

    def too_many_bytes(self, size: int) -> str:
        return (f"event batch of {size} bytes exceeds limits.max_event_batch_bytes={self.max_bytes}: "
                f"split the batch; the kvrouter_client SDK does")

    def too_many_blocks(self) -> str:
        return (f"event batch carries more than limits.max_batch_blocks={self.max_blocks} blocks (stored pages "
                f"and removed hashes; each event counts at least {EVENT_BLOCKS}): split the batch; the kvrouter_client "
                f"SDK does")


@dataclass(frozen=True, slots=True)
class BatchTooLarge:
    """A PublishEvents message over ``limits.max_event_batch_bytes``, as its deserializer hands it
    over, unparsed: ``message`` is RESOURCE_EXHAUSTED's (the handler aborts with it)."""

    size: int
    message: str


def batch_blocks(msg: pb.EventBatch, block_size: int, limit: int) -> int:
    """The blocks of a batch, as ``limits.max_batch_blocks`` counts them, up to the first count
    over ``limit`` (then the rest is not looked at): a stored event counts its pages,
    ``tokens // (its block_size or the router's block_size)``, or its engine hashes if they are
    more (what the reader makes an int of); a removed event its engine hashes; every event at
    least ``EVENT_BLOCKS``, so the limit bounds the events a batch converts too. The native reader
    (``read_event_batch``) counts the same way."""
    total = 0
    for ev in msg.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            st = ev.stored
            tokens = len(st.token_ids_le32) // 4 or len(st.token_ids)
            blocks = max(tokens // (st.block_size or block_size), len(st.engine_hashes))
        elif kind == "removed":
            blocks = len(ev.removed.engine_hashes)
        else:
            blocks = 1
        total += blocks if blocks > EVENT_BLOCKS else EVENT_BLOCKS
        if total > limit:
            break
    return total


def event_batch(msg: pb.EventBatch, limits: BatchLimits) -> EventBatch:
    if not msg.worker_id:
        raise InvalidRequest("event batch without worker_id")
    check_id("worker_id", msg.worker_id, limits.max_id_length)
    if msg.sequence > MAX_EVENT_SEQUENCE:
        raise InvalidRequest(f"event batch sequence {msg.sequence} is above 2**63-1 (batches count +1 from 0)")
    if len(msg.events) > limits.max_events:
        raise Overloaded(f"event batch of {len(msg.events)} events exceeds max_batch_events={limits.max_events}")
    if batch_blocks(msg, limits.block_size, limits.max_blocks) > limits.max_blocks:
        raise Overloaded(limits.too_many_blocks())
    return EventBatch(worker_id=msg.worker_id, sequence=msg.sequence, events=_events(msg.events))


#: EventBatch and Removed built as _new_stored builds Stored
_new_batch = native.positional_constructor(EventBatch)
_new_removed = native.positional_constructor(Removed)
#: the native reader of a plain EventBatch message (None on the pure-Python path)
_read_event_batch = getattr(native.module, "read_event_batch", None)


def event_batch_message(data: bytes, limits: BatchLimits) -> EventBatch | pb.EventBatch | BatchTooLarge:
    """``PublishEvents``' request deserializer: ``BatchTooLarge`` for a message over
    ``limits.max_bytes`` (nothing parsed); else ``event_batch``'s batch for ``data``, read natively
    from the bytes where the message has the plain form protobuf encoders write and nothing in it
    is refused; otherwise (or without the extension) the parsed message, for ``event_batch`` to
    convert or refuse. Parsing then converting costs ~290 ns a stored block of the bench's 32-block
    events, reading natively ~80 (``_native.c``: read_event_batch, which says what it leaves to
    protobuf; most of the rest is the engine hashes' ints, which the core events hold). A batch
    over ``limits.max_blocks`` is left to the reference too, which refuses it: the reader stops
    at the first event past the limit, before making its ints."""
    if len(data) > limits.max_bytes:
        return BatchTooLarge(len(data), limits.too_many_bytes(len(data)))
    if _read_event_batch is not None:
        batch = _read_event_batch(data, limits.max_events, limits.max_id_length, _new_batch, _new_stored, _new_removed,
                                  Cleared, limits.max_blocks, limits.block_size, EVENT_BLOCKS)
        if batch is not None:
            return batch  # type: ignore[no-any-return]
    return pb.EventBatch.FromString(data)


def event_batch_bytes(data: bytes, limits: BatchLimits) -> EventBatch:
    """An ``EventBatch`` message as read from the event bus (serialized, as ``PublishEvents`` sends
    it), under the same limits."""
    try:
        msg = event_batch_message(data, limits)
    except DecodeError as exc:
        raise InvalidRequest(f"event batch does not parse: {exc}") from None
    if type(msg) is BatchTooLarge:
        raise Overloaded(msg.message)
    return msg if isinstance(msg, EventBatch) else event_batch(msg, limits)  # type: ignore[arg-type]


def dispatched_delta(replica_id: str, result: RouteResult, prefill_tokens: int) -> bytes:
    """The load delta (``LoadDelta.dispatched``) of a committed decision, for replica sync."""
    req = result.request
    msg = pb.Dispatched(
        request_id=req.request_id, worker_id=result.worker.id, prefill_tokens=prefill_tokens,
        prompt_tokens=req.prompt_tokens, overlap_blocks=result.decision.overlap_blocks,
        policy=result.decision.policy, session_id=req.session_id, task=int(req.task),
    )
    if result.worker.mode is CacheMode.APPROXIMATE:
        msg.keys.extend(req.keys)
        msg.evicted_keys.extend(result.evicted)
    return pb.LoadDelta(replica_id=replica_id, dispatched=msg).SerializeToString()


def completed_delta(replica_id: str, done: Completion) -> bytes:
    msg = pb.CompleteRequest(
        request_id=done.request_id, ttft_ms=done.ttft_ms, e2e_ms=done.e2e_ms, cached_tokens=done.cached_tokens,
        output_tokens=done.output_tokens, success=done.success, session_ended=done.session_ended,
    )
    return pb.LoadDelta(replica_id=replica_id, completed=msg).SerializeToString()


def marker_delta(replica_id: str) -> bytes:
    return pb.LoadDelta(replica_id=replica_id).SerializeToString()


def load_delta(data: bytes, age_s: float) -> tuple[str, Dispatch | Completion | None]:
    """``(publishing replica, Dispatch | Completion | None for a marker)`` from the load stream."""
    try:
        msg = pb.LoadDelta.FromString(data)
    except DecodeError as exc:
        raise InvalidRequest(f"load delta does not parse: {exc}") from None
    kind = msg.WhichOneof("kind")
    if kind == "completed":
        return msg.replica_id, completion(msg.completed)
    if kind != "dispatched":
        return msg.replica_id, None
    d = msg.dispatched
    if not d.request_id or not d.worker_id:
        raise InvalidRequest("load delta without request_id or worker_id")
    return msg.replica_id, Dispatch(
        request_id=d.request_id, worker_id=d.worker_id, prefill_tokens=d.prefill_tokens, prompt_tokens=d.prompt_tokens,
        overlap_blocks=d.overlap_blocks, policy=d.policy, keys=list(d.keys), evicted=list(d.evicted_keys),
        session_id=d.session_id, task=_TASKS.get(d.task, TaskCategory.UNSPECIFIED), age_s=age_s,
    )


def evict_request(msg: pb.EvictHintRequest, router: Router) -> tuple[EvictRequest, tuple[int, ...]]:
    if not msg.worker_id:
        raise InvalidRequest("worker_id is required")
    check_id("worker_id", msg.worker_id, router.settings.max_id_length)
    check_id("policy", msg.policy, router.settings.max_id_length)
    if bool(msg.blocks) == bool(msg.tokens):
        raise InvalidRequest("set exactly one of blocks and tokens to a positive number")
    pinned = len(msg.pinned_keys) + len(msg.pinned_engine_hashes)
    if pinned > router.settings.max_evict_pinned:
        # checked before the sets are built: their cost is what the limit bounds
        raise Overloaded(f"{len(msg.pinned_keys)} pinned_keys and {len(msg.pinned_engine_hashes)} "
                         f"pinned_engine_hashes exceed limits.max_evict_pinned={router.settings.max_evict_pinned}")
    blocks = msg.blocks or router.blocks_to_free(msg.worker_id, msg.tokens)
    req = EvictRequest(worker_id=msg.worker_id, blocks=blocks, pinned_keys=frozenset(msg.pinned_keys), policy=msg.policy)
    return req, tuple(msg.pinned_engine_hashes)
