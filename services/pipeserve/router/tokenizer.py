"""The checkpoint's tokenizer and chat template, as the router uses them.

`TokenizerAssets.load(model_dir)` reads `tokenizer.json` (required) and the
`chat_template` of `tokenizer_config.json` (optional; without it chat requests
are a 400). Text is encoded without adding special tokens beyond what the
text or the template spells out (a rendered ChatML prompt already carries its
`<|im_start|>` markers, which the tokenizer matches as added tokens).

The template runs in jinja2's immutable sandbox, as transformers does: a chat
request cannot reach Python objects through it, and `raise_exception(msg)` in
a template becomes a 400 naming `messages`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

from pipeserve.errors import InvalidRequestError


class TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


def _special(cfg: dict, key: str) -> str:
    value = cfg.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


class TokenizerAssets:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self._template: jinja2.Template | None = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)
        # Byte-level BPE stores each byte as one printable character; invert that map to
        # report a token's exact bytes (a token may hold part of a UTF-8 character).
        self._byte_of: dict[str, int] | None = None
        if isinstance(tokenizer.decoder, decoders.ByteLevel):
            self._byte_of = _byte_decoder()
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)

    @classmethod
    def load(cls, model_dir: str | Path) -> TokenizerAssets:
        d = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text("utf-8")) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        special = {k: _special(cfg, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tokenizer, template if isinstance(template, str) else None, special)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        if self._template is None:
            raise InvalidRequestError("messages", "this model has no chat template; use /v1/completions")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise InvalidRequestError("messages", str(e)) from None
        except jinja2.TemplateError as e:
            raise InvalidRequestError("messages", f"chat template failed: {e}") from None

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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, inverted: byte-level symbol -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in symbols]
    symbols.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {ch: b for b, ch in symbols.items()}
