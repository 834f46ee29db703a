"""The tokenizer files of an HF checkpoint, rebuilt from a GGUF file's tokenizer metadata.

A GGUF has no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`),
the BPE merges, per-token types and the special token ids under llama.cpp's
key names. `write_tokenizer_files` turns them into `tokenizer.json` (built with
the `tokenizers` library), `tokenizer_config.json` and `chat_template.jinja`.

Contract:
* Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported, and only
  the pre-tokenizers in `PRE_TOKENIZERS` (named by `tokenizer.ggml.pre`); any
  other model or pre-tokenizer is a ModelLoadError naming it, never a tokenizer
  that silently splits text differently from the one the model was trained on.
* Token ids are the file's: the vocabulary keeps the file's order and spelling
  (byte-level tokens are already spelled in GPT-2's byte alphabet), so the
  engine's embedding rows and the tokenizer agree.
* CONTROL tokens (type 3) are special added tokens (matched whole, skipped when
  decoding with skip_special_tokens); USER_DEFINED tokens (type 4) are plain
  added tokens (matched whole), as llama.cpp treats them.
* `tokenizer.ggml.add_bos_token` (and add_eos_token) become the post-processor,
  so `encode(text, add_special_tokens=True)` adds what llama.cpp adds.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pipeserve.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4

# GPT-2's split (what ByteLevel(use_regex=True) applies), optionally after llama.cpp's extra splits.
_GPT2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
PRE_TOKENIZERS = {
    "gpt2": lambda: _GPT2,
    # llama.cpp's "smollm": every digit on its own (`\p{N}`), then GPT-2's regex.
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), _GPT2]
    ),
}


def build_tokenizer(meta: dict) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    if not tokens or len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer vocabulary is empty or has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer: {len(types)} token types for {len(tokens)} tokens")
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED
        ]
    )
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelLoadError("GGUF tokenizer: added tokens changed the vocabulary size")
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _post_processor(meta: dict, tokens: list[str]) -> processors.PostProcessor:
    single, pair, specials = ["$A"], ["$A", "$B:1"], []
    for flag, key, first in (
        ("add_bos_token", "bos_token_id", True),
        ("add_eos_token", "eos_token_id", False),
    ):
        if not meta.get(f"tokenizer.ggml.{flag}", False):
            continue
        tid = meta.get(f"tokenizer.ggml.{key}")
        if tid is None or not 0 <= tid < len(tokens):
            raise ModelLoadError(f"GGUF tokenizer: {flag} is set but {key} is missing or out of range")
        text = tokens[tid]
        specials.append((text, tid))
        if first:
            single, pair = [text, *single], [text, "$A", text, "$B:1"]
        else:
            single, pair = [*single, text], [*pair, text]
    if not specials:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token(meta: dict, tokens: list[str], key: str) -> str | None:
    tid = meta.get(f"tokenizer.ggml.{key}")
    return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None


def write_tokenizer_files(out: Path, meta: dict, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and (when the file has one) chat_template.jinja into `out`."""
    tok = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    tokens = list(meta["tokenizer.ggml.tokens"])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, tokens, "bos_token_id"),
        "eos_token": _token(meta, tokens, "eos_token_id"),
        "pad_token": _token(meta, tokens, "padding_token_id"),
        "unk_token": _token(meta, tokens, "unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)
