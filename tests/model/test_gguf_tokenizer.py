"""The tokenizer rebuilt from a GGUF file's metadata (model/gguf_tokenizer.py) gives the family's
transformers tokenizer's ids, special tokens and BOS included, on text with special tokens,
whitespace runs, digits and non-ASCII (tokenizer_families.TEXTS).

Families (tokenizer_families.py: trained here, built as transformers builds them, written into the
GGUF as llama.cpp's converter writes them): byte-level BPE with Llama 3's and Qwen2/3's
pre-tokenizers (`tokenizer.ggml.pre` llama-bpe, qwen2), SentencePiece BPE as Mistral (llama),
Phi-3 (phi3) and Gemma (gemma2) files hold it (scores, byte pieces, no merges). The file is read
back with gguf-py and the tokenizer files written as `convert-gguf` writes them; both the raw
tokenizer.json (what the router uses) and transformers' AutoTokenizer over the directory are checked.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizer_families import TEXTS, bpe_family, bpe_metadata, spm_family, spm_metadata
from tokenizers import Tokenizer

from pipeserve.errors import ModelLoadError
from pipeserve.model.gguf import metadata, open_gguf
from pipeserve.model.gguf_tokenizer import build_tokenizer, write_tokenizer_files

# family -> (llama.cpp architecture of its files, byte-level or SentencePiece)
FAMILIES = {
    "llama3": ("llama", "bpe"),
    "qwen2": ("qwen3", "bpe"),
    "mistral": ("llama", "spm"),
    "phi3": ("phi3", "spm"),
    "gemma": ("gemma2", "spm"),
}


def _gguf_meta(tmp: Path, family: str) -> dict:
    arch, kind = FAMILIES[family]
    w = gguf.GGUFWriter(tmp / f"{family}.gguf", arch)
    (bpe_metadata if kind == "bpe" else spm_metadata)(w, family)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return metadata(open_gguf(tmp / f"{family}.gguf"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_tokenizer_gives_the_familys_ids(tmp_path: Path, family: str) -> None:
    from transformers import AutoTokenizer

    want = bpe_family(family) if FAMILIES[family][1] == "bpe" else spm_family(family)
    meta = _gguf_meta(tmp_path, family)
    write_tokenizer_files(tmp_path, meta, 512)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = want(text).input_ids
        assert raw.encode(text).ids == ids, (text, [raw.id_to_token(i) for i in raw.encode(text).ids])
        assert auto(text).input_ids == ids, text
        assert raw.decode(ids, skip_special_tokens=False) == want.decode(ids, skip_special_tokens=False)
    assert raw.get_vocab_size() == len(meta["tokenizer.ggml.tokens"])


def test_the_pre_tokenizers_differ_on_the_texts(tmp_path: Path) -> None:
    """The families' splits are not interchangeable: the same vocabulary under the other family's
    pre-tokenizer gives other ids (what a pre-tokenizer read wrong would do)."""
    meta = _gguf_meta(tmp_path, "llama3")
    ours = build_tokenizer(meta)
    for other in ("qwen2", "gpt2"):
        swapped = build_tokenizer({**meta, "tokenizer.ggml.pre": other})
        assert any(ours.encode(t).ids != swapped.encode(t).ids for t in TEXTS), other


def test_llama_cpps_names_of_gpt2s_split_are_gpt2s(tmp_path: Path) -> None:
    """llama.cpp's converter names GPT-2's pre-tokenizer "gpt-2" (Phi-2's "phi-2"): the same ids."""
    meta = _gguf_meta(tmp_path, "llama3")
    gpt2 = build_tokenizer({**meta, "tokenizer.ggml.pre": "gpt2"})
    for name in ("gpt-2", "phi-2"):
        named = build_tokenizer({**meta, "tokenizer.ggml.pre": name})
        assert [named.encode(t).ids for t in TEXTS] == [gpt2.encode(t).ids for t in TEXTS], name


def test_unsupported_tokenizers_are_refused_by_name(tmp_path: Path) -> None:
    meta = _gguf_meta(tmp_path, "llama3")
    with pytest.raises(ModelLoadError, match=r"pre-tokenizer 'tekken'; supported: .*llama-bpe.*qwen2"):
        build_tokenizer({**meta, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(ModelLoadError, match=r"tokenizer model 't5'; supported: 'gpt2' .*'llama'"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "t5"})
    spm = _gguf_meta(tmp_path, "mistral")
    with pytest.raises(ModelLoadError, match="scores for"):
        build_tokenizer({**spm, "tokenizer.ggml.scores": []})


def test_a_sentencepiece_file_without_the_flag_adds_bos(tmp_path: Path) -> None:
    """llama.cpp (and transformers' GGUF reader) add BOS to a SentencePiece vocabulary that does not
    say otherwise; a byte-level one adds none."""
    spm = _gguf_meta(tmp_path, "mistral")
    del spm["tokenizer.ggml.add_bos_token"]
    bos = spm["tokenizer.ggml.bos_token_id"]
    assert build_tokenizer(spm).encode("hi").ids[0] == bos
    bpe = _gguf_meta(tmp_path, "llama3")
    del bpe["tokenizer.ggml.add_bos_token"]
    assert build_tokenizer(bpe).encode("hi").ids[0] != bpe["tokenizer.ggml.bos_token_id"]
