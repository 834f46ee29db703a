"""gemma2 and gemma3_text (model/arch/gemma2.py, gemma3_text.py) against transformers.

The checkpoints are transformers' own (arch_support.py, conftest's gemma2_dir / gemma3_text_dir): a
12-token sliding window on the local layers, soft-caps small enough to bend these logits, tied
embeddings, gemma3's local rope base and linear scaling on its global layers. Every prompt here is
longer than the window, prefilled in chunks of 16 tokens or fewer (a chunk over a cached prefix sees
only the window's keys of it). The engine workloads (mixed batches, chunked prefill, prefix hits,
preemption: tests/engine/test_engine_correctness.py) and S=1..3 pipelines
(tests/ring/test_pipeline_correctness.py) run on the same checkpoints.
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

from conftest import _hf_model, hf_greedy, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Attention
from pipeserve.model.loader import load_stage_model
from pipeserve.model.stage_model import StageModel, StageSpec

ARCHS = ["gemma2", "gemma3_text"]
PROMPTS = random_prompts(4, 30, 70, 1024, seed=61)  # all past the 12-token window


def _dir(request: pytest.FixtureRequest, arch: str) -> Path:
    return Path(request.getfixturevalue(f"{arch}_dir"))


def _stage(path: Path) -> StageModel:
    cfg = ModelConfig.from_dir(path, "float32")
    return load_stage_model(path, cfg, StageSpec(0, 1, 0, cfg.num_layers), 128, torch.device("cpu"))


def _attention(path: Path) -> list[Attention]:
    layers = _stage(path).layers
    found = [a for layer in layers if isinstance(a := layer.self_attn, Attention)]
    assert len(found) == len(layers)
    return found


def test_config_maps_every_gemma_part(gemma2_dir: Path, gemma3_text_dir: Path) -> None:
    g2, g3 = ModelConfig.from_dir(gemma2_dir), ModelConfig.from_dir(gemma3_text_dir)
    for cfg in (g2, g3):
        assert cfg.norm_unit_offset and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.embed_scale == 8.0 and cfg.final_logit_softcap == 3.0
        assert cfg.sliding_window is None  # the windows are the layers': no context cap
    assert (g2.local_rope_theta, g2.rope_theta, g2.qk_norm) == (None, 10_000.0, False)
    assert (g3.local_rope_theta, g3.rope_theta, g3.qk_norm) == (10_000.0, 1_000_000.0, True)
    assert g3.rope_scaling is not None and g3.rope_scaling["rope_type"] == "linear"
    attn2, attn3 = _attention(gemma2_dir), _attention(gemma3_text_dir)
    assert [a.window for a in attn2] == [12, None, 12, None]  # every other layer local
    assert [a.window for a in attn3] == [12, 12, None, 12]  # a global layer every 3rd
    assert [a.local_rope for a in attn3] == [True, True, False, True]
    assert {a.softcap for a in attn2} == {4.0} and {a.softcap for a in attn3} == {None}
    assert {a.scale for a in attn2 + attn3} == {24**-0.5}  # query_pre_attn_scalar, not head_dim


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_past_the_window(request: pytest.FixtureRequest, arch: str) -> None:
    path = _dir(request, arch)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(path, p, 24, ignore_eos=True) for p in PROMPTS
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_hf(request: pytest.FixtureRequest, arch: str) -> None:
    """Every position's log-probabilities, final soft-cap included (greedy ids cannot see it: tanh
    keeps the order), within 1e-4 of transformers' log_softmax."""
    path = _dir(request, arch)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    for prompt, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], params), strict=True):
        with torch.no_grad():
            logp = _hf_model(str(path))(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for pos, scored in enumerate(out.prompt_logprobs[1:], start=1):
            assert scored is not None
            chosen, _, top = scored
            want, ids = logp[pos - 1].topk(3)
            assert chosen == pytest.approx(logp[pos - 1, prompt[pos]].item(), abs=1e-4), pos
            assert [t for t, _ in top] == ids.tolist(), pos
            assert [v for _, v in top] == pytest.approx(want.tolist(), abs=1e-4), pos


def test_softcap_reference_path_said_once(gemma2_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipeserve.model.stage_model"):
        _stage(gemma2_dir)
    said = [r.getMessage() for r in caplog.records if "soft-capping" in r.getMessage()]
    assert said == [
        "stage 0: attention logit soft-capping: the reference attention (explicit scores: "
        "SDPA has no soft-capping)"
    ]


@pytest.mark.parametrize(
    ("arch", "layers"), [("gemma2", {}), ("gemma3_text", {"sliding_window_pattern": 2})], ids=ARCHS
)
def test_the_triton_path_applies_window_and_softcap(tmp_path: Path, arch: str, layers: dict) -> None:
    """Every op through the Triton kernels (interpreter mode, tests/kernels/engine_run.py's process):
    a local then a global layer, windowed and soft-capped attention, chunked prefill over a cached
    prefix, block size 4."""
    path = write_hf_checkpoint(tmp_path / arch, arch, num_hidden_layers=2, **layers)
    prompts = [[5], *random_prompts(2, 20, 30, 1024, seed=12)]
    run = Path(__file__).resolve().parents[1] / "kernels" / "engine_run.py"
    env = {**os.environ, "PIPESERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(run), str(path), "1", json.dumps(prompts), "6"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton"
    assert out["ids"] == [hf_greedy(path, p, 6, ignore_eos=True) for p in prompts]


BASE = {"model_type": "gemma2", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8}
BASE.update(num_hidden_layers=2, num_attention_heads=4, head_dim=16, sliding_window=4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"sliding_window": None}, "local .* layers need a sliding_window"),
        ({"layer_types": ["full_attention"]}, "layer_types must name 2 layers"),
        ({"attn_logit_softcapping": 0}, "attn_logit_softcapping must be > 0"),
        ({"hidden_activation": "relu"}, "unsupported hidden_activation 'relu'; supported: silu, gelu"),
        (
            {"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}},
            "gemma3 local layers with rope type 'yarn'",
        ),
    ],
)
def test_configs_it_cannot_serve_are_clear_errors(change: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict({**BASE, **change})


def test_gemma_1_is_the_llama_layer_with_gemmas_parts(gemma_dir: Path, tmp_path: Path) -> None:
    """Gemma 1 (model/arch/gemma.py): (1 + w) norms in the pre-norm layer, GeGLU, scaled embeddings,
    head_dim**-0.5, no window, tied; the releases' legacy hidden_act "gelu" read as the tanh form (as
    GemmaConfig corrects it). Greedy ids are transformers' over chunked prefill."""
    from pipeserve.model.layers import UnitOffsetRMSNorm

    cfg = ModelConfig.from_dir(gemma_dir)
    assert cfg.norm_unit_offset and cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.embed_scale == 8.0 and cfg.final_logit_softcap is None and cfg.sliding_window is None
    stage = _stage(gemma_dir)
    assert all(isinstance(layer.input_layernorm, UnitOffsetRMSNorm) for layer in stage.layers)
    assert {a.scale for a in _attention(gemma_dir)} == {16**-0.5} and stage.native is None
    raw = json.loads((gemma_dir / "config.json").read_text())
    legacy = {**raw, "hidden_act": "gelu"}
    legacy.pop("hidden_activation", None)
    assert ModelConfig.from_dict(legacy).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(ModelLoadError, match="unsupported hidden_act 'relu'"):
        ModelConfig.from_dict({**legacy, "hidden_act": "relu"})
    llm = LLM(str(gemma_dir), num_kv_blocks=64, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(gemma_dir, p, 24, ignore_eos=True) for p in PROMPTS
    ]
