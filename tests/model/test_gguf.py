"""GGUF -> HF checkpoint conversion (`pipeserve convert-gguf`, pipeserve.model.gguf).

Fast: a demo checkpoint written as llama.cpp's converter writes a GGUF (F32,
q/k rows permuted, byte-level BPE metadata) converts back to exactly the
original tensors, config and tokenizer; unsupported files are refused by name.
Slow: the packaged SmolLM2 GGUF (Q4_1/Q8_0) converts to exactly the tensors
transformers' own GGUF reader produces, and its tokenizer gives the same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gguf_support import converted_smollm2, llama_cpp_permute, smollm2_file, write_llama_gguf
from pipeserve.cli import main
from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.gguf import convert_gguf, unpermute_rows

TEXTS = [
    "Hello world! The lighthouse keeper's cat, don't you think?",
    "  leading spaces\n\ttabs and\r\nnewlines   ",
    "Ünïcödé — 日本語のテキスト, emoji 🚀🧪, Ελληνικά",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Year 2024: 12 apples, 3.14159 and 1,000,000",
]


def test_unpermute_inverts_llama_cpps_permutation() -> None:
    for heads, head_dim in ((1, 2), (3, 8), (9, 64)):
        w = np.random.default_rng(heads).standard_normal((heads * head_dim, 5)).astype(np.float32)
        back = unpermute_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def demo_round_trip(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("gguf")
    spec = DemoSpec(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, tie_embeddings=request.param)
    hf = write_demo_model(tmp / "hf", spec)
    src = write_llama_gguf(hf, tmp / "demo.gguf")
    assert main(["convert-gguf", str(src), str(tmp / "out")]) == 0
    return hf, tmp / "out"


def test_round_trip_gives_back_every_tensor_exactly(demo_round_trip) -> None:
    hf, out = demo_round_trip
    want, got = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_round_trip_config_and_tokenizer(demo_round_trip) -> None:
    hf, out = demo_round_trip
    want, got = ModelConfig.from_dir(hf), ModelConfig.from_dir(out)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        assert getattr(got, f) == getattr(want, f), f
    for f in ("head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, f) == getattr(want, f), f
    assert got.dtype == torch.float32 and got.eos_token_ids[0] == want.eos_token_ids[0]
    tok_want = Tokenizer.from_file(str(hf / "tokenizer.json"))
    tok_got = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        ids = tok_want.encode(text, add_special_tokens=False).ids
        assert tok_got.encode(text).ids == ids, text
        assert tok_got.decode(ids, skip_special_tokens=False) == tok_want.decode(
            ids, skip_special_tokens=False
        )
    template = json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    assert (out / "chat_template.jinja").read_text() == template
    assert not list(out.parent.glob(".out.tmp-*")), "the temporary directory was left behind"


def test_refuses_what_it_cannot_convert_by_name(tmp_path: Path) -> None:
    hf = write_demo_model(
        tmp_path / "hf", DemoSpec(layers=1, hidden=32, intermediate=64, heads=2, kv_heads=2)
    )
    cases = [
        ({"arch": "gpt2"}, "'gpt2'"),
        ({"tokenizer_model": "t5"}, "'t5'"),
        ({"pre": "tekken"}, "'tekken'"),
    ]
    for i, (kwargs, name) in enumerate(cases):
        src = write_llama_gguf(hf, tmp_path / f"bad{i}.gguf", **kwargs)
        with pytest.raises(ModelLoadError, match=name):
            convert_gguf(src, tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()
    good = write_llama_gguf(hf, tmp_path / "good.gguf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_gguf(good, tmp_path / "taken")
    assert main(["convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 2
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_smollm2(tmp_path_factory.getbasetemp())


@pytest.mark.slow
def test_smollm2_config(smollm2: Path) -> None:
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (576, 30, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-05
    assert cfg["tie_word_embeddings"] and cfg["max_position_embeddings"] == 8192
    tok_cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert (tok_cfg["eos_token"], tok_cfg["bos_token"], tok_cfg["add_bos_token"]) == (
        "<|im_end|>",
        "<|im_start|>",
        False,
    )
    assert "<|im_start|>assistant" in (smollm2 / "chat_template.jinja").read_text()


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_gguf_reader(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = smollm2_file()
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    want = ref.state_dict()
    got = load_file(str(smollm2 / "model.safetensors"))
    assert sorted(got) == sorted(set(want) - {"lm_head.weight"})  # tied: lm_head is the embedding
    assert [n for n in got if got[n].dtype != torch.float32 or not torch.equal(got[n], want[n])] == []
    assert torch.equal(want["lm_head.weight"], got["model.embed_tokens.weight"])


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers_gguf_tokenizer(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    src = smollm2_file()
    ref = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    ours = AutoTokenizer.from_pretrained(smollm2)
    raw = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))  # what the router uses
    for text in TEXTS:
        want = ref(text).input_ids
        assert ours(text).input_ids == want, text
        assert raw.encode(text, add_special_tokens=False).ids == want, text
    assert raw.encode("<|im_start|>").ids == [1] and raw.encode("<|im_end|>").ids == [2]
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json: Digits, individual) isolates
    # every \\p{N} character; transformers' GGUF reader does not know "smollm" and splits like GPT-2,
    # so the two differ on a space before a non-ASCII number: " ₂" is ["Ġ", "âĤĤ"] here,
    # ["Ġâ", "Ĥ", "Ĥ"] there.
    assert [raw.id_to_token(i) for i in raw.encode(" ₂³").ids] == ["Ġ", "âĤĤ", "Â³"]
    assert raw.encode("2024").ids == [raw.token_to_id(d) for d in "2024"]
