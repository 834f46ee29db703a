"""Sliding windows of mistral, qwen2, qwen3 and phi3 applied per layer by the paged kernels (no
context cap) give transformers' greedy ids.

Checkpoints are transformers' own (arch_support.write_hf_checkpoint) with a 12-token window: every
layer of mistral and phi3 slides; qwen2/qwen3 with use_sliding_window slide from max_window_layers
(2) on, as transformers 5's configs say (qwen2's config.json without `layer_types`, as Qwen's
published ones: the rule decides; qwen3's with them). Prompts run past the window, prefilled in chunks of at
most 16 tokens; a second pass finds the shared prefix cached (a chunk over a cached prefix sees only
the window's keys of it); S=1 and S=2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from arch_support import write_hf_checkpoint

from conftest import hf_greedy, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.model.config import ModelConfig
from pipeserve.model.loader import load_stage_model
from pipeserve.model.stage_model import StageModel, StageSpec

WINDOW = 12
QWEN = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}
CONFIGS = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": QWEN,
    "qwen3": QWEN,
    "phi3": {"sliding_window": WINDOW},
}
# The window each of the 4 layers applies (transformers: config.layer_types / sliding_window).
WINDOWS = {
    "mistral": [WINDOW] * 4,
    "qwen2": [None, None, WINDOW, WINDOW],
    "qwen3": [None, None, WINDOW, WINDOW],
    "phi3": [WINDOW] * 4,
}
ARCHS = list(CONFIGS)
SHARED = random_prompts(1, 40, 40, 1024, seed=71)[0]
# Every prompt past the window; the last two share a 40-token prefix (a prefix hit on the 2nd pass).
PROMPTS = random_prompts(2, 40, 60, 1024, seed=72) + [SHARED + p for p in random_prompts(2, 3, 9, 1024, 73)]
ENGINE = dict(max_model_len=96, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module", params=ARCHS)
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    path = write_hf_checkpoint(tmp_path_factory.mktemp(f"{arch}-window"), arch, **CONFIGS[arch])
    if arch == "qwen2":  # as Qwen's published configs (transformers 4): no layer_types, the rule decides
        raw = json.loads((path / "config.json").read_text())
        del raw["layer_types"]
        (path / "config.json").write_text(json.dumps(raw))
    return arch, path


def _stage(path: Path) -> StageModel:
    cfg = ModelConfig.from_dir(path, "float32")
    return load_stage_model(path, cfg, StageSpec(0, 1, 0, cfg.num_layers), 128, torch.device("cpu"))


def test_layers_slide_where_transformers_says(windowed: tuple[str, Path]) -> None:
    from transformers import AutoConfig

    arch, path = windowed
    hf = AutoConfig.from_pretrained(path)
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    want = [hf.sliding_window if k == "sliding_attention" else None for k in kinds]
    assert want == WINDOWS[arch]
    assert [layer.self_attn.window for layer in _stage(path).layers] == WINDOWS[arch]
    with LLM(str(path), num_kv_blocks=128, block_size=4) as llm:  # the window caps nothing
        assert llm.engine.max_model_len == hf.max_position_embeddings > WINDOW


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_matches_hf_past_the_window(windowed: tuple[str, Path], stages: int) -> None:
    _, path = windowed
    want = [hf_greedy(path, p, 12, ignore_eos=True) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), stages=stages, **ENGINE) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        hits = llm.engine.block_manager.stats.hit_tokens
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[2:], params)]
        assert llm.engine.block_manager.stats.hit_tokens - hits >= 40, "the shared prefix was not reused"
    assert first == want
    assert again == want[2:]


@pytest.mark.parametrize(
    ("arch", "layers"),
    [("mistral", {"sliding_window": WINDOW}), ("qwen2", {**QWEN, "max_window_layers": 1})],
    ids=["mistral", "qwen2"],
)
def test_the_triton_path_applies_the_window(tmp_path: Path, arch: str, layers: dict) -> None:
    """Every op through the Triton kernels (interpreter mode, tests/kernels/engine_run.py's process):
    2 layers (qwen2: a full then a sliding one), chunked prefill over a cached prefix, block size 4."""
    path = write_hf_checkpoint(tmp_path / arch, arch, num_hidden_layers=2, **layers)
    prompts = [[5], *random_prompts(2, 20, 30, 1024, seed=74)]
    run = Path(__file__).resolve().parents[1] / "kernels" / "engine_run.py"
    env = {**os.environ, "PIPESERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(run), str(path), "1", json.dumps(prompts), "6"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton"
    assert out["ids"] == [hf_greedy(path, p, 6, ignore_eos=True) for p in prompts]
