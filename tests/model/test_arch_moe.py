"""qwen3_moe and mixtral (arch/qwen3_moe.py, arch/mixtral.py, arch/routed.py): routed experts on
the registry, greedy token for token against transformers in float32.

The checkpoints are transformers' own (arch_support.py: 4 experts, top-2, hidden 64, 4 layers;
qwen3_moe's layer 2 keeps its dense MLP). transformers' save_pretrained writes the per-expert
layout; the fused layout of transformers 5 is written with save_original_format=False. The S=1..3
pipeline runs are in tests/ring/test_pipeline_correctness.py, mixed batches, chunked prefill, prefix
hits and preemption in tests/engine/test_engine_correctness.py (ARCH_FIXTURES).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arch_support import write_hf_checkpoint
from safetensors import safe_open

from conftest import hf_greedy, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import MLP
from pipeserve.model.loader import load_stage_model, stage_tensor_names
from pipeserve.model.moe import SparseMoE
from pipeserve.model.quant import native_kernels
from pipeserve.model.stage_model import StageSpec

PROMPTS = random_prompts(3, 4, 30, 1024, seed=61)


def _greedy(path: Path, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _hf(path: Path, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    return [hf_greedy(path, p, n, ignore_eos=True) for p in prompts]


def _names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _stage(path: Path, rank: int = 0, world: int = 1):
    cfg = ModelConfig.from_dir(path, "float32")
    lo, hi = (0, 4) if world == 1 else [(0, 2), (2, 4)][rank]
    return load_stage_model(path, cfg, StageSpec(rank, world, lo, hi), 128, torch.device("cpu"))


def test_qwen3_moe_matches_hf_with_a_dense_layer(qwen3_moe_dir: Path) -> None:
    model = _stage(qwen3_moe_dir)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [SparseMoE, SparseMoE, MLP, SparseMoE]  # mlp_only_layers = [2]
    assert all(layer.mlp.gate.renormalize for i, layer in enumerate(model.layers) if i != 2)
    assert _greedy(qwen3_moe_dir, PROMPTS) == _hf(qwen3_moe_dir, PROMPTS)


def test_qwen3_moe_unnormalized_and_sparse_step_match_hf(tmp_path: Path) -> None:
    """norm_topk_prob off (Qwen3MoeConfig's default) and experts on every other layer."""
    path = write_hf_checkpoint(
        tmp_path / "q", "qwen3_moe", norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]
    )
    kinds = [type(layer.mlp) for layer in _stage(path).layers]
    assert kinds == [MLP, SparseMoE, MLP, SparseMoE]  # (i + 1) % 2 == 0
    assert _greedy(path, PROMPTS) == _hf(path, PROMPTS)


def test_mixtral_matches_hf(mixtral_dir: Path) -> None:
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in _names(mixtral_dir)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in _stage(mixtral_dir).layers)
    assert _greedy(mixtral_dir, PROMPTS) == _hf(mixtral_dir, PROMPTS)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_fused_layout_of_transformers_5_is_read_too(
    request: pytest.FixtureRequest, arch: str, tmp_path: Path
) -> None:
    """The same weights saved fused (`mlp.experts.gate_up_proj`, `mlp.gate.weight`) give the same
    parameters and tokens as the per-expert checkpoint."""
    from transformers import AutoModelForCausalLM

    src: Path = request.getfixturevalue(f"{arch}_dir")
    fused = tmp_path / "fused"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(
        fused, save_original_format=False
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (fused / name).write_bytes((src / name).read_bytes())
    names = _names(fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in names)
    ours, theirs = _stage(fused).state_dict(), _stage(src).state_dict()
    for key in (
        "layers.0.mlp.experts.gate_up_proj",
        "layers.0.mlp.experts.down_proj",
        "layers.0.mlp.gate.weight",
    ):
        assert torch.equal(ours[key], theirs[key])
    assert _greedy(fused, PROMPTS[:1]) == _hf(src, PROMPTS[:1])


def test_experts_live_in_the_stage_that_owns_the_layer(mixtral_dir: Path) -> None:
    cfg = ModelConfig.from_dir(mixtral_dir)
    present = _names(mixtral_dir)
    second = stage_tensor_names(cfg, StageSpec(1, 2, 2, 4), present)
    experts = [n for n in second if ".experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers 2 and 3, 4 experts, w1 w3 w2
    assert all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in experts)
    model = _stage(mixtral_dir, 1, 2)
    assert [tuple(layer.mlp.experts.gate_up_proj.shape) for layer in model.layers] == [(4, 64, 64)] * 2


def test_the_native_decode_step_falls_back_once_for_routed_experts(
    qwen3_moe_dir: Path, mixtral_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if native_kernels() is None:
        pytest.skip("the native kernels do not build on this CPU")
    with caplog.at_level(logging.INFO, logger="pipeserve.model.stage_model"):
        models = [_stage(mixtral_dir), _stage(qwen3_moe_dir)]
    gaps = [r.getMessage() for r in caplog.records if "native decode step lacks" in r.getMessage()]
    assert all(m.native is None for m in models)
    assert gaps == [
        "stage 0: decode steps run the PyTorch layers: the native decode step lacks routed experts (mixtral)",
        "stage 0: decode steps run the PyTorch layers: the native decode step lacks routed experts, "
        "q/k RMSNorm (qwen3_moe)",
    ]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_the_triton_path_runs_the_routed_experts(tmp_path: Path, model_type: str) -> None:
    """Every kernel op through Triton (interpreter mode, tests/kernels/engine_run.py's process), the
    experts' dispatch in PyTorch around them (unsupported["triton"]); chunked prefill over a cached
    prefix. The ids are transformers'."""
    path = write_hf_checkpoint(tmp_path / model_type, model_type, num_hidden_layers=2)
    prompts = [[5], [1, 2, 3, 4, 5], *random_prompts(1, 26, 26, 1024, seed=12)]
    run = Path(__file__).resolve().parents[1] / "kernels" / "engine_run.py"
    env = {**os.environ, "PIPESERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(run), str(path), "1", json.dumps(prompts), "6"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton"
    assert out["ids"] == _hf(path, prompts, 6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok 5 must be in 1\.\.the number of experts \(4\)"),
        ({"num_experts": 0}, "qwen3_moe needs num_experts, decoder_sparse_step > 0, not 0, 1"),
        ({"decoder_sparse_step": 0}, "qwen3_moe needs num_experts, decoder_sparse_step > 0, not 4, 0"),
    ],
)
def test_bad_moe_configs_are_clear_errors(changes: dict, message: str) -> None:
    raw = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8}
    raw.update(num_hidden_layers=2, num_attention_heads=4, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict({**raw, **changes})
