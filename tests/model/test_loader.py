"""Checkpoint loading: sharded files, tied heads, rope scaling, mistral, dtypes, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, hf_logits, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.loader import balanced_layer_split, read_stage_tensors
from pipeserve.model.stage_model import StageSpec

PROMPT = random_prompts(1, 150, 150, 1024, seed=40)[0]


def _variant(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _greedy(path: Path, prompt: list[int], n: int = 20, **kw) -> list[int]:
    llm = LLM(str(path), max_model_len=512, num_kv_blocks=64, **kw)
    return (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )


def test_sharded_checkpoint_matches_single_file(llama_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    shutil.copytree(llama_dir, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert _greedy(dst, PROMPT) == hf_greedy(llama_dir, PROMPT, 20, ignore_eos=True)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors is missing"):
        _greedy(dst, PROMPT)


def test_tied_embeddings_match_hf(tmp_path: Path) -> None:
    path = write_demo_model(tmp_path / "tied", DemoSpec(tie_embeddings=True, layers=2))
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    assert _greedy(path, PROMPT) == hf_greedy(path, PROMPT, 20, ignore_eos=True)


@pytest.mark.parametrize(
    "changes",
    [
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ],
    ids=["llama3", "linear", "yarn"],
)
def test_rope_scaling_matches_hf(llama_dir: Path, tmp_path: Path, changes: dict) -> None:
    path = _variant(llama_dir, tmp_path / "rope", **changes)
    ours = _greedy(path, PROMPT)
    assert ours == hf_greedy(path, PROMPT, 20, ignore_eos=True)
    assert ours != hf_greedy(llama_dir, PROMPT, 20, ignore_eos=True), "scaling changed nothing"


def test_mistral_matches_hf(llama_dir: Path, tmp_path: Path) -> None:
    path = _variant(
        llama_dir,
        tmp_path / "mistral",
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        sliding_window=None,
    )
    assert ModelConfig.from_dir(path).model_type == "mistral"
    assert _greedy(path, PROMPT) == hf_greedy(path, PROMPT, 20, ignore_eos=True)


def test_mistral_sliding_window_caps_nothing(llama_dir: Path, tmp_path: Path) -> None:
    """The kernels apply the window per layer (tests/model/test_window.py): the context stays whole."""
    path = _variant(llama_dir, tmp_path / "mistral-sw", model_type="mistral", sliding_window=256)
    llm = LLM(str(path), num_kv_blocks=128)
    assert llm.engine.max_model_len == ModelConfig.from_dir(path).max_position_embeddings > 256


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_load_and_run(llama_dir: Path, dtype: str) -> None:
    llm = LLM(str(llama_dir), dtype=dtype, max_model_len=256, num_kv_blocks=32)
    assert llm.engine.executor.runner.kv_pool.dtype == getattr(torch, dtype)
    assert next(llm.engine.executor.runner.model.parameters()).dtype == getattr(torch, dtype)
    out = llm.generate([PROMPT[:40]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    # Low precision still tracks float32 on the first token (logits are far apart by design).
    assert out.outputs[0].token_ids[0] == int(hf_logits(llama_dir, PROMPT[:40]).argmax())


def test_stage_reads_only_its_tensors(llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    splits = balanced_layer_split(cfg.num_layers, 2)
    assert splits == [(0, 2), (2, 4)]
    first = read_stage_tensors(llama_dir, cfg, StageSpec(0, 2, *splits[0]))
    last = read_stage_tensors(llama_dir, cfg, StageSpec(1, 2, *splits[1]))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert (
        "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    )
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"2", "3"}
    assert balanced_layer_split(5, 3) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ModelLoadError, match="each stage needs a layer"):
        balanced_layer_split(2, 3)


def test_clear_errors(llama_dir: Path, tmp_path: Path) -> None:
    gpt = _variant(llama_dir, tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'; supported: llama, .*phi3"):
        LLM(str(gpt))
    rope = _variant(llama_dir, tmp_path / "dynamic", rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelLoadError, match=r"unsupported rope type 'dynamic'; supported: .*yarn"):
        LLM(str(rope))
    yarn = _variant(llama_dir, tmp_path / "yarn", rope_scaling={"type": "yarn"})
    with pytest.raises(ModelLoadError, match="rope type 'yarn' lacks factor"):
        LLM(str(yarn))
    noweights = _variant(llama_dir, tmp_path / "noweights")
    (noweights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"expected model.safetensors or model.safetensors.index.json"):
        LLM(str(noweights))
    partial = _variant(llama_dir, tmp_path / "partial")
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"lacks tensors: model.layers.3.mlp.up_proj.weight"):
        LLM(str(partial))
    wrong = _variant(llama_dir, tmp_path / "wrong", intermediate_size=100)
    with pytest.raises(ModelLoadError, match="shape mismatch"):
        LLM(str(wrong))
