"""GGUF files of every architecture with a GgufSpec convert back into checkpoints that serve
transformers' greedy tokens (issue 28, point 3: llama.cpp's names and metadata per architecture).

Per architecture: a tiny checkpoint transformers creates (arch_support.py; its weights rounded to
float16 so that an F16 file holds them exactly), written as llama.cpp's converter writes it
(gguf_support.write_gguf: gguf-py's own tensor names, llama.cpp's metadata keys, q/k rows permuted
for llama's rope, experts stacked, gemma's norms as 1 + w) in F32, F16 and Q8_0, and converted back
by `pipeserve convert-gguf`. The F32 file is served for S=1 and S=2 and gives transformers' greedy
tokens on the original checkpoint; the F16 file converts to the same tensors; the Q8_0 file's blocks
hold exactly the values of its dequantized checkpoint, under the HF names and row order the loader
reads. A file of an architecture without a GgufSpec is refused, naming the supported ones, before
`pipeserve up` starts anything.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from arch_support import write_hf_checkpoint
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, random_prompts
from gguf_support import LLAMA_CPP_ARCH, write_gguf
from pipeserve import LLM, SamplingParams
from pipeserve.cli import main
from pipeserve.errors import ExitCode, ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf import SUPPORTED_ARCHITECTURES, convert_gguf
from pipeserve.model.gguf_blocks import GgufBlocks
from pipeserve.model.loader import load_stage_model
from pipeserve.model.stage_model import StageSpec
from pipeserve.model_path import resolve_model

# model_type -> the model_type its GGUF file converts to (llama.cpp writes Mistral as llama).
ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
}
# llama.cpp scales Gemma's queries by head_dim**-0.5 (what Gemma's own configs say, but for the 27B),
# not by query_pre_attn_scalar: the tiny checkpoints take that value so that a file can hold them.
CONFIG = {"gemma2": {"query_pre_attn_scalar": 16}, "gemma3_text": {"query_pre_attn_scalar": 16}}
GEMMA = ("gemma", "gemma2", "gemma3_text")  # norms stored as 1 + w
LOCAL_LAYERS = ("gemma2", "gemma3_text")  # soft-caps, windows, query_pre_attn_scalar
PROMPTS = random_prompts(3, 3, 24, 1024, seed=70)
TOKENS = 12


def _fp16_exact(hf: Path) -> Path:
    """Round every weight to a float16 value, so the F16 file is the checkpoint itself."""
    path = hf / "model.safetensors"
    tensors = {n: t.half().float() for n, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hf


def _q8(name: str) -> Q | None:
    return None if name.endswith("norm.weight") else Q.Q8_0


@pytest.fixture(scope="module", params=list(ARCHS))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model_type, HF checkpoint, {file type: converted dir})."""
    model_type = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{model_type}")
    hf = _fp16_exact(write_hf_checkpoint(tmp / "hf", model_type, **CONFIG.get(model_type, {})))
    out = {}
    for kind, quant in (("f32", None), ("f16", lambda n: None if n.endswith("norm.weight") else Q.F16)):
        src = write_gguf(hf, tmp / f"{kind}.gguf", quant=quant)
        assert main(["convert-gguf", str(src), str(tmp / kind)]) == 0
        out[kind] = tmp / kind
    src = write_gguf(hf, tmp / "q8.gguf", quant=_q8)
    assert main(["convert-gguf", str(src), str(tmp / "q8")]) == 0
    out["q8"] = tmp / "q8"
    return model_type, hf, out


def _greedy(path: Path, stages: int, **kw) -> list[list[int]]:
    with LLM(str(path), stages=stages, num_kv_blocks=32, ring_timeout_s=20, **kw) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_config_names_the_arch_and_its_fields(converted) -> None:
    model_type, hf, out = converted
    want, got = (json.loads((p / "config.json").read_text()) for p in (hf, out["f32"]))
    assert got["model_type"] == ARCHS[model_type]
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    fields += ("num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps")
    assert {f: got[f] for f in fields} == {f: want[f] for f in fields}
    if want.get("head_dim") is not None:
        assert got["head_dim"] == want["head_dim"]
    if model_type in ("mixtral", "qwen3_moe"):  # experts, top-k, width, dense layers, renormalization
        moe = importlib.import_module(f"pipeserve.model.arch.{model_type}")
        assert moe.moe_spec(got) == moe.moe_spec(want)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        if model_type in LOCAL_LAYERS:
            assert got[key] == want[key], key
    if model_type in LOCAL_LAYERS:
        assert got["layer_types"] == want["layer_types"] and got["sliding_window"] == want["sliding_window"]
    if model_type == "gemma3_text":  # the global layers' base and linear scaling, the local layers' base
        assert got["rope_parameters"] == want["rope_parameters"]
    if model_type == "phi3":
        assert got["partial_rotary_factor"] == 1.0 and got["sliding_window"] is None
        assert got["original_max_position_embeddings"] == want["original_max_position_embeddings"]


def _params(path: Path) -> dict[str, torch.Tensor]:
    """The parameters the loader builds from a checkpoint (experts stacked from either layout)."""
    cfg = ModelConfig.from_dir(path, "float32")
    spec = StageSpec(0, 1, 0, cfg.num_layers)
    model = load_stage_model(path, cfg, spec, 16, torch.device("cpu"), "none")
    return {n: p.detach() for n, p in model.named_parameters()}


def test_float_files_give_back_the_checkpoint(converted) -> None:
    model_type, hf, out = converted
    want = load_file(str(hf / "model.safetensors"))
    f32 = load_file(str(out["f32"] / "model.safetensors"))
    gemma = model_type in GEMMA
    if ".experts." not in " ".join(f32):  # the HF names themselves (experts: v4's per-expert ones)
        assert sorted(f32) == sorted(want)
        assert [n for n in want if not _same(n, f32[n], want[n], gemma)] == []
    params = _params(hf)
    for kind in ("f32", "f16"):
        got = _params(out[kind])
        assert sorted(got) == sorted(params)
        assert [n for n in params if not _same(n, got[n], params[n], gemma)] == [], kind


def _same(name: str, a: torch.Tensor, b: torch.Tensor, gemma: bool) -> bool:
    """Gemma's norms come back as fl(1 + w) - 1 (llama.cpp stored fl(1 + w)): the same 1 + w that
    its (1 + w) RMSNorm computes; every other tensor exactly."""
    if gemma and name.endswith("norm.weight"):
        return torch.equal(1 + a, 1 + b)
    return torch.equal(a, b)


@pytest.mark.parametrize("stages", [1, 2])
def test_served_greedy_equals_transformers(converted, stages: int) -> None:
    _, hf, out = converted
    want = [hf_greedy(hf, p, TOKENS, ignore_eos=True) for p in PROMPTS]
    assert _greedy(out["f32"], stages) == want


def test_q8_blocks_are_its_dequantized_checkpoint(converted) -> None:
    _, _, out = converted
    floats = load_file(str(out["q8"] / "model.safetensors"))
    # the writer quantizes the 2-D tensors: not biases, norms or the stacked experts
    want = {n for n, t in floats.items() if _q8(n) and t.dim() == 2 and ".experts." not in n}
    with GgufBlocks(out["q8"]) as blocks:
        assert blocks.names == want
        for name in sorted(want):
            assert torch.equal(blocks.dequantized([name]), floats[name]), name


def test_model_flag_takes_a_gguf_file_of_the_arch(converted, tmp_path: Path) -> None:
    """`--model FILE.gguf`'s path (model_path.resolve_model: converted into the cache), then served."""
    _, hf, out = converted
    resolved = resolve_model(str(out["f32"].parent / "f32.gguf"), home=tmp_path)
    assert resolved.dir != out["f32"]
    assert _greedy(resolved.dir, 1)[:1] == [hf_greedy(hf, PROMPTS[0], TOKENS, ignore_eos=True)]


def test_an_unsupported_architecture_is_refused_before_anything_starts(tmp_path: Path, qwen3_dir) -> None:
    src = write_gguf(qwen3_dir, tmp_path / "gpt2.gguf", arch="gpt2")
    refusal = r"unsupported GGUF architecture 'gpt2'; supported: llama, qwen2"
    with pytest.raises(ModelLoadError, match=refusal):
        convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert set(SUPPORTED_ARCHITECTURES) >= {LLAMA_CPP_ARCH[t] for t in ARCHS}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "up", "--port", "0", "--model", str(src)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PIPESERVE_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == ExitCode.CANNOT_START, done.stderr
    assert "unsupported GGUF architecture 'gpt2'; supported: llama, qwen2" in done.stderr
    assert "Traceback" not in done.stderr and "started stages" not in done.stderr
    assert time.monotonic() - start < 20


def test_phi3_partial_rotary_is_read_back(tmp_path: Path) -> None:
    """Phi-4-mini's form: llama.cpp writes the rotated features of a head as rope.dimension_count."""
    hf = write_hf_checkpoint(tmp_path / "hf", "phi3", partial_rotary_factor=0.5)
    src = write_gguf(hf, tmp_path / "phi3.gguf")
    convert_gguf(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["partial_rotary_factor"] == 0.5
    want = [hf_greedy(hf, p, TOKENS, ignore_eos=True) for p in PROMPTS]
    assert _greedy(tmp_path / "out", 1) == want


def test_gemma_27b_files_scale_queries_by_hidden_over_heads() -> None:
    """llama.cpp's one exception to head_dim**-0.5 (Gemma 2 27B: 46 layers, Gemma 3 27B: 62), which is
    what those models' query_pre_attn_scalar says (4608 / 32 = 144, head_dim 128)."""
    from pipeserve.model.arch import gemma2, gemma3_text
    from pipeserve.model.gguf_meta import GgufMeta

    sizes = {"embedding_length": 4608, "attention.head_count": 32, "attention.key_length": 128}
    for module, name, deep in ((gemma2, "gemma2", 46), (gemma3_text, "gemma3", 62)):
        for layers, scalar in ((deep, 144), (deep - 4, 128)):
            keys = {**sizes, "block_count": layers, "attention.sliding_window": 4096}
            meta = GgufMeta.of({"general.architecture": name, **{f"{name}.{k}": v for k, v in keys.items()}})
            assert module.ARCH.gguf.config(meta)["query_pre_attn_scalar"] == scalar, (name, layers)


def test_llama3_rope_factors_are_read_back(tmp_path: Path) -> None:
    """Llama 3.1+'s llama3 rope scaling, which llama.cpp writes as a tensor of divisors (rope_freqs),
    comes back as the parameters that give it, and the served tokens are transformers'."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 64
    hf = write_hf_checkpoint(tmp_path / "hf", "llama", rope_scaling=llama3)
    src = write_gguf(hf, tmp_path / "llama3.gguf")
    convert_gguf(src, tmp_path / "out")
    want = json.loads((hf / "config.json").read_text())["rope_parameters"]
    got = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert got == want
    assert _greedy(tmp_path / "out", 1) == [hf_greedy(hf, p, TOKENS, ignore_eos=True) for p in PROMPTS]


def test_llama3_rope_parameters_of_the_llama_3_releases() -> None:
    """Llama 3.1 (factor 8) and 3.2 (factor 32) divisors as llama.cpp writes them give their
    parameters back; divisors no llama3 parameters give are refused by name."""
    from gguf_support import _rope_freqs
    from pipeserve.model.arch.llama import llama3_rope

    for factor in (8.0, 32.0):
        params = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        params["original_max_position_embeddings"] = 8192
        cfg = {"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128}
        cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **params}
        [(_, divisors)] = _rope_freqs(cfg)
        assert llama3_rope(divisors, 500000.0) == params
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight: no llama3 rope parameters"):
        llama3_rope(divisors[::-1].copy(), 500000.0)
