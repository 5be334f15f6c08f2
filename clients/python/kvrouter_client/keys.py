"""Block keys exactly as kvrouterd computes them, for callers that hash prompts themselves.

A prompt of T tokens has T // block_size full blocks; a trailing partial block is never
keyed. Block i's key is

    key_i = xxh3_64(le_uint32(tokens[i*bs:(i+1)*bs]), seed=key_{i-1})
    key_-1 = namespace_seed(model, lora, salt)

so each key identifies its whole prefix. Send the result as ``RouteRequest.block_keys``, or
use the keys as an engine's block hashes (``EventPublisher.stored(..., engine_hashes=None)``
tells the router exactly that). This module mirrors ``kvrouterd/index/keys.py`` without
importing the daemon; a test in the kvrouterd repository proves both give identical keys.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["ROOT_SEED", "block_keys", "chain_keys", "namespace_seed", "tokens_to_bytes"]

#: Seed of the unsalted namespace: the bytes "kvrouter" read as a big-endian integer.
ROOT_SEED = 0x6B76726F75746572

_xxh3 = xxhash.xxh3_64_intdigest
_LITTLE_ENDIAN = sys.byteorder == "little"


def namespace_seed(model: str = "", lora: str = "", salt: str = "") -> int:
    """The seed of block 0 for prompts of this model/adapter/cache salt (all "" = unsalted).

    ``salt`` is the engine's cache salt (SGLang ``cache_salt``): prompts with different
    salts never share a prefix, as in the engine. Without a salt the seed is what it always
    was, so existing keys do not change."""
    if not model and not lora and not salt:
        return ROOT_SEED
    if not salt:
        return _xxh3(f"{model}\x00{lora}".encode(), ROOT_SEED)
    return _xxh3(f"{model}\x00{lora}\x00{salt}".encode(), ROOT_SEED)


def tokens_to_bytes(tokens: Sequence[int] | array) -> bytes:
    """Token ids as little-endian uint32 bytes. Raises OverflowError for ids outside [0, 2**32)."""
    return le32_array(tokens).tobytes()


def le32_array(tokens: Sequence[int] | array) -> array:
    """Token ids as an ``array('I')`` whose buffer is their little-endian uint32 bytes: ``tokens``
    itself when it already is one (on a little-endian host), so a caller that keeps it must not
    hold it past a change to ``tokens``. Raises OverflowError for ids outside [0, 2**32)."""
    if type(tokens) is list:  # what tokenizers return: fromlist reads a list ~30% faster than array() does
        packed = array("I")
        packed.fromlist(tokens)
    elif isinstance(tokens, array) and tokens.typecode == "I":
        packed = tokens
    else:
        packed = array("I", tokens)
    if not _LITTLE_ENDIAN:  # pragma: no cover - no big-endian CI machine
        packed = array("I", packed)
        packed.byteswap()
    return packed


def chain_keys(token_bytes: bytes, block_size: int, seed: int, limit: int | None = None) -> list[int]:
    """Keys of the full blocks in ``token_bytes`` (little-endian uint32), chained from ``seed``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    step = block_size * 4
    end = len(token_bytes) - len(token_bytes) % step
    if limit is not None:
        end = min(end, limit * step)
    keys: list[int] = []
    key = seed
    for offset in range(0, end, step):
        key = _xxh3(token_bytes[offset : offset + step], key)
        keys.append(key)
    return keys


def block_keys(tokens: Sequence[int], block_size: int = 16, model: str = "", lora: str = "", salt: str = "") -> list[int]:
    """Keys of the full blocks of a token sequence, as the router computes them."""
    return chain_keys(tokens_to_bytes(tokens), block_size, namespace_seed(model, lora, salt))
