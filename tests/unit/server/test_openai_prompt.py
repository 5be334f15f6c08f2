"""Parsing OpenAI bodies and keying their prompts (the ext_proc endpoint picker's input)."""

from __future__ import annotations

import json

import pytest

from kvrouterd.errors import ConfigError, InvalidRequest
from kvrouterd.index.keys import block_keys, chain_keys, namespace_seed
from kvrouterd.server.openai_prompt import (
    ParsedPrompt,
    PromptKeyer,
    body_model,
    load_tokenizer,
    parse_body,
    render_messages,
    text_keys,
    text_seed,
)

BS = 16


def body(**doc) -> bytes:
    return json.dumps(doc).encode()


def test_path_chooses_the_field_and_ignores_query_and_prefix():
    chat = parse_body("/openai/v1/chat/completions?x=1", body(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert chat == ParsedPrompt("m", "chat", text="<|user|>\nhi\n")
    comp = parse_body("/v1/completions/", body(model="m", prompt="once"))
    assert comp == ParsedPrompt("m", "completions", text="once")
    assert parse_body("/v1/embeddings", b"anything, not even json") is None
    assert parse_body("/v1/models", b"") is None


def test_messages_render_deterministically_with_parts_and_tool_calls():
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is "}, image, {"type": "text", "text": "this?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    text = render_messages(msgs)
    assert text.startswith("<|system|>\nbe brief\n<|user|>\nwhat is ")
    assert '{"image_url":{"url":"http://x/cat.png"},"type":"image_url"}this?\n' in text
    assert text.endswith('<|assistant|>\n[{"function":{"arguments":"{}","name":"f"},"id":"1"}]\n')
    # key order inside a part does not change the rendering; a different image does
    reordered = [msgs[0], {**msgs[1], "content": [msgs[1]["content"][0], dict(reversed(list(image.items()))), msgs[1]["content"][2]]}, msgs[2]]
    assert render_messages(reordered) == text
    other = [msgs[0], {**msgs[1], "content": [{"type": "image_url", "image_url": {"url": "http://x/dog.png"}}]}]
    assert render_messages(other) != render_messages(msgs[:2])


@pytest.mark.parametrize(
    "path,raw,match",
    [
        ("/v1/chat/completions", b"{oops", "not valid JSON"),
        ("/v1/chat/completions", b"\xff\xfe", "not valid JSON"),
        ("/v1/chat/completions", b'"a string"', "JSON object"),
        ("/v1/chat/completions", body(model="m"), "messages"),
        ("/v1/chat/completions", body(model="m", messages=[]), "messages"),
        ("/v1/chat/completions", body(model="m", messages=["hi"]), r"messages\[0\]"),
        ("/v1/chat/completions", body(model="m", messages=[{"role": "user", "content": 5}]), "content"),
        ("/v1/chat/completions", body(model="m", messages=[{"role": "user", "content": ["x"]}]), r"content\[0\]"),
        ("/v1/chat/completions", body(model="m", messages=[{"role": "u", "content": [{"type": "text"}]}]), "text"),
        ("/v1/chat/completions", body(model=["m"], messages=[{"role": "user", "content": "x"}]), "model"),
        ("/v1/completions", body(model="m"), "prompt"),
        ("/v1/completions", body(model="m", prompt=[]), "prompt"),
        ("/v1/completions", body(model="m", prompt=[1, 2**32]), r"prompt\[1\]"),
        ("/v1/completions", body(model="m", prompt=[1, True]), "prompt"),
        ("/v1/completions", body(model="m", prompt=["ok", {"x": 1}]), r"prompt\[1\]"),
        ("/v1/completions", body(model="m", prompt=[{"x": 1}]), "prompt"),
        ("/v1/completions", body(model="m", prompt=7), "prompt"),
    ],
)
def test_malformed_bodies_are_invalid_requests(path, raw, match):
    with pytest.raises(InvalidRequest, match=match):
        parse_body(path, raw)


def test_token_id_prompts_key_exactly_like_route_token_ids():
    tokens = list(range(100, 100 + 5 * BS + 3))
    parsed = parse_body("/v1/completions", body(model="llama", prompt=tokens))
    pk = PromptKeyer(BS).keys(parsed)
    assert pk.source == "token_ids" and pk.prompt_tokens == len(tokens)
    assert list(pk.keys) == block_keys(tokens, BS, model="llama")
    assert list(PromptKeyer(BS, salt_with_model=False).keys(parsed).keys) == block_keys(tokens, BS)


def test_batched_completions_key_the_first_prompt_and_count_all():
    first = list(range(2 * BS))
    parsed = parse_body("/v1/completions", body(model="m", prompt=[first, [1, 2, 3], "abcdefgh"]))
    pk = PromptKeyer(BS).keys(parsed)
    assert list(pk.keys) == block_keys(first, BS, model="m")
    assert pk.prompt_tokens == 2 * BS + 3 + 2  # 8 bytes of text count as 2 pseudo-tokens
    texts = parse_body("/v1/completions", body(model="m", prompt=["a" * 64, "b"]))
    assert texts.text == "a" * 64 and texts.extra_text_bytes == 1


def test_text_keys_pack_four_utf8_bytes_per_pseudo_token():
    text = "é" * 70  # 140 UTF-8 bytes = 35 pseudo-tokens = 2 full blocks of 16
    keys, n = text_keys(text, BS, "m")
    assert n == 35 and len(keys) == 2
    data = text.encode()
    assert keys == chain_keys(data, BS, text_seed("m"))
    # the same bytes as token ids key differently: text keys never match token (event) state
    as_tokens = chain_keys(data, BS, namespace_seed("m"))
    assert not set(keys) & set(as_tokens)
    # a shared text prefix gives shared leading keys
    assert text_keys("é" * 64 + "different tail", BS, "m")[0][:2] == keys[:2]


def test_text_keyer_counts_and_salts():
    parsed = parse_body("/v1/chat/completions", body(model="a", messages=[{"role": "user", "content": "x" * 200}]))
    pk = PromptKeyer(BS).keys(parsed)
    assert pk.source == "text" and pk.prompt_tokens == -(-len(parsed.text.encode()) // 4)
    other_model = PromptKeyer(BS).keys(ParsedPrompt("b", "chat", text=parsed.text))
    assert not set(pk.keys) & set(other_model.keys)
    unsalted = PromptKeyer(BS, salt_with_model=False)
    assert unsalted.keys(parsed).keys == unsalted.keys(ParsedPrompt("b", "chat", text=parsed.text)).keys
    assert PromptKeyer(BS).keys(ParsedPrompt("m", "completions", text="")).prompt_tokens == 1


def _word_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "once": 2, "upon": 3, "a": 4, "time": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_local_tokenizer_file_keys_completions_like_engine_tokens(tmp_path):
    tok = load_tokenizer(_word_tokenizer(tmp_path))
    keyer = PromptKeyer(4, tok)
    parsed = parse_body("/v1/completions", body(model="m", prompt="once upon a time " * 3))
    pk = keyer.keys(parsed)
    ids = [1] + [2, 3, 4, 5] * 3  # BOS added for /completions, as engines do
    assert pk.source == "tokenizer" and pk.prompt_tokens == 13
    assert list(pk.keys) == block_keys(ids, 4, model="m")
    chat = parse_body("/v1/chat/completions", body(model="m", messages=[{"role": "user", "content": "once upon a time"}]))
    # no special tokens for our chat rendering; '<|user|>' is unknown to this vocabulary
    assert keyer.keys(chat).source == "tokenizer"


def test_load_tokenizer_rejects_an_invalid_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match="ext_proc.tokenizer"):
        load_tokenizer(str(path))


def test_body_model_reads_the_top_level_model_and_nothing_else():
    assert body_model(body(model="B", input="hi")) == "B"
    assert body_model(body(input={"model": "nested"})) == ""
    # what is not a JSON object with a string model names none: routed, not refused
    for raw in (b"not even json", b"[1, 2]", body(model=7), b"\xff\xfe", b"[" * 100_000):
        assert body_model(raw) == ""
