"""The tokenizer files of an HF checkpoint, rebuilt from a GGUF file's tokenizer metadata.

A GGUF has no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`),
the BPE merges or SentencePiece scores, per-token types and the special token ids under llama.cpp's
key names. `write_tokenizer_files` turns them into `tokenizer.json` (built with
the `tokenizers` library), `tokenizer_config.json` and `chat_template.jinja`.

Contract: the ids are those of the family's transformers tokenizer (what the model was trained on).
* `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges, split first by the
  pre-tokenizer `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`: llama.cpp's names for GPT-2's,
  SmolLM's, Llama 3's and Qwen2/3's splits; Qwen2's tokenizer also NFC-normalizes).
* `tokenizer.ggml.model == "llama"`: SentencePiece BPE (Llama 2, Mistral, Phi-3, Gemma) as
  transformers builds it from a `tokenizer.model`: BPE with byte fallback (`<0x41>` tokens) and
  merges recovered from the pieces' scores (the file has none; Gemma's by the pieces' order, which
  its scores do not follow), `▁` for spaces. The prefix space follows the family's tokenizer.json:
  none where `tokenizer.ggml.add_space_prefix` is false (Gemma), a `▁` before each text segment for
  phi3 (a Prepend normalizer), before the text's start only for the others (LlamaTokenizer's
  Metaspace). Gemma files spell pieces of two or more spaces with real spaces: they are read as `▁`s.
* Any other model or pre-tokenizer is a ModelLoadError naming the supported ones, never a tokenizer
  that silently splits text differently from the one the model was trained on.
* Token ids are the file's: the vocabulary keeps the file's order (byte-level tokens are already
  spelled in GPT-2's byte alphabet), so the engine's embedding rows and the tokenizer agree.
* CONTROL tokens (type 3, and SentencePiece's UNKNOWN, 2) are special added tokens (matched whole,
  skipped when decoding with skip_special_tokens); USER_DEFINED tokens (type 4) are plain added
  tokens (matched whole), as llama.cpp treats them.
* `tokenizer.ggml.add_bos_token` (and add_eos_token) become the post-processor, so
  `encode(text, add_special_tokens=True)` adds what llama.cpp adds; a SentencePiece file without
  the flag adds BOS (llama.cpp's default).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from pipeserve.errors import ModelLoadError

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SPACE = "\u2581"  # SentencePiece's space

# GPT-2's split (what ByteLevel(use_regex=True) applies), optionally after llama.cpp's extra splits.
_GPT2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
# The splits of Llama 3's and Qwen2's tokenizer.json (llama.cpp: LLAMA3 and QWEN2 in llama-vocab.cpp):
# contractions, letters with one leading non-letter, digits in threes (Llama 3) or one by one (Qwen2).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS = {
    # "gpt-2" (and "phi-2"): what llama.cpp's converter names GPT-2's split (its GPT2 pre type), as in
    # files llama-quantize makes from a GPT-2-tokenized checkpoint; "gpt2": pipeserve's own writer.
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2"), lambda: _GPT2),
    # llama.cpp's "smollm": every digit on its own (`\p{N}`), then GPT-2's regex.
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), _GPT2]
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), lambda: _split_then_bytes(_LLAMA3)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), lambda: _split_then_bytes(_QWEN2)),
}
NFC_PRE = ("qwen2", "deepseek-r1-qwen")  # Qwen2Tokenizer normalizes to NFC first
MODELS = ("gpt2", "llama")
GEMMA_ARCHES = ("gemma", "gemma2", "gemma3")


def build_tokenizer(meta: dict) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE)"
        )
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens or len(set(tokens)) != len(tokens):
        raise ModelLoadError("GGUF tokenizer vocabulary is empty or has duplicate tokens")
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    if types and len(types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer: {len(types)} token types for {len(tokens)} tokens")
    tok = _byte_level(meta, tokens) if model == "gpt2" else _sentencepiece(meta, tokens)
    specials = (CONTROL,) if model == "gpt2" else (CONTROL, UNKNOWN)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k in specials
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


def _byte_level(meta: dict, tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre in NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces,
    best rank first (then the longer left part), as transformers derives them from a
    tokenizer.model; merging by them is SentencePiece's (and llama.cpp's) highest-score-first merge."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                found.append((-rank[i], -len(left), -len(right), i, ids[left], ids[right], left, right))
    return [(f[6], f[7]) for f in sorted(found)]


def _sentencepiece(meta: dict, tokens: list[str]) -> Tokenizer:
    arch = meta.get("general.architecture")
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if arch in GEMMA_ARCHES:  # runs of spaces stored as spaces; merges in the pieces' order
        tokens = [SPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
        rank = [-float(i) for i in range(len(tokens))]
    else:
        rank = [float(x) for x in meta.get("tokenizer.ggml.scores") or []]
        if len(rank) != len(tokens):
            raise ModelLoadError(f"GGUF tokenizer: {len(rank)} scores for {len(tokens)} SentencePiece tokens")
    merges = meta.get("tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else spm_merges(tokens, rank)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=pairs,
            unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if not prefix:
        tok.normalizer = normalizers.Replace(" ", SPACE)
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def add_bos(meta: dict) -> bool:
    """llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _post_processor(meta: dict, tokens: list[str]) -> processors.PostProcessor:
    single, pair, specials = ["$A"], ["$A", "$B:1"], []
    for flag, key, first in (
        ("add_bos_token", "bos_token_id", True),
        ("add_eos_token", "eos_token_id", False),
    ):
        if not (add_bos(meta) if first else meta.get(f"tokenizer.ggml.{flag}", False)):
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
        "add_bos_token": add_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        (out / "chat_template.jinja").write_text(template)
