"""The hand-written protobuf wire reader: a huge Route or RouteStream message walked, its prompts cut out.

No generated class here, only bytes: fields framed as upb frames them, a Route's token fields found
and cut out (``WirePrompt``: where they were), the rest re-framed with its new lengths for upb to
parse, and what the walk does not read refused (``Unsplittable``, see "odd encodings" below).
``off_loop`` builds the Route and RouteStream deserializers on it; ``varint`` and
``length_delimited``, the two encoders the re-framing writes with, also build the benchmarks' and
tests' messages.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_SPLIT_FIELDS",
    "MAX_STREAM_SPLIT_FIELDS",
    "STREAM_ROUTE",
    "TOKEN_IDS_FIELD",
    "Unsplittable",
    "WirePrompt",
    "length_delimited",
    "split_route",
    "split_stream",
    "varint",
]


#: RouteRequest's prompt fields (router.proto)
TOKEN_IDS_FIELD = 2
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


class Unsplittable(Exception):
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
    bytes are kept as they are and their error is upb's to give. Unsplittable for such a field
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
                raise Unsplittable(_TOO_MANY_FIELDS)
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
                raise Unsplittable(f"a group (field {number}, wire type 3)")
            else:  # an end-group tag outside a group, or no wire type at all
                raise _Corrupt
            if i > end or number == 0 or tag > 0xFFFFFFFF:
                raise _Corrupt
            if route and (number == TOKEN_IDS_FIELD or number == _TOKEN_IDS_LE32_FIELD):
                _check_token_field(number, wire_type)  # at the first unpacked id, not after 256 fields of them
            fields.append((number, wire_type, at, payload, i))
    except _Corrupt:
        if end != len(data):
            raise Unsplittable("a field protobuf cannot frame inside a submessage, with bytes after it") from None
    return fields


def _budget_named(exc: Unsplittable, budget: int) -> Unsplittable:
    """``exc`` with a used-up walk budget's reason naming the budget (``_walk`` sees only what is left)."""
    return Unsplittable(f"more than {budget} fields") if exc.reason == _TOO_MANY_FIELDS else exc


def _check_token_field(number: int, wire_type: int) -> None:
    """Unsplittable unless a token field (``token_ids``, ``token_ids_le32``) is length-delimited:
    unpacked token ids (legal, no encoder sends them: a field per id) or a mismatch."""
    if wire_type != 2:
        raise Unsplittable(_UNPACKED_IDS if number == TOKEN_IDS_FIELD and wire_type == 0
                            else f"{'token_ids' if number == TOKEN_IDS_FIELD else 'token_ids_le32'} "
                                 f"of wire type {wire_type}")


#: a ``token_ids`` field whose one varint is cut short: what stands in for a prompt's first
#: malformed chunk in the small message upb is asked for its error (``off_loop.refusal``)
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
            if number == TOKEN_IDS_FIELD or number == _TOKEN_IDS_LE32_FIELD:
                if number == TOKEN_IDS_FIELD:
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


def split_route(data: bytes, bad: int = -1) -> tuple[bytes, WirePrompt] | None:
    """``(the message without its token fields, where they were)``; None when it has no prompt
    (upb reads it whole: every field it has was walked, at most MAX_SPLIT_FIELDS). ``bad``: as
    for ``_route_prompt``. Unsplittable for an encoding the walk does not read."""
    try:
        fields = _walk(data, 0, len(data), [MAX_SPLIT_FIELDS], True)
    except Unsplittable as exc:
        raise _budget_named(exc, MAX_SPLIT_FIELDS) from None
    rests, prompt = _route_prompt(data, [fields], ((0, len(data)),), bad)
    return None if prompt is None else (rests[0], prompt)


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
# off the loop) gets upb's own error without a whole parse (``off_loop.refusal``).

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
                raise Unsplittable(f"a {_KIND_NAMES[number]} field of wire type {wire_type}")
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
                if field == TOKEN_IDS_FIELD:  # length-delimited: the walk refused any other
                    self.uncut += after - payload
            if 0 <= self.most_uncut <= self.uncut:
                raise Unsplittable(f"{self.uncut} bytes of token ids in routes that a later route, complete or "
                                    "batch field of their message discards")
        elif number == _STREAM_BATCH_FIELD:
            for field, wire_type, _, payload, after in fields:
                if field == _BATCH_ITEMS_FIELD:
                    if wire_type != 2:
                        raise Unsplittable(f"batch items of wire type {wire_type}")
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
            raise Unsplittable("a batch inside a batch item")
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
    -1: any). ``bad``: as for ``_route_prompt``. Unsplittable for an encoding the walk does not
    read (its ``message_id`` set when the top level was walked)."""
    walk = _Walk(data, most_uncut, bad)
    prompts: dict[int, WirePrompt] = {}
    try:
        fields = walk.fields(0, len(data))
    except Unsplittable as exc:
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
                        raise Unsplittable(f"batch items of wire type {wire_type}")
                    rest, prompt = walk.item(payload, end)
                    if prompt is not None:
                        prompts[item] = prompt
                        items[j] = length_delimited(_BATCH_ITEMS_FIELD, rest)
                    item += 1
                if items:
                    new[i] = length_delimited(_STREAM_BATCH_FIELD,
                                               _reframed(data, batch, fields[i][3], fields[i][4], items))
    except Unsplittable as exc:
        exc = _budget_named(exc, MAX_STREAM_SPLIT_FIELDS)
        exc.message_id = _stream_id(data, fields)
        raise exc from None
    if not prompts:
        return None
    return _reframed(data, fields, 0, len(data), new), prompts
