"""Block keys are our wire contract with SDK users: these vectors must never change."""

import struct

import pytest
import xxhash

from kvrouterd.index.keys import ROOT_SEED, block_keys, chain_keys, namespace_seed, tokens_to_bytes

# Frozen vectors: (tokens, block_size, model, lora) -> keys. Changing the scheme breaks every
# client that pre-computes keys, so a change here needs a new API version.
VECTORS = [
    (list(range(32)), 16, "", "", [0x0CD74AD8C1F3DC89, 0x441446BF9B202D79]),
    (list(range(32)), 16, "m", "", [0x7A462DD01AC0BBE9, 0xBB0E766B26745FC1]),
]


def test_root_seed_spells_kvrouter():
    assert ROOT_SEED.to_bytes(8, "big") == b"kvrouter"


def test_key_definition_matches_spec():
    tokens = list(range(100, 148))
    keys = block_keys(tokens, 16)
    expected, parent = [], ROOT_SEED
    for i in range(3):
        parent = xxhash.xxh3_64_intdigest(struct.pack("<16I", *tokens[i * 16 : (i + 1) * 16]), seed=parent)
        expected.append(parent)
    assert keys == expected


@pytest.mark.parametrize("tokens,bs,model,lora,expected", VECTORS)
def test_frozen_vectors(tokens, bs, model, lora, expected):
    assert block_keys(tokens, bs, model, lora) == expected


def test_partial_trailing_block_is_not_keyed():
    assert len(block_keys(list(range(47)), 16)) == 2
    assert block_keys(list(range(15)), 16) == []


def test_keys_chain_so_a_prefix_shares_keys_and_a_change_diverges():
    a = block_keys(list(range(64)), 16)
    b = block_keys(list(range(32)) + [999] + list(range(33, 64)), 16)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]


def test_namespace_salts_every_block():
    plain = block_keys(list(range(32)), 16)
    assert not set(plain) & set(block_keys(list(range(32)), 16, model="llama"))
    assert block_keys(list(range(32)), 16, model="llama") != block_keys(list(range(32)), 16, model="llama", lora="a")
    assert namespace_seed("", "") == ROOT_SEED


def test_limit_and_bytes_path_agree():
    tokens = list(range(160))
    data = tokens_to_bytes(tokens)
    assert chain_keys(data, 16, ROOT_SEED, limit=3) == block_keys(tokens, 16)[:3]


def test_token_ids_must_fit_uint32():
    with pytest.raises(OverflowError):
        tokens_to_bytes([2**32])
