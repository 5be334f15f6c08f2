"""The SDK must hash prompts exactly as the router does, or callers' block keys never match."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter_client import keys as sdk_keys
from kvrouterd.index import keys as daemon_keys


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 64),
    model=st.text(max_size=8),
    lora=st.text(max_size=8),
)
def test_sdk_and_daemon_keys_are_identical(tokens, block_size, model, lora):
    assert sdk_keys.block_keys(tokens, block_size, model, lora) == daemon_keys.block_keys(tokens, block_size, model, lora)
    assert sdk_keys.namespace_seed(model, lora) == daemon_keys.namespace_seed(model, lora)
    assert sdk_keys.tokens_to_bytes(tokens) == daemon_keys.tokens_to_bytes(tokens)


def test_constants_and_limit_agree():
    assert sdk_keys.ROOT_SEED == daemon_keys.ROOT_SEED
    data = sdk_keys.tokens_to_bytes(list(range(100)))
    assert sdk_keys.chain_keys(data, 16, 7, limit=3) == daemon_keys.chain_keys(data, 16, 7, limit=3)


def test_sdk_does_not_import_the_daemon():
    import ast
    from pathlib import Path

    import kvrouter_client

    root = Path(kvrouter_client.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("kvrouterd") for n in names), f"{path} imports {names}"
