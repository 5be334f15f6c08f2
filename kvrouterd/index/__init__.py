"""The router's view of every worker's KV cache: block keys, the radix index, workers."""

from .keys import ROOT_SEED, block_keys, chain_keys, namespace_seed, tokens_to_bytes
from .radix import Block, MatchResult, RadixIndex

__all__ = [
    "ROOT_SEED",
    "Block",
    "MatchResult",
    "RadixIndex",
    "block_keys",
    "chain_keys",
    "namespace_seed",
    "tokens_to_bytes",
]
