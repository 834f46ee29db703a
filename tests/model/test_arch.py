"""The architecture registry (model/arch/) and what its newer entries add: qwen3's q/k norms and
free head_dim, phi3's fused checkpoint tensors, longrope and partial rotary, YaRN on qwen3.

Checkpoints are created by transformers (arch_support.py); each result is transformers' greedy
continuation, token for token, in float32. The S=1..3 pipeline and engine workloads run on the
same checkpoints in tests/ring/test_pipeline_correctness.py and tests/engine/.
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

from conftest import hf_greedy, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import REGISTRY, SUPPORTED_MODEL_TYPES, get_arch
from pipeserve.model.config import ModelConfig
from pipeserve.model.loader import load_stage_model
from pipeserve.model.quant import native_kernels
from pipeserve.model.stage_model import StageSpec

PROMPTS = random_prompts(3, 4, 30, 1024, seed=60)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# Phi-4-mini's form: half of each head rotates; 4 factors for its 8 rotary features.
LONGROPE = {
    "partial_rotary_factor": 0.5,
    "original_max_position_embeddings": 64,
    "max_position_embeddings": 256,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0, 1.5, 2.5, 4.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0],
    },
}


def _greedy(path: Path, prompts: list[list[int]], n: int = 16, **kw) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=64, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _hf(path: Path, prompts: list[list[int]], n: int = 16) -> list[list[int]]:
    return [hf_greedy(path, p, n, ignore_eos=True) for p in prompts]


def test_every_registered_module_is_its_transformers_architecture() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(REGISTRY) == set(SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2", "qwen3", "phi3"}
    for model_type in SUPPORTED_MODEL_TYPES:
        arch = get_arch(model_type)
        assert arch.model_type == model_type
        assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] == arch.hf_class
    for bad in ("gpt2", None, 3):
        with pytest.raises(ModelLoadError, match=r"unsupported model_type .*; supported: llama, mistral"):
            get_arch(bad)


def test_qwen3_head_dim_and_qk_norm_match_hf(qwen3_dir: Path) -> None:
    cfg = ModelConfig.from_dir(qwen3_dir)
    assert cfg.qk_norm and cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    assert not cfg.attention_bias and not cfg.attention_out_bias
    assert _greedy(qwen3_dir, PROMPTS) == _hf(qwen3_dir, PROMPTS)


def test_phi3_reads_its_fused_tensors(phi3_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(phi3_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in names
        and "model.layers.0.mlp.gate_up_proj.weight" in names
    )
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    assert _greedy(phi3_dir, PROMPTS) == _hf(phi3_dir, PROMPTS)


def test_phi3_longrope_and_partial_rotary_match_hf_up_to_the_original_length(tmp_path: Path) -> None:
    path = write_hf_checkpoint(tmp_path / "longrope", "phi3", **LONGROPE)
    plain = write_hf_checkpoint(tmp_path / "plain", "phi3", partial_rotary_factor=0.5)
    cfg = ModelConfig.from_dir(path)
    assert cfg.rotary_dim == 8 and cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "longrope"
    llm = LLM(str(path), num_kv_blocks=16)
    assert llm.engine.max_model_len == 64  # the original length: longrope's short factors are exact
    prompts = [p[:24] for p in PROMPTS]
    n = 64 - 24
    ours = _greedy(path, prompts, n)
    assert ours == _hf(path, prompts, n)
    assert ours != _hf(plain, prompts, n), "the rope scaling changed nothing"
    assert _greedy(plain, prompts, n) == _hf(plain, prompts, n)


def test_longrope_refuses_factors_of_the_wrong_length(tmp_path: Path) -> None:
    bad = dict(LONGROPE, rope_scaling={**LONGROPE["rope_scaling"], "short_factor": [1.0, 2.0]})
    raw = {"model_type": "phi3", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8}
    raw.update(num_hidden_layers=1, num_attention_heads=4, **bad)
    with pytest.raises(ModelLoadError, match="longrope short_factor has 2 values for 4 frequencies"):
        ModelConfig.from_dict(raw)


def test_qwen3_yarn_matches_hf(tmp_path: Path, qwen3_dir: Path) -> None:
    path = write_hf_checkpoint(tmp_path / "yarn", "qwen3", rope_scaling=YARN)
    prompts = [p + p for p in PROMPTS]  # past the original 64 positions, where YaRN interpolates
    ours = _greedy(path, prompts, 24)
    assert ours == _hf(path, prompts, 24)
    assert ours != _hf(qwen3_dir, prompts, 24), "the rope scaling changed nothing"


def test_the_native_step_is_used_only_where_the_arch_layer_allows_it(
    qwen3_dir: Path, phi3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if native_kernels() is None:
        pytest.skip("the native kernels do not build on this CPU")

    def stage(path: Path):
        cfg = ModelConfig.from_dir(path, "float32")
        spec = StageSpec(0, 1, 0, cfg.num_layers)
        return load_stage_model(path, cfg, spec, 128, torch.device("cpu"), "int4")

    with caplog.at_level(logging.INFO, logger="pipeserve.model.stage_model"):
        qwen3 = stage(qwen3_dir)
    gaps = [r.getMessage() for r in caplog.records if "native decode step lacks" in r.getMessage()]
    assert qwen3.native is None and gaps == [
        "stage 0: decode steps run the PyTorch layers: the native decode step lacks q/k RMSNorm (qwen3)"
    ]
    assert stage(phi3_dir).native is not None  # phi3's layer is llama's once its tensors are split


@pytest.mark.parametrize(
    ("model_type", "config"),
    [("qwen3", {}), ("phi3", {"partial_rotary_factor": 0.5})],
    ids=["qwen3-qk-norm", "phi3-partial-rotary"],
)
def test_the_triton_path_runs_the_new_parts(tmp_path: Path, model_type: str, config: dict) -> None:
    """Every op through the Triton kernels (interpreter mode, tests/kernels/engine_run.py's process):
    q/k norms over head_dim rows, rotary over the leading half of each head; chunked prefill over a
    cached prefix, block size 4. The ids are transformers'."""
    path = write_hf_checkpoint(tmp_path / model_type, model_type, num_hidden_layers=2, **config)
    prompts = [[5], [1, 2, 3, 4, 5], *random_prompts(1, 26, 26, 1024, seed=11)]
    run = Path(__file__).resolve().parents[1] / "kernels" / "engine_run.py"
    env = {**os.environ, "PIPESERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(run), str(path), "1", json.dumps(prompts), "6"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton"
    assert out["ids"] == _hf(path, prompts, 6)
