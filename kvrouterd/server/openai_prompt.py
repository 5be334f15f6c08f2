"""The prompt of an OpenAI-style request body, and the block keys to route it by.

Used by the Envoy ext_proc endpoint picker (``ext_proc.py``), which sees HTTP bodies, not
token ids. Pure: no I/O after the optional tokenizer is loaded, no protobuf, no asyncio.

Which field holds the prompt is chosen by the request's ``:path`` (query string ignored):

- ``.../chat/completions``: ``messages``, rendered by :func:`render_messages` as
  ``<|role|>\\n{content}\\n`` per message in order. ``content`` may be a string, null, or a
  list of parts: ``{"type": "text"}`` parts contribute their ``text``; any other part (an
  image, audio) contributes its canonical JSON (sorted keys, no spaces) so two requests
  share a prefix only if those parts are identical. ``tool_calls`` on a message are
  appended the same way. This is *our* rendering, not the model's chat template.
- ``.../completions``: ``prompt``: a string, a list of token ids, or a list of either
  (a batch: keys come from the first element, ``prompt_tokens`` counts them all).
- any other path: no prompt (:func:`parse_body` returns None; the caller picks any worker).

Keys, best source first:

1. ``prompt`` given as token ids: keyed exactly as ``Route`` keys ``token_ids`` (see
   ``docs/block-keys.md``), so they match event-driven state (engine KV events) too.
2. A tokenizer is configured (``ext_proc.tokenizer``: a local ``tokenizer.json`` loaded with
   the ``tokenizers`` library from that file, never downloaded; the ``tokenizer`` extra):
   the text is encoded and keyed like token ids. For ``/completions`` special tokens are
   added as engines do, so a string prompt keys like the engine's own tokens. For chat the
   text is our rendering, not the engine's chat template, so its keys are consistent among
   requests but generally not equal to the engine's.
3. Otherwise, *approximate text keys*: the UTF-8 bytes of the text, zero-padded to a
   multiple of 4, are read as little-endian uint32 "tokens" (4 bytes each) and chained with
   the usual xxh3 block hash (``index/keys.py``), so one block covers ``4 * block_size``
   bytes of text and a trailing partial block is not keyed. The chain starts from
   :func:`text_seed` rather than the token namespace, so text keys can never equal token
   keys: **they match only approximate-mode state** (the router's model of what it sent
   where), **never event-driven state** from engine KV events, whose keys come from real
   token ids. ``prompt_tokens`` is the number of pseudo-tokens (bytes / 4, rounded up),
   close to real token counts for English text (about four characters per token).

Keys are salted with the body's ``model`` unless ``salt_with_model`` is off, as ``Route``
salts with its ``model`` field.

:func:`body_keys` is what the endpoint picker calls: ``parse_body`` + ``PromptKeyer.keys`` in
effect, with the body read by ``_native.openai_prompt`` (``index/_native.c``) when the extension
is built, the GIL released, so that a multi-MiB body can be read on a worker thread while the
event loop routes (issue #16 item 1): no Python object per token id or character, the ids kept
as little-endian bytes and hashed as they are. Where the native reader declines a body (invalid
JSON, a batched prompt, a float or a duplicate key in a content part, anything else it leaves
to Python), the Python parser reads it, so answers and errors are the same either way; except
that a caller keying off the loop may pass ``unread_from``: a body of that many bytes or more the
native reader declines raises :class:`BodyNotRead` instead, because ``json.loads`` holds the GIL
(~70 ms per MiB of token ids) and would stall the loop all the same. A tokenizer is called
through ``encode_batch``, which the ``tokenizers`` library runs with the GIL released
(``encode`` holds it throughout).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from ..errors import ConfigError, InvalidRequest
from ..index import native
from ..index.keys import ROOT_SEED, chain_keys, chain_keys_array, key_namespace, namespace_seed, tokens_to_bytes

__all__ = [
    "BodyKeys",
    "BodyNotRead",
    "ParsedPrompt",
    "PromptKeyer",
    "PromptKeys",
    "Tokenizer",
    "body_keys",
    "body_model",
    "load_tokenizer",
    "parse_body",
    "render_messages",
    "text_keys",
    "text_seed",
]

_U32_MAX = (1 << 32) - 1


@dataclass(slots=True, frozen=True)
class ParsedPrompt:
    """What routing needs from a body: exactly one of ``text`` and ``token_ids`` is set."""

    model: str
    endpoint: str  # "chat" or "completions"
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    #: tokens of further prompts of a batched /completions request (counted, not keyed)
    extra_tokens: int = 0
    extra_text_bytes: int = 0


@dataclass(slots=True, frozen=True)
class PromptKeys:
    keys: Sequence[int]
    prompt_tokens: int
    source: str  # "token_ids", "tokenizer" or "text"


@dataclass(slots=True, frozen=True)
class BodyKeys:
    """What routing needs from a body (:func:`body_keys`): its ``model`` and prompt keys."""

    model: str
    prompt: PromptKeys


class BodyNotRead(Exception):
    """A body of ``unread_from`` bytes or more that only the GIL-holding Python parser could read
    (:func:`body_keys`): the caller routes it without a prompt rather than stall the loop."""


class Tokenizer(Protocol):
    """The part of ``tokenizers.Tokenizer`` used here: ``encode_batch`` releases the GIL while
    it encodes (``encode`` does not), and ``encode_batch_fast``, where the installed version
    has it, does the same without computing offsets."""

    def encode_batch(self, input: Any, is_pretokenized: bool = False, add_special_tokens: bool = True) -> Any: ...


def _endpoint(path: str) -> str | None:
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/chat/completions"):
        return "chat"
    if p.endswith("/completions"):
        return "completions"
    return None


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise InvalidRequest(f"{where}.content[{j}]: expected an object")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest(f"{where}.content[{j}].text: expected a string")
                out.append(text)
            else:
                out.append(_canonical(part))
        return "".join(out)
    raise InvalidRequest(f"{where}.content: expected a string, a list of parts or null")


def render_messages(messages: Any) -> str:
    """Chat messages as one deterministic string (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: expected a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"{where}: expected an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{where}.role: expected a non-empty string")
        text = _content_text(m.get("content"), where)
        calls = m.get("tool_calls")
        if calls:
            text += _canonical(calls)
        out.append(f"<|{role}|>\n{text}\n")
    return "".join(out)


def _token_list(value: list[Any], where: str) -> tuple[int, ...]:
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _U32_MAX:
            raise InvalidRequest(f"{where}[{i}]: token ids must be integers in [0, 2**32)")
    return tuple(value)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _completion_prompt(model: str, prompt: Any) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(model, "completions", text=prompt)
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("prompt: expected a string, a list of token ids, or a non-empty list of those")
    if _is_token_list(prompt):
        return ParsedPrompt(model, "completions", token_ids=_token_list(prompt, "prompt"))
    first, rest = prompt[0], prompt[1:]
    extra_tokens = extra_bytes = 0
    for i, p in enumerate(rest, start=1):
        if isinstance(p, str):
            extra_bytes += len(p.encode())
        elif _is_token_list(p):
            extra_tokens += len(_token_list(p, f"prompt[{i}]"))
        else:
            raise InvalidRequest(f"prompt[{i}]: expected a string or a list of token ids")
    if isinstance(first, str):
        return ParsedPrompt(model, "completions", text=first, extra_tokens=extra_tokens, extra_text_bytes=extra_bytes)
    if _is_token_list(first):
        return ParsedPrompt(
            model, "completions", token_ids=_token_list(first, "prompt[0]"),
            extra_tokens=extra_tokens, extra_text_bytes=extra_bytes,
        )
    raise InvalidRequest("prompt[0]: expected a string or a list of token ids")


def parse_body(path: str, body: bytes) -> ParsedPrompt | None:
    """The prompt of an OpenAI ``/chat/completions`` or ``/completions`` body; None for other paths.

    Raises InvalidRequest for a body that is not a JSON object or lacks a usable prompt.
    """
    endpoint = _endpoint(path)
    if endpoint is None:
        return None
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = doc.get("model", "")
    if not isinstance(model, str):
        raise InvalidRequest("model: expected a string")
    if endpoint == "chat":
        return ParsedPrompt(model, "chat", text=render_messages(doc.get("messages")))
    if "prompt" not in doc:
        raise InvalidRequest("prompt: required for /completions")
    return _completion_prompt(model, doc["prompt"])


def body_model(body: bytes) -> str:
    """The top-level ``model`` string of a JSON object body, "" when it has none (not JSON, not
    an object, no string ``model``): a body without a prompt is routed, never refused, here (the
    engine answers for it), so what it lacks only means no model pool to keep to."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return ""
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) else ""


def text_seed(model: str = "") -> int:
    """Where approximate text keys start: a namespace no token-id key chain can share."""
    return xxhash.xxh3_64_intdigest(b"kvrouterd/text\x00" + model.encode(), ROOT_SEED)


def text_keys(text: str, block_size: int, model: str = "") -> tuple[list[int], int]:
    """Approximate keys of ``text`` and its pseudo-token count (4 UTF-8 bytes per token)."""
    data = text.encode()
    pad = -len(data) % 4
    if pad:
        data += b"\x00" * pad
    return chain_keys(data, block_size, text_seed(model)), len(data) // 4


def load_tokenizer(path: str) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json; ConfigError if it cannot be."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ConfigError(
            "ext_proc.tokenizer is set but the tokenizers library is not installed "
            "(pip install 'kvrouterd[tokenizer]')"
        ) from None
    try:
        return HFTokenizer.from_file(path)  # type: ignore[no-any-return,unused-ignore]
    except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception for unreadable/invalid files
        raise ConfigError(f"ext_proc.tokenizer: cannot load {path!r}: {exc}") from None


class PromptKeyer:
    """Turns a :class:`ParsedPrompt` into block keys, by the best source available."""

    def __init__(self, block_size: int, tokenizer: Tokenizer | None = None, salt_with_model: bool = True) -> None:
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.salt_with_model = salt_with_model
        #: adapter -> base model (``Router.adapter_bases``), set on the loop before each body is
        #: keyed: a body naming an adapter in ``model`` is keyed under (base, adapter), as its
        #: engine stores its blocks
        self.adapter_bases: Mapping[str, str] = {}
        #: encode_batch_fast (no offsets) where the installed tokenizers has it
        self._encode_batch = None if tokenizer is None else getattr(
            tokenizer, "encode_batch_fast", tokenizer.encode_batch
        )

    def keys(self, prompt: ParsedPrompt) -> PromptKeys:
        extra = prompt.extra_tokens + -(-prompt.extra_text_bytes // 4)
        if prompt.token_ids is not None:
            return self._token_keys(tokens_to_bytes(prompt.token_ids), prompt.model, extra, "token_ids")
        assert prompt.text is not None
        if self.tokenizer is not None:
            return self._tokenized(prompt.text, prompt.endpoint, prompt.model, extra)
        data = prompt.text.encode()
        return self._text_keys(data + b"\x00" * (-len(data) % 4), prompt.model, extra)

    def _token_keys(self, token_bytes: bytes, model: str, extra: int, source: str) -> PromptKeys:
        seed = namespace_seed(*key_namespace(model, "", self.adapter_bases)) if self.salt_with_model else ROOT_SEED
        # an empty prompt still needs a worker; one token keeps the request valid
        keys = chain_keys_array(token_bytes, self.block_size, seed)
        return PromptKeys(keys, max(1, len(token_bytes) // 4 + extra), source)

    def _tokenized(self, text: str, endpoint: str, model: str, extra: int) -> PromptKeys:
        assert self._encode_batch is not None
        # special tokens for /completions as engines add them; chat text is our own rendering
        ids = self._encode_batch([text], add_special_tokens=endpoint == "completions")[0].ids
        return self._token_keys(tokens_to_bytes(ids), model, extra, "tokenizer")

    def _text_keys(self, padded: bytes, model: str, extra: int) -> PromptKeys:
        """Approximate keys (:func:`text_keys`) of UTF-8 text already zero-padded to 4 bytes."""
        seed = text_seed(model if self.salt_with_model else "")
        return PromptKeys(chain_keys_array(padded, self.block_size, seed), max(1, len(padded) // 4 + extra), "text")


def body_keys(path: str, body: bytes, keyer: PromptKeyer, unread_from: int = 0) -> BodyKeys | None:
    """The model and keys of an OpenAI body: ``keyer.keys(parse_body(path, body))`` with its
    ``model``, None for a path without a prompt, the same InvalidRequest for a bad body.

    The body is read natively with the GIL released where it can be (module docstring), so on a
    worker thread this runs beside the event loop: of a 1M-token ``prompt`` only the hashing of
    its 4 MiB of ids holds the GIL; with a tokenizer, the encoded ids' list and its conversion
    (the encoding itself runs without it). With ``unread_from`` > 0, a body of that many bytes
    or more that the native reader declines raises :class:`BodyNotRead` (without the extension,
    every body is read by the Python parser: there is nothing better to fall back to)."""
    endpoint = _endpoint(path)
    if endpoint is None:
        return None
    scanned = native.module.openai_prompt(body, endpoint == "chat") if native.module is not None else None
    if scanned is None:
        if unread_from and native.module is not None and len(body) >= unread_from:
            raise BodyNotRead(f"a body of {len(body)} bytes the native reader leaves to json.loads")
        parsed = parse_body(path, body)
        assert parsed is not None
        return BodyKeys(parsed.model, keyer.keys(parsed))
    model_start, model_end, is_text, payload, length = scanned
    # the one small string Python decodes: the reader checked it is a string token
    model: str = json.loads(body[model_start:model_end]) if model_start >= 0 else ""
    if not is_text:
        return BodyKeys(model, keyer._token_keys(payload, model, 0, "token_ids"))
    if keyer.tokenizer is not None:
        return BodyKeys(model, keyer._tokenized(payload[:length].decode(), endpoint, model, 0))
    return BodyKeys(model, keyer._text_keys(payload, model, 0))
