"""``body_keys``: a body read by the native reader (GIL released) keys exactly as ``parse_body``
+ ``PromptKeyer.keys`` key it, and where the reader declines, the Python parser answers.

Both are run on the same bytes: generated OpenAI bodies (every prompt form, escapes, non-ASCII,
duplicate keys, extra nested fields), the same bodies damaged byte by byte, and hand-written
edge cases where json.loads accepts more than strict JSON. The answers (model, keys, token
count, source, or the error) must be equal; and the reader must actually answer the forms it is
there for, or the equality would hold trivially.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.errors import InvalidRequest
from kvrouterd.index import native
from kvrouterd.server.openai_prompt import PromptKeyer, body_keys, load_tokenizer, parse_body

BS = 4
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"



@pytest.fixture(autouse=True)
def reader(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The extension, in use even under KVROUTERD_PURE_PYTHON: the native reader is what is
    compared, and CI runs this suite in both modes."""
    from kvrouterd.index import _native  # type: ignore[attr-defined]  # a C extension: no stub

    monkeypatch.setattr(native, "module", _native)
    return _native


def python_answer(path: str, body: bytes, keyer: PromptKeyer) -> Any:
    try:
        parsed = parse_body(path, body)
        if parsed is None:
            return None
        pk = keyer.keys(parsed)
    except InvalidRequest as exc:
        return ("invalid", str(exc))
    except Exception as exc:  # noqa: BLE001 - what today's parser raises beyond InvalidRequest must not change either
        return ("raises", type(exc).__name__)
    return (parsed.model, list(pk.keys), pk.prompt_tokens, pk.source)


def native_answer(path: str, body: bytes, keyer: PromptKeyer) -> Any:
    try:
        got = body_keys(path, body, keyer)
    except InvalidRequest as exc:
        return ("invalid", str(exc))
    except Exception as exc:  # noqa: BLE001
        return ("raises", type(exc).__name__)
    if got is None:
        return None
    return (got.model, list(got.prompt.keys), got.prompt.prompt_tokens, got.prompt.source)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "once": 2, "upon": 3, "a": 4, "time": 5, "é": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return load_tokenizer(str(path))


def keyers(tokenizer: Any) -> list[PromptKeyer]:
    return [PromptKeyer(BS), PromptKeyer(BS, salt_with_model=False), PromptKeyer(BS, tokenizer)]


def assert_same(path: str, body: bytes, tokenizer: Any) -> None:
    for keyer in keyers(tokenizer):
        assert native_answer(path, body, keyer) == python_answer(path, body, keyer), (path, body[:200])


# ---- generated bodies ------------------------------------------------------------------------
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["once upon a time", "é", "\x00", "\U0001f600", "\"\\/\b\f\n\r\t", ""]
)
scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | text
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)
token = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 2**32 - 1, 2**32, -1, 7])
token_list = st.lists(token, min_size=0, max_size=3 * BS + 2)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
part = text_part | st.fixed_dictionaries(
    {"type": st.sampled_from(["image_url", "text", "input_audio"]), "text": anything}
)
content = st.none() | text | st.lists(text_part, max_size=3) | st.lists(part, max_size=2) | anything
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "", "t\u00e9"]) | anything},
    optional={
        "content": content,
        "tool_calls": st.sampled_from([None, [], {}, "", False, 0]) | anything,
        "name": text,
    },
)
prompt = text | token_list | st.lists(text | token_list, min_size=0, max_size=3) | anything
doc = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["m", "llama", "", "mo\u00efdel"]) | anything,
        "prompt": prompt,
        "messages": st.lists(message, min_size=0, max_size=3) | anything,
        "temperature": scalars,
        "tools": anything,
        "stream": st.booleans(),
    },
)


def dumps(value: Any, ascii_only: bool, spaced: bool) -> bytes:
    separators = (", ", ": ") if spaced else (",", ":")
    return json.dumps(value, ensure_ascii=ascii_only, separators=separators).encode()


@settings(max_examples=300, deadline=None)
@given(doc=doc, ascii_only=st.booleans(), spaced=st.booleans(), path=st.sampled_from([CHAT, COMPLETIONS, "/v1/models"]))
def test_generated_bodies_key_as_the_python_parser_keys_them(word_tokenizer, doc, ascii_only, spaced, path):
    assert_same(path, dumps(doc, ascii_only, spaced), word_tokenizer)


@settings(max_examples=300, deadline=None)
@given(doc=doc, cut=st.integers(0, 10_000), byte=st.integers(0, 255), path=st.sampled_from([CHAT, COMPLETIONS]))
def test_damaged_bodies_answer_as_the_python_parser_answers(word_tokenizer, doc, cut, byte, path):
    raw = dumps(doc, False, False)
    at = cut % (len(raw) + 1)
    for damaged in (raw[:at], raw[:at] + bytes([byte]) + raw[at:], raw[:at] + bytes([byte]) + raw[at + 1 :]):
        assert_same(path, damaged, word_tokenizer)


# ---- what json.loads reads beyond strict JSON, and what the reader must not misread ----------
EDGE_CASES = [
    (COMPLETIONS, b'{"model": "m", "prompt": [1, -0, 2, 3]}'),  # -0 is the int 0
    (COMPLETIONS, b'{"model": "m", "prompt": [1, -1]}'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 4294967296]}'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 1.0]}'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 1e2]}'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, true]}'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, ' + b"9" * 5000 + b"]}"),  # int() refuses 5,000 digits
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 2], "x": ' + b"1" * 5000 + b"}"),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 2], "x": NaN}'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 2], "x": -Infinity}'),
    (COMPLETIONS, b'\xef\xbb\xbf{"model": "m", "prompt": [1, 2]}'),  # a UTF-8 byte-order mark
    (COMPLETIONS, b'{"model": "m", "prompt": "a\xed\xa0\x80b"}'),  # an encoded surrogate (surrogatepass)
    (COMPLETIONS, b'{"model": "m", "prompt": "a\\ud800b"}'),  # a lone surrogate escape
    (COMPLETIONS, b'{"model": "m", "prompt": "a\\udc00b"}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "a\\ud83d\\u0041"}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "\\ud83d\\ude00 \\u00e9\\u0000 \\"q\\" \\/"}'),
    (COMPLETIONS, b'{"model": "m", "prompt": "a\xc0\xafb"}'),  # an overlong encoding
    (COMPLETIONS, b'{"model": "m", "prompt": "a\x01b"}'),  # a raw control character
    (COMPLETIONS, b'{"model": "m", "prompt": "once", "prompt": [1, 2, 3, 4]}'),  # the last one wins
    (COMPLETIONS, b'{"model": "a", "model": "b", "prompt": [1, 2, 3, 4]}'),
    (COMPLETIONS, b'{"mod\\u0065l": "x", "model": "m", "prompt": [1, 2, 3, 4]}'),  # an escaped key
    (COMPLETIONS, b'{"model": "m\\u00e9", "prompt": [1, 2, 3, 4, 5]}'),
    (COMPLETIONS, b'{"model": null, "prompt": [1]}'),
    (COMPLETIONS, b'{"prompt": [1, 2, 3, 4]}'),
    (COMPLETIONS, b'{"prompt": []}'),
    (COMPLETIONS, b'{"prompt": ""}'),
    (COMPLETIONS, b'{"prompt": [[1, 2], "x"]}'),
    (COMPLETIONS, b'{"prompt": [1, 2, 3, 4]} x'),
    (COMPLETIONS, b'{"prompt": [1, 2, 3, 4],}'),
    (COMPLETIONS, b'{"prompt": [1, 2, 3, 4,]}'),
    (COMPLETIONS, b'{"prompt": [01]}'),
    (COMPLETIONS, b' \t\r\n{"prompt" \n: [ 1 , 2 ] } \n'),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 2], "deep": ' + b"[" * 200 + b"]" * 200 + b"}"),
    (COMPLETIONS, b'{"model": "m", "prompt": [1, 2], "deep": ' + b"[" * 2000 + b"]" * 2000 + b"}"),
    (COMPLETIONS, b'[1, 2]'),
    (COMPLETIONS, b'{"prompt": [1, 2]'),
    (COMPLETIONS, b'{"prompt": "\\x41"}'),
    (COMPLETIONS, b'{"prompt": "\\u00G1"}'),
    (COMPLETIONS, b'{\x00"prompt": [1]}'),
    (CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": null, "tool_calls": []}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": 0}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": 0.0}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
           b' {"text": "b", "type": "text"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "te\\u0078t", "text": "a"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "type": "image"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}'),
    (CHAT, b'{"messages": [{"role": "", "content": "x"}]}'),
    (CHAT, b'{"messages": [{"role": "\\u00e9", "content": "x"}]}'),
    (CHAT, b'{"messages": [{"r\\u006fle": "user", "content": "x"}]}'),
    (CHAT, b'{"messages": []}'),
    (CHAT, b'{"messages": {"role": "user"}}'),
    (CHAT, b'{"messages": ["hi"]}'),
    (CHAT, b'{"prompt": "not read on this path"}'),
    # parts and tool calls rendered as canonical JSON (sorted keys, no spaces, ensure_ascii off)
    (CHAT, b'{"messages": [{"role": "user", "content": ['
           b'{"type": "image_url", "image_url": {"url": "u", "detail": "x"}},'
           b' {"z": [1, -0, true, false, null, "\\u0001\\"\\\\\\/\\u2028\\u007f\\u00e9\\ud83d\\ude00\\b\\f\\n\\r\\t"],'
           b' "\xc3\xa9": {}, "a": [], "B": {"y": 2, "x": 1}}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image", "a": 1, "a": 2}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image", "x": {"a": 1, "a": 2}}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image", "x": {"\\u0061": 1}}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image", "x": 1.5}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image", "x": "\\udc00"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": 5, "text": "x"}, {"text": "y"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": ['
           + b", ".join(b'{"type": "i", "k%d": %d}' % (i, i) for i in range(3))
           + b', {' + b", ".join(b'"k%03d": %d' % (i, i) for i in range(70)) + b'}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": "call"}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": 7}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": -0}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": true}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "tool_calls": {"a": null}}]}'),
]


@pytest.mark.parametrize(("path", "raw"), EDGE_CASES)
def test_edge_cases_answer_as_the_python_parser_answers(word_tokenizer, path, raw):
    assert_same(path, raw, word_tokenizer)


@pytest.mark.parametrize(
    ("path", "doc"),
    [
        (COMPLETIONS, {"model": "m", "prompt": list(range(100, 100 + 7 * BS))}),
        (COMPLETIONS, {"model": "m", "prompt": "once upon a time " * 9}),
        (CHAT, {"model": "m", "messages": [
            {"role": "system", "content": "é" * 30},
            {"role": "user", "content": [{"type": "text", "text": "once upon"}, {"type": "text", "text": " a time"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
        ]}),
        (CHAT, {"model": "m", "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO", "detail": "auto"}},
            ]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{\"q\": \"é\"}"}}]},
        ]}),
    ],
)
def test_the_native_reader_reads_the_prompts_it_is_for(reader, path, doc):
    # the equality above must not hold only because every body fell back to the Python parser
    assert reader.openai_prompt(json.dumps(doc).encode(), path == CHAT) is not None


def test_tokenized_keys_are_the_engines_tokens(word_tokenizer):
    """The tokenizer is called through encode_batch (it releases the GIL); its ids are encode's."""
    raw = json.dumps({"model": "m", "prompt": "once upon a time é " * 5}).encode()
    got = body_keys(COMPLETIONS, raw, PromptKeyer(BS, word_tokenizer))
    assert got is not None and got.prompt.source == "tokenizer"
    ids = word_tokenizer.encode("once upon a time é " * 5).ids
    assert list(got.prompt.keys) == list(PromptKeyer(BS).keys(parse_body(COMPLETIONS, json.dumps(
        {"model": "m", "prompt": ids}).encode())).keys)
    assert got.prompt.prompt_tokens == len(ids) == 26
