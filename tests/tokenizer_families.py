"""Tiny tokenizers of each family, trained here, as transformers builds them, and their GGUF metadata
as llama.cpp's converter writes it (for tests/model/test_gguf_tokenizer.py).

* Byte-level BPE (`bpe_family`): Llama 3's split (PreTrainedTokenizerFast over the tokenizer.json
  Llama 3 ships: Split(regex) + ByteLevel, BOS added) and Qwen2/3's (transformers' Qwen2Tokenizer:
  NFC, its regex, no BOS), trained with `tokenizers` on CORPUS. GGUF: `gpt2` model, the pre-tokenizer
  name llama.cpp's converter finds for the family (`llama-bpe`, `qwen2`), tokens, types, merges.
* SentencePiece BPE (`spm_family`): a vocabulary as a tokenizer.model holds it (specials, the 256
  `<0xXX>` byte pieces, then pieces in the order BPE training made them, each scored minus its
  rank), and the tokenizer transformers converts it into: merges from the scores
  (transformers.tokenization_utils_base.generate_merges), LlamaTokenizer (mistral), LlamaTokenizer
  with Phi-3's Prepend normalizer (phi3), GemmaTokenizer (gemma). GGUF: `llama` model, tokens,
  scores, types (normal, unknown, control, byte) and no merges, as _set_vocab_sentencepiece writes;
  gemma's `add_space_prefix` false and its runs of spaces spelled with spaces.
"""

from __future__ import annotations

import json
from functools import cache

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPACE = "\u2581"
IM = ["<|im_start|>", "<|im_end|>"]
# Llama 3's tokenizer.json split; Qwen2's is transformers' own (Qwen2Tokenizer's PRETOKENIZE_REGEX).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_CPP_PRE = {"llama3": "llama-bpe", "qwen2": "qwen2"}  # llama.cpp's name for each family's split

_WORDS = (
    "the lighthouse keeper's cat walked along the shore and didn't stop; they'll say we've "
    "counted 12 apples, 345 pears, 2024 boats and 1000000 stars. Numbers like 3.14159, 42 and 007 "
    "recur: 123456789 0 1 2 3 4 5 6 7 8 9 10 11 100 999. Café, naïve, über, déjà vu, Ελληνικά "
    "λέξεις, русский текст, 日本語のテキスト. Indented   code\n\tif x:\n\t\treturn  y\r\n"
)
CORPUS = [
    _WORDS,
    _WORDS.upper(),
    _WORDS.replace(" ", "  "),
    *(_WORDS[i:] + _WORDS[:i] for i in range(0, 400, 37)),
]
# What the ids are compared on: special tokens, whitespace runs, digits, non-ASCII (some never seen
# in training: byte fallback / byte-level pieces), contractions in both cases.
TEXTS = [
    "Hello world! The lighthouse keeper's cat, DON'T you think? We'll see; they've gone.",
    "  leading spaces\n\ttabs and\r\nnewlines   trailing   ",
    "Ünïcödé — 日本語のテキスト, emoji 🚀🧪, Ελληνικά, Café déjà vu",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n 4<|im_end|>",
    "Year 2024: 12 apples, 3.14159 and 1,000,000 — 1234567 ₂³",
    " x",
    "e\u0301 vs \u00e9",  # decomposed and composed: NFC matters for Qwen2
]


@cache
def bpe_family(family: str):  # -> transformers tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    split = LLAMA3_SPLIT if family == "llama3" else _qwen2_split()
    tok = Tokenizer(models.BPE())
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", *IM] if family == "llama3" else ["<|endoftext|>", *IM]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if family == "qwen2":
        model = json.loads(tok.to_str())["model"]
        out = Qwen2Tokenizer(
            vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], unk_token=None,
            bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        )  # fmt: skip
        out.add_special_tokens({"additional_special_tokens": IM})
        return out
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token="<|end_of_text|>", additional_special_tokens=IM
    )


def _qwen2_split() -> str:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX


def bpe_metadata(w: gguf.GGUFWriter, family: str) -> None:
    """llama.cpp's _set_vocab_gpt2 for a family's tokenizer."""
    tok = bpe_family(family)
    backend = tok.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = set(tok.all_special_tokens)
    merges = json.loads(backend.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(LLAMA_CPP_PRE[family])
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_eos_token_id(vocab[tok.eos_token])
    if family == "llama3":
        w.add_bos_token_id(vocab[tok.bos_token])
    w.add_add_bos_token(family == "llama3")


@cache
def spm_vocab(family: str) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, types) of a SentencePiece BPE model: specials, the byte pieces, then the
    trained pieces in the order training made them, scored minus that order."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", SPACE)
    # Gemma's pieces cross spaces (runs of spaces are pieces); the others' start at a space.
    split = family != "gemma"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=split)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    trained = sorted(tok.get_vocab(), key=tok.get_vocab().__getitem__)
    if family == "gemma":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *IM]
        types = [3, 3, 3, 2, 3, 3, 3]
    else:
        specials = ["<unk>", "<s>", "</s>", *IM]
        types = [2, 3, 3, 3, 3]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256))]
    types += [6] * 256
    scores = [0.0] * len(pieces)
    for rank, piece in enumerate(p for p in trained if p not in set(pieces)):
        pieces.append(piece)
        scores.append(-float(rank))
        types.append(1)
    return pieces, scores, types


@cache
def spm_family(family: str):  # -> transformers tokenizer
    from transformers import GemmaTokenizer, LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    pieces, scores, _ = spm_vocab(family)
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = generate_merges(vocab, dict(zip(pieces, scores, strict=True)))
    if family == "gemma":
        tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    else:
        tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    if family == "phi3":  # Phi-3's tokenizer.json: the prefix space from a normalizer, no Metaspace
        tok.backend_tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        tok.backend_tokenizer.pre_tokenizer = None
    tok.add_special_tokens({"additional_special_tokens": IM})
    return tok


def spm_metadata(w: gguf.GGUFWriter, family: str) -> None:
    """llama.cpp's _set_vocab_sentencepiece (Gemma2Model/Gemma3Model: no space prefix). Gemma's
    file spells runs of spaces with spaces, and its scores do not follow its merge order (as
    transformers' GGUF reader found): here they rise with the order, only the order tells."""
    pieces, scores, types = spm_vocab(family)
    if family == "gemma":
        pieces = [" " * len(p) if len(p) > 1 and set(p) == {SPACE} else p for p in pieces]
        scores = [float(i) for i in range(len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    names = ("<bos>", "<eos>", "<unk>", "<pad>") if family == "gemma" else ("<s>", "</s>", "<unk>", None)
    bos, eos, unk, pad = (None if n is None else pieces.index(n) for n in names)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    if pad is not None:
        w.add_pad_token_id(pad)
    w.add_add_bos_token(True)
    if family == "gemma":
        w.add_add_space_prefix(False)
