"""Decoding vLLM / SGLang KV-event payloads in every encoding the engines use."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.events.engine_event import MalformedPayload, TierEvent, UnmappedLora, decode_event, normalize_hash
from kvrouterd.events.engine_format import DecodedBatch, _decode_generic, decode_payload
from kvrouterd.index.keys import tokens_to_bytes
from kvrouterd.protocols import Cleared, Removed, Stored

TOKENS = list(range(100, 108))


def pack(events, ts=1.5, rank=0):
    return msgpack.packb([ts, events, rank]) if rank is not None else msgpack.packb([ts, events])


def test_vllm_positional_array_form():
    payload = pack([
        ["BlockStored", [11, 12], None, TOKENS, 4, None, None],
        ["BlockRemoved", [11], None],
        ["AllBlocksCleared"],
    ])
    batch = decode_payload(payload, model="m")
    assert batch == DecodedBatch(
        timestamp=1.5,
        dp_rank=0,
        events=(
            Stored(tokens_to_bytes(TOKENS), (11, 12), None, 4, "m", ""),
            Removed((11,)),
            Cleared(),
        ),
    )


def test_map_form_with_unknown_and_newer_fields():
    payload = pack([
        {"type": "BlockStored", "block_hashes": [21, 22], "parent_block_hash": 20, "token_ids": TOKENS,
         "block_size": 4, "lora_id": 3, "lora_name": "sql", "medium": "GPU", "extra_keys": None,
         "group_idx": 0, "some_future_field": {"x": 1}},
        {"type": "BlockRemoved", "block_hashes": [22]},
    ], rank=2)
    batch = decode_payload(payload)
    assert batch.dp_rank == 2
    stored, removed = batch.events
    assert stored == Stored(tokens_to_bytes(TOKENS), (21, 22), 20, 4, "", "sql", group=0)
    assert removed == Removed((22,))


def test_only_type_and_hashes_are_required_for_removal_and_lora_id_maps_to_the_configured_name():
    batch = decode_payload(pack([{"type": "BlockRemoved", "block_hashes": [1]}], rank=None))
    assert batch.events == (Removed((1,)),) and batch.dp_rank is None
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:4], "lora_id": 7}
    stored = decode_event(event, lora_ids={7: "sql"})
    assert isinstance(stored, Stored) and stored.lora == "sql" and stored.block_size == 0
    with pytest.raises(UnmappedLora):  # never keyed under the string "7"
        decode_event(event)
    named = decode_event({**event, "lora_name": "chat"})
    assert isinstance(named, Stored) and named.lora == "chat"


def test_extra_keys_hash_per_block_without_the_lora_name():
    event = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": TOKENS, "block_size": 4, "lora_name": "sql",
             "extra_keys": [["sql", ["img-1", 0]], ["sql"]]}  # vLLM: LoRA name, then (image, offset)
    stored = decode_event(event)
    assert isinstance(stored, Stored) and stored.extra_hashes is not None
    assert stored.extra_hashes[0] != 0 and stored.extra_hashes[1] == 0
    other = decode_event({**event, "extra_keys": [["sql", ["img-2", 0]], None]})
    assert isinstance(other, Stored) and other.extra_hashes is not None
    assert other.extra_hashes[0] not in (0, stored.extra_hashes[0])
    with pytest.raises(MalformedPayload):
        decode_event({**event, "extra_keys": [[["img-1", 0]]]})  # one entry per block


def test_batch_as_a_map_is_accepted():
    payload = msgpack.packb({"ts": 2.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 1})
    assert decode_payload(payload) == DecodedBatch(2.0, 1, (Cleared(),))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (5, 5),
        (2**64 - 1, 2**64 - 1),
        (-1, 2**64 - 1),  # SGLang's signed int64 maps to the same unsigned value
        (-(2**63), 2**63),
        (b"\x01\x02", 0x0102),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),  # last 8 bytes, like vLLM
    ],
)
def test_hash_normalisation(raw, expected):
    assert normalize_hash(raw) == expected


def test_signed_and_unsigned_encodings_of_one_hash_agree_between_store_and_remove():
    unsigned = 2**64 - 5
    signed = unsigned - 2**64
    stored = decode_payload(pack([["BlockStored", [signed], None, TOKENS[:4], 4, None, None]])).events[0]
    removed = decode_payload(pack([["BlockRemoved", [unsigned], None]])).events[0]
    assert isinstance(stored, Stored) and isinstance(removed, Removed)
    assert stored.engine_hashes == removed.engine_hashes == (unsigned,)


def test_bytes_hashes_in_stored_parent_and_removed():
    h1, h0 = b"\xaa" * 32, b"\xbb" * 32
    batch = decode_payload(pack([
        {"type": "BlockStored", "block_hashes": [h1], "parent_block_hash": h0, "token_ids": TOKENS[:4]},
        {"type": "BlockRemoved", "block_hashes": [h1]},
    ]))
    stored, removed = batch.events
    assert stored.engine_hashes == removed.engine_hashes == (int.from_bytes(b"\xaa" * 8, "big"),)
    assert stored.parent_engine_hash == int.from_bytes(b"\xbb" * 8, "big")


def test_other_media_never_reach_the_gpu_view():
    batch = decode_payload(pack([
        {"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:4], "medium": "cpu"},
        ["BlockRemoved", [2], "DISK"],
        {"type": "AllBlocksCleared", "medium": "CPU"},
        ["BlockStored", [3], None, TOKENS[:4], 4, None, "gpu"],
    ]))
    assert batch.events == (Stored(tokens_to_bytes(TOKENS[:4]), (3,), None, 4, "", ""),)
    assert batch.tier_events == (
        TierEvent("CPU", "stored", (1,)), TierEvent("DISK", "removed", (2,)), TierEvent("CPU", "cleared"),
    )


def test_unknown_event_types_are_skipped_and_counted():
    batch = decode_payload(pack([{"type": "BlockPromoted", "block_hashes": [1]}, ["SomethingNew", 1, 2], ["AllBlocksCleared"]]))
    assert batch.events == (Cleared(),) and batch.skipped == 2


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        b"",
        msgpack.packb(42),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, "not a list", 0]),
        msgpack.packb(["yesterday", [], 0]),
        msgpack.packb([1.0, [], "rank"]),
    ],
)
def test_malformed_batches_raise_the_specific_error(payload):
    with pytest.raises(MalformedPayload):
        decode_payload(payload)


REMOVAL_BESIDE = ["BlockRemoved", [77], None]


@pytest.mark.parametrize(
    ("bad_event", "reason", "lost_removal"),
    [
        ({"block_hashes": [1]}, "malformed_event", True),  # no type: it may have been a removal
        ([], "malformed_event", True),
        (7, "malformed_event", True),
        ({"type": "BlockStored", "token_ids": TOKENS}, "malformed_stored", False),  # no hashes
        (["BlockRemoved"], "malformed_removed", True),
        (["BlockRemoved", [1.5], None], "malformed_removed", True),  # float hash
        (["BlockRemoved", [True], None], "malformed_removed", True),
        (["BlockRemoved", "abc", None], "malformed_removed", True),
        (["BlockStored", [1], None, None, 4, None, None], "malformed_stored", False),  # no tokens
        (["BlockStored", [1], None, [-1, 2, 3, 4], 4, None, None], "malformed_stored", False),
        (["BlockStored", [1], None, [2**32, 2, 3, 4], 4, None, None], "malformed_stored", False),
        (["BlockStored", [1], None, ["a", 2, 3, 4], 4, None, None], "malformed_stored", False),
        # SGLang EAGLE "bigram" pages carry token pairs, which the router cannot key
        (["BlockStored", [1], None, [[1, 2], [2, 3]], 2, None, None], "malformed_stored", False),
        (["BlockStored", [1], None, TOKENS[:4], -4, None, None], "malformed_stored", False),
        (["BlockStored", [1], 1.5, TOKENS[:4], 4, None, None], "malformed_stored", False),  # float parent
        ({"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:4], "group_idx": -1}, "malformed_stored", False),
        (["AllBlocksCleared", 5], "malformed_cleared", True),  # medium must be text
    ],
)
def test_a_bad_event_is_counted_and_never_costs_the_rest_of_its_batch(bad_event, reason, lost_removal):
    """vLLM publishes one batch per scheduler step: a removal beside an event we cannot
    read must still be applied (issue #11 item 1)."""
    batch = decode_payload(pack([REMOVAL_BESIDE, bad_event, ["AllBlocksCleared"]]))
    assert batch.events == (Removed((77,)), Cleared())
    assert batch.rejected == {reason: 1}
    assert batch.lost_removal is lost_removal

def test_map_keys_packed_as_bytes_are_accepted():
    payload = msgpack.packb([0.0, [{b"type": "BlockRemoved", b"block_hashes": [4]}], 0], use_bin_type=True)
    assert decode_payload(payload).events == (Removed((4,)),)


def test_vllm_cache_salt_is_the_plain_string_in_the_extras_of_a_chain_from_the_root():
    extras = [["sql", "tenant-a", ["img-1", 0]], ["sql"]]
    event = {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": TOKENS, "block_size": 4, "lora_name": "sql",
             "extra_keys": extras}
    stored = decode_event(event)
    assert isinstance(stored, Stored) and stored.salt == "tenant-a" and stored.lora == "sql"
    no_salt = decode_event({**event, "extra_keys": [["sql", ["img-1", 0]], ["sql"]]})
    assert isinstance(no_salt, Stored) and no_salt.salt == ""
    assert stored.extra_hashes == no_salt.extra_hashes  # the salt left the image's hash alone
    # a chain that continues a parent never starts at token 0: a string there is not a salt
    child = decode_event({**event, "parent_block_hash": 9})
    assert isinstance(child, Stored) and child.salt == "" and child.extra_hashes != stored.extra_hashes
    named = decode_event({**event, "cache_salt": "explicit"})  # a publisher that names it wins
    assert isinstance(named, Stored) and named.salt == "explicit"


def test_text_that_is_not_utf8_costs_only_its_own_event():
    bad = b"\x93\xabBlockStored\x91\x01\xa2\xff\xfe"  # ["BlockStored", [1], <invalid UTF-8 str>]
    payload = b"\x93" + msgpack.packb(1.5) + b"\x92" + bad + msgpack.packb(REMOVAL_BESIDE) + msgpack.packb(0)
    batch = decode_payload(payload)
    assert batch.events == (Removed((77,)),)
    assert batch.rejected == {"malformed_event": 1} and batch.lost_removal


# ---- the typed (msgspec) decoder agrees with the generic one on every input ----------------
_hash = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=9), st.booleans(), st.floats(allow_nan=False))
_maybe = st.one_of(st.none(), st.integers(-3, 9), st.text(max_size=4), st.booleans(), st.binary(max_size=2))
_tokens = st.one_of(st.none(), st.lists(st.integers(-1, 2**32), max_size=12), st.lists(st.text(max_size=1), max_size=2),
                    st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3), st.lists(st.booleans(), max_size=2),
                    st.binary(max_size=8), st.integers(0, 3))
_medium = st.one_of(st.none(), st.sampled_from(["GPU", "gpu", "CPU", "disk"]), st.integers(0, 2))
_stored_fields = st.fixed_dictionaries(
    {"block_hashes": st.lists(_hash, max_size=3), "token_ids": _tokens},
    optional={"parent_block_hash": st.one_of(st.none(), _hash), "block_size": _maybe, "lora_id": _maybe,
              "medium": _medium, "lora_name": _maybe, "group_idx": _maybe, "kv_cache_spec_kind": _maybe,
              "cache_salt": _maybe, "extra_keys": st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(_maybe, max_size=2)), max_size=3))},
)
_POSITIONAL = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
               "extra_keys", "group_idx", "kv_cache_spec_kind")


@st.composite
def _event(draw):
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockPromoted"]))
    fields = draw(_stored_fields) if kind == "BlockStored" else {
        k: v for k, v in draw(_stored_fields).items() if k in ("block_hashes", "medium", "group_idx")
    }
    if kind == "AllBlocksCleared":
        fields.pop("block_hashes", None)
    if draw(st.booleans()):  # vLLM >= 0.24 / map form, maybe with a field from a newer engine
        extra = {"future": 1} if draw(st.booleans()) else {}
        return {"type": kind, **fields, **extra}
    names = _POSITIONAL if kind == "BlockStored" else ("block_hashes", "medium", "group_idx")
    names = tuple(n for n in names if kind != "AllBlocksCleared" or n == "medium")
    cut = draw(st.integers(0, len(names) + 1))  # older engines send fewer fields, newer ones more
    values = [fields.get(n) for n in names] + ["future"]
    return [kind, *values[:cut]]


@settings(max_examples=150, deadline=None)
@given(events=st.lists(_event(), max_size=4), ts=st.one_of(st.floats(0, 1e9), st.integers(0, 10), st.none()),
       rank=st.one_of(st.none(), st.integers(0, 3)))
def test_typed_decoding_matches_the_generic_decoder(events, ts, rank):
    payload = msgpack.packb([ts, events, rank], use_bin_type=True)
    lora_ids = {1: "sql"}
    assert decode_payload(payload, "m", lora_ids) == _decode_generic(payload, "m", lora_ids)
