"""A typed BlockStored's token ids are read from the msgpack bytes without an int per token
(``_native.c``: msgpack_uint32s; issue #16 item 1): the same bytes, and the same refusals, as
decoding the list and packing it with array('I')."""

from __future__ import annotations

import struct
from array import array

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.events.engine_format import _decode_generic, decode_payload
from kvrouterd.index import native

reader = getattr(native.module, "msgpack_uint32s", None)
needs_native = pytest.mark.skipif(reader is None, reason="the C extension is not built")

# every msgpack int encoding of a value: the shortest (what msgpack and msgspec write) and the
# wider ones other encoders may write
_UNSIGNED = ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64))
_SIGNED = ((0xD0, ">b", 1 << 7), (0xD1, ">h", 1 << 15), (0xD2, ">i", 1 << 31), (0xD3, ">q", 1 << 63))


@st.composite
def _encoded_int(draw):
    value = draw(st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1), st.integers(-(2**63), 2**64 - 1)))
    forms = [msgpack.packb(value)]
    forms += [bytes([tag]) + struct.pack(fmt, value) for tag, fmt, end in _UNSIGNED if 0 <= value < end]
    forms += [bytes([tag]) + struct.pack(fmt, value) for tag, fmt, end in _SIGNED if -end <= value < end]
    return value, draw(st.sampled_from(forms))


def _array_header(n: int, form: int) -> bytes:
    if form == 0 and n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if form == 1 and n < 1 << 16 else b"\xdd" + struct.pack(">I", n)


def _reference(raw: bytes) -> bytes | None:
    """What decoding as msgspec's list[int] then packing as uint32 gives, or None where it refuses."""
    try:
        values = msgspec.msgpack.decode(raw, type=list[int])
        return array("I", values).tobytes()
    except (msgspec.DecodeError, OverflowError):
        return None


@needs_native
@settings(max_examples=300, deadline=None)
@given(items=st.lists(_encoded_int(), max_size=40), form=st.integers(0, 2))
def test_every_int_encoding_reads_as_msgspec_and_array_read_it(items, form):
    raw = _array_header(len(items), form) + b"".join(encoded for _, encoded in items)
    assert reader(raw) == _reference(raw)
    assert reader(msgspec.Raw(raw)) == _reference(raw)  # what the typed decoder hands over


@needs_native
@pytest.mark.parametrize(
    "raw",
    [
        b"",  # nothing
        msgpack.packb([1, 2]) + b"\x01",  # bytes after the array
        msgpack.packb([1, 2])[:-1],  # truncated
        b"\x92\x01\xcd\x01",  # an int cut short
        b"\xdd\xff\xff\xff\xff\x01",  # a count the bytes cannot hold
        msgpack.packb([1, True]), msgpack.packb([1, 2.0]), msgpack.packb([1, None]), msgpack.packb([[1]]),
        msgpack.packb([-1]), msgpack.packb([2**32]), msgpack.packb(b"\x01\x00\x00\x00"), msgpack.packb(7),
        msgpack.packb({"a": 1}),
    ],
)
def test_anything_but_an_array_of_uint32_is_left_to_msgspec(raw):
    assert reader(raw) is None


def _payload(tokens_raw: bytes, form: str) -> bytes:
    """One vLLM batch whose BlockStored carries ``tokens_raw`` as its token_ids, as written."""
    marker = [0x5EED]
    event = ({"type": "BlockStored", "block_hashes": [11, 12], "token_ids": marker, "block_size": 2} if form == "map"
             else ["BlockStored", [11, 12], None, marker, 2, None, None])
    packed = msgpack.packb([1.0, [event], 0])
    placeholder = msgpack.packb(marker)
    assert packed.count(placeholder) == 1
    return packed.replace(placeholder, tokens_raw)


@settings(max_examples=150, deadline=None)
@given(items=st.lists(_encoded_int(), min_size=4, max_size=4), form=st.sampled_from(["map", "array"]),
       header=st.integers(0, 2))
def test_stored_events_decode_as_the_generic_decoder_reads_them_in_any_int_encoding(items, form, header):
    """The typed path's token bytes (native, or msgspec's list in pure Python) and its refusals
    are the generic decoder's, whichever widths the engine's encoder chose."""
    payload = _payload(_array_header(4, header) + b"".join(encoded for _, encoded in items), form)
    assert decode_payload(payload) == _decode_generic(payload, "", {})
    values = [value for value, _ in items]
    batch = decode_payload(payload)
    if all(0 <= v < 2**32 for v in values):
        assert batch.events[0].token_ids == array("I", values).tobytes()
    else:
        assert batch.events == () and batch.rejected == {"malformed_stored": 1}


def test_token_ids_sent_as_msgpack_bin_are_not_token_ids():
    """Token bytes are only what an int array reads into: 16 bytes of bin are no 4 tokens."""
    for form in ("map", "array"):
        payload = _payload(msgpack.packb(bytes(16), use_bin_type=True), form)
        batch = decode_payload(payload)
        assert batch.events == () and batch.rejected == {"malformed_stored": 1}
        assert batch == _decode_generic(payload, "", {})


def test_vllm_stores_whose_blocks_have_no_extra_keys_take_the_typed_path(monkeypatch):
    """vLLM sends extra_keys with an entry per block, None where a block has none: those
    stores are read typed (no int per token), and decode as the generic decoder reads them."""
    from kvrouterd.events import engine_format

    generic_events = []
    real = engine_format.decode_event
    monkeypatch.setattr(engine_format, "decode_event", lambda ev, *a: generic_events.append(ev) or real(ev, *a))
    tokens = list(range(100, 108))
    plain = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": tokens, "block_size": 4,
             "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0}
    with_image = {**plain, "block_hashes": [3, 4], "parent_block_hash": 2, "extra_keys": [None, [["img", 0]]]}
    payload = msgpack.packb([1.0, [plain, with_image], 0])
    batch = decode_payload(payload)
    assert [ev["block_hashes"] for ev in generic_events] == [[3, 4]]  # only the store with extras
    assert batch == _decode_generic(payload, "", {})
    assert batch.events[0].token_ids == array("I", tokens).tobytes() and batch.events[0].extra_hashes is None
    assert batch.events[1].extra_hashes is not None
