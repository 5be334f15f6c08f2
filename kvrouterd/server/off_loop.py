"""Huge Route and RouteStream messages: split as they arrive, their prompts hashed off the event loop.

What is huge is ``limits.off_loop_prompt_bytes``. The walk on the wire is ``wire``'s, the Route's
checks and its core request ``convert``'s (``check_split``, ``route_request``); this module joins
them: the request deserializers (``route_message``, ``route_stream_message``, ``deserializer``)
and what they hand the servicer (``SplitRoute``, ``SplitStream``, ``Refused``), the checks and
the hashing on a worker thread (``hash_route``, ``hash_stream``, ``hash_wire_prompt``), and upb's
own error for a huge message it refuses, found without a whole parse (``refusal``).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError

from ..errors import InvalidRequest, KVRouterError
from ..index import native
from ..index.keys import chain_keys_array, key_namespace, namespace_seed
from ..protocols import RouteRequest
from ..router import Router
from .convert import HashedPrompt, check_split, le_u32, pb, route_request
from .stream_wire import WireRoute
from .wire import STREAM_ROUTE, TOKEN_IDS_FIELD, Unsplittable, WirePrompt, length_delimited, split_route, split_stream

__all__ = [
    "Refused",
    "SplitRoute",
    "SplitStream",
    "StreamPrompt",
    "deserializer",
    "hash_route",
    "hash_stream",
    "hash_wire_prompt",
    "refusal",
    "route_message",
    "route_stream_message",
    "split_route_request",
]

_M = TypeVar("_M")
_S = TypeVar("_S")


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


#: what hashes a split Route's prompt: (the Route, block size, token limit, adapter -> base model)
HashPrompt = Callable[["SplitRoute", int, int, Mapping[str, str]], HashedPrompt]
#: no adapter named in ``model`` is keyed under a base model
_NO_ADAPTERS: Mapping[str, str] = {}


@dataclass(frozen=True, slots=True)
class SplitRoute:
    """A Route message whose prompt is still wire bytes (``route_message``): ``msg`` holds every
    other field, or is None when they do not parse (upb refuses the message; ``refusal`` finds
    its words off the loop)."""

    msg: pb.RouteRequest | None
    prompt: WirePrompt


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


def route_message(data: bytes, min_prompt_bytes: int) -> pb.RouteRequest | SplitRoute | Refused:
    """A Route's request as received: parsed, or split (``SplitRoute``) when its prompt takes
    ``min_prompt_bytes`` (``limits.off_loop_prompt_bytes``; 0 = never) or more on the wire, or
    ``Refused`` when a message of that size is in an encoding the split does not read (see
    "odd encodings" in ``wire``). Raises DecodeError for bytes that do not parse."""
    if not min_prompt_bytes or len(data) < min_prompt_bytes:
        return pb.RouteRequest.FromString(data)
    try:
        split = split_route(data)
    except Unsplittable as exc:
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


@dataclass(frozen=True, slots=True)
class SplitStream:
    """A RouteStream message whose Routes' prompts are still wire bytes (``route_stream_message``):
    ``msg`` holds everything else (None: it does not parse, as ``SplitRoute.msg``); ``routes``
    the split Routes by place (``STREAM_ROUTE``, or the index of a batch item), each
    ``SplitRoute.msg`` a part of ``msg``; ``data`` as received."""

    msg: pb.RouteStreamRequest | None
    routes: dict[int, SplitRoute]
    data: bytes


def route_stream_message(data: bytes, min_prompt_bytes: int) -> pb.RouteStreamRequest | SplitStream | Refused:
    """A RouteStream message as received: parsed, or split (``SplitStream``) when it takes
    ``min_prompt_bytes`` (``limits.off_loop_prompt_bytes``; 0 = never) or more and its Routes'
    prompts together do too, or ``Refused`` when a message of that size is in an encoding the
    split does not read. Raises DecodeError for bytes that do not parse."""
    if not min_prompt_bytes or len(data) < min_prompt_bytes:
        return pb.RouteStreamRequest.FromString(data)
    try:
        split = split_stream(data, most_uncut=min_prompt_bytes)
    except Unsplittable as exc:
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


def _checked_hash(route: SplitRoute, router: Router, hash_prompt: HashPrompt,
                  adapter_bases: Mapping[str, str]) -> StreamPrompt:
    """``route_request``'s checks of a split Route (``check_split``), then its prompt hashed. A
    Route they reject is not hashed, but its ids are still read: malformed ones refuse the whole
    message, as upb's parse would have (InvalidRequest, what ``hash_wire_prompt`` raises for them)."""
    try:
        check_split(route.prompt, route.msg, router)
    except KVRouterError as exc:  # answered in the Route's own turn (and span), as route_request's
        if not route.prompt.packed:  # packed bytes are any bytes; varints may be malformed
            hash_prompt(route, router.block_size, 0, adapter_bases)
        return StreamPrompt(exc, 0.0)
    started = time.perf_counter()
    hashed = hash_prompt(route, router.block_size, router.settings.max_prompt_tokens, adapter_bases)
    return StreamPrompt(hashed, time.perf_counter() - started)


def hash_route(split: SplitRoute, router: Router, hash_prompt: HashPrompt | None = None,
               adapter_bases: Mapping[str, str] = _NO_ADAPTERS) -> StreamPrompt:
    """A unary Route's ``hash_stream``: its prompt hashed (or the error its checks answer), on a
    worker thread. Raises upb's DecodeError (``refusal``) for a message upb refuses."""
    try:
        if split.msg is not None:
            return _checked_hash(split, router, hash_prompt or hash_wire_prompt, adapter_bases)
    except InvalidRequest:  # malformed ids (check_split's errors are answered above)
        pass
    raise refusal(split.prompt.data, (split.prompt,), pb.RouteRequest, split.msg is not None)


def hash_stream(
    split: SplitStream, router: Router, hash_prompt: HashPrompt | None = None,
    adapter_bases: Mapping[str, str] = _NO_ADAPTERS,
) -> dict[int, StreamPrompt]:
    """Check each split Route of a RouteStream message and hash its prompt (``hash_prompt``,
    default ``hash_wire_prompt``), on a worker thread, all in one hand-off (``_checked_hash``).
    ``adapter_bases``: ``Router.adapter_bases()`` as read on the loop. Raises upb's DecodeError
    (``refusal``) for a message upb refuses."""
    hash_prompt = hash_prompt or hash_wire_prompt
    try:
        if split.msg is not None:
            return {place: _checked_hash(route, router, hash_prompt, adapter_bases)
                    for place, route in split.routes.items()}
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
# (``wire._CORRUPT_IDS``), has the same first error; upb parses that small stand-in instead. The
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
        pb.RouteRequest.FromString(length_delimited(TOKEN_IDS_FIELD, data[start:end]))
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


def split_route_request(msg: pb.RouteRequest | WireRoute, router: Router, prompt: StreamPrompt | None,
                        client: str = "") -> RouteRequest:
    """``route_request`` of a RouteStream Route (``msg``: a message, or a batch's Route as read
    from its bytes) sent by ``client``, with its prompt from ``hash_stream`` when its message
    was split (None: parsed whole or read)."""
    if prompt is None:
        return route_request(msg, router, client=client)
    hashed = prompt.hashed
    if isinstance(hashed, KVRouterError):
        raise hashed
    return route_request(msg, router, hashed, client)


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


def hash_wire_prompt(split: SplitRoute, block_size: int, max_tokens: int,
                     adapter_bases: Mapping[str, str] = _NO_ADAPTERS) -> HashedPrompt:
    """Count and hash a split Route's prompt (on a worker thread: the native path releases the
    GIL). Past ``max_tokens`` nothing is hashed. Keys equal ``Router.keys_for_tokens`` of the
    same ids (``adapter_bases``: ``Router.adapter_bases()``, read on the loop); malformed
    varints are InvalidRequest."""
    msg, prompt = split.msg, split.prompt
    seed = namespace_seed(*key_namespace(msg.model, msg.lora, adapter_bases), msg.cache_salt)
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
            ids = le_u32(pb.RouteRequest.FromString(whole).token_ids)
        except DecodeError as exc:
            raise InvalidRequest(f"request is not a valid kvrouter.v1.RouteRequest message: {exc}") from None
    tokens = len(ids) // 4
    if tokens > max_tokens:
        return HashedPrompt(tokens, None)
    return HashedPrompt(tokens, chain_keys_array(ids, block_size, seed))
