"""The checkpoint's tokenizer and chat template, as the router and the offline LLM use them.

`TokenizerAssets.load(model_dir, chat_template=None)` reads `tokenizer.json`
(required) and the chat template, found as transformers (>= 4.43, and 5)
finds it: `chat_template.jinja` first, else the `chat_template` of
`tokenizer_config.json` (a string, or a list of named templates whose
"default" is used). `chat_template` given here (`--chat-template`: a file
path or the template text, as vLLM takes it) overrides both. Without any
template, chat is an InvalidRequestError (a 400 naming `messages`).

Encoding follows transformers and vLLM: `encode(text, add_special_tokens=True)`
runs the tokenizer's post-processor (a Llama-3-style template adds the BOS),
as `tokenizer(text)` does; a rendered chat prompt is encoded with
add_special_tokens=False, as `apply_chat_template(tokenize=True)` does (the
template already wrote the BOS). Encoding goes through `encode_batch`, which
releases the GIL, so a tokenization in a worker thread does not stall the
event loop.

`max_prompt_bytes(max_model_len)` is a sound cheap pre-check: no text longer
than that many UTF-8 bytes fits in the context (see its docstring), so such
a prompt is refused without tokenizing it.

The template is rendered as transformers' `apply_chat_template` renders it
(pipeserve/chat_template.py: jinja2's immutable sandbox, the same variables,
filters and globals, chat_template_kwargs, continue_final_message);
`raise_exception(msg)` in a template becomes a 400 naming `messages`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer, decoders

from pipeserve import chat_template as chat
from pipeserve.errors import InvalidRequestError

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _special(cfg: dict, key: str) -> str:
    value = cfg.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def find_chat_template(model_dir: Path, cfg: dict, override: str | None) -> str | None:
    """The template text: the override (a file path or the text), chat_template.jinja, or the config's."""
    if override:
        path = Path(override)
        try:
            is_file = len(override) < 4096 and "\n" not in override and path.is_file()
        except OSError:  # a template text that is not a valid path name
            is_file = False
        return path.read_text("utf-8") if is_file else override
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text("utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


class TokenizerAssets:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._template: jinja2.Template | None = None
        self.chat_template = chat_template
        if chat_template:
            self._template = chat.compile_template(chat_template)
        # Byte-level BPE stores each byte as one printable character; invert that map to
        # report a token's exact bytes (a token may hold part of a UTF-8 character).
        self._byte_of: dict[str, int] | None = None
        if isinstance(tokenizer.decoder, decoders.ByteLevel):
            self._byte_of = _byte_decoder()
        self._bytes_per_token = _bytes_per_token_bound(tokenizer)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)

    @classmethod
    def load(cls, model_dir: str | Path, chat_template: str | None = None) -> TokenizerAssets:
        d = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text("utf-8")) if cfg_path.is_file() else {}
        special = {k: _special(cfg, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tokenizer, find_chat_template(d, cfg, chat_template), special)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): other threads run meanwhile.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_prompt(self, text: str, add_special_tokens: bool, max_model_len: int, param: str) -> list[int]:
        """Tokenize a prompt, refusing first (InvalidRequestError naming `param`) what certainly
        cannot fit in max_model_len tokens, by its length alone: a 15 MB text is never tokenized."""
        limit = self.max_prompt_bytes(max_model_len)
        size = len(text)  # characters: a lower bound of the UTF-8 bytes, and enough when over the limit
        if (limit is None or size <= limit) and not text.isascii():
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError as e:  # a lone surrogate (from a field a chat template wrote)
                raise InvalidRequestError(
                    param, f"contains a lone surrogate at character {e.start}"
                ) from None
        if limit is not None and size > limit:
            raise InvalidRequestError(
                param,
                f"This model's maximum context length is {max_model_len} tokens, and the prompt is at "
                f"least {size} bytes of text: more than {max_model_len} tokens can hold ({limit} bytes).",
            )
        return self.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decoder(self, keep: tuple[str, ...]) -> Callable[[list[int]], str]:
        """`decode`, but the special tokens whose text is in `keep` stay in the text (a tool or
        reasoning parser's tags: mistral's `[TOOL_CALLS]`). vLLM turns skip_special_tokens off for
        such parsers; dropping every other special token keeps the end-of-turn token out, as
        vLLM's detokenizer leaves the stop token out."""
        special = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        drop = frozenset(i for i, text in special.items() if text not in keep)
        if len(drop) == len(special):
            return self.decode

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)

        return decode

    def max_prompt_bytes(self, max_model_len: int) -> int | None:
        """A text longer than this (UTF-8 bytes) cannot fit in max_model_len tokens; None: no sound bound.

        Sound because each token of the encoding covers at most `bytes_per_token` bytes of the
        text: the tokenizer loses nothing (byte-level BPE, or byte fallback) and its normalizer
        shrinks text by at most the factor counted in `_bytes_per_token_bound`.
        """
        return None if self._bytes_per_token is None else max_model_len * self._bytes_per_token

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt `apply_chat_template(messages, tools=tools, add_generation_prompt=...,
        continue_final_message=..., **template_kwargs)` renders (pipeserve/chat_template.py)."""
        if self._template is None or self.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
        return chat.render(
            self._template,
            self.chat_template,
            messages,
            tools,
            self.special,
            add_generation_prompt,
            continue_final_message,
            template_kwargs,
        )

    def _token_text(self, token_id: int) -> str:
        """The token as text; part of a UTF-8 character reads `bytes:\\xe4\\xbd` (as OpenAI does)."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            raw = self._token_bytes(token_id)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and self._byte_of is not None and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


# Most a normalizer can shrink UTF-8 text by. NFC/NFKC compose: the worst case is a Hangul
# syllable, three 3-byte jamo -> one 3-byte syllable. Replace/Prepend as Llama-2/Mistral use
# them (" " -> "▁", prepend "▁") only grow the text. Anything else (Strip, a Replace with a
# shorter content...) may shrink it without bound: no pre-check then.
_SHRINK = {"NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 3, "Prepend": 1}


def _shrink_factor(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for n in normalizer.get("normalizers", []):
            f = _shrink_factor(n)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = normalizer.get("pattern", {}).get("String")
        content = normalizer.get("content", "")
        ok = isinstance(pattern, str) and len(content.encode()) >= len(pattern.encode()) > 0
        return 1 if ok else None
    return _SHRINK.get(kind) if isinstance(kind, str) else None


def _byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def _bytes_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """Most UTF-8 bytes of input text one token can stand for, or None when that is unbounded.

    A BPE model whose every byte has a token (byte-level, or byte_fallback) maps every piece of
    the normalized text to tokens whose pieces are at least as long in UTF-8 as what they cover
    (a byte-level symbol is 1-2 UTF-8 bytes for one input byte; "▁" is 3 bytes for a space;
    "<0xE4>" is 6 for one byte; an added token is its own text). Other models can map unbounded
    text to one `<unk>`.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not (
        _byte_level(spec.get("pre_tokenizer")) or model.get("byte_fallback")
    ):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None:
        return None
    longest = max((len(p.encode("utf-8")) for p in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return longest * factor


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: byte-level symbol -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in symbols]
    symbols.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {ch: b for b, ch in symbols.items()}
