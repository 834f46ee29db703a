"""A whole model converted from a Q4_K_M-like GGUF, served from its blocks (`--quantization gguf`).

The demo llama (hidden 256, intermediate 512: K-quants need rows of 256) written with a Q4_K_M
file's mix (tests/gguf_support.q4_k_m: attn_v, ffn_down and the output in Q6_K, the rest Q4_K):
* every tensor is served in its type's form: q/k Q4_K beside v Q6_K make a ConcatLinear, ffn_down
  and the head an exact Q8Linear with scales per 16, the embedding gathers Q4_K rows (shared with
  a tied head); the blocks file records each tensor's type and form;
* the weights the stage holds are <= 1.1x the file's size (the issue's bar: 1.3x), Q6_K held as
  the file keeps it (its 6-bit packing, d per 256, int8 sub-scales);
* the native decode step takes such a stage and equals its PyTorch layers;
* greedy text agrees, teacher-forced, with the dequantized float32 model on >= 98 % of positions
  per K-quant mix and >= 99.5 % for Q8_0 (pipeserve.bench.agreement, benchmarks/quant_agreement.py's
  method);
* F16 and BF16 files have no blocks: every tensor is served dense, recorded as such.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

from gguf_support import q4_k_m, write_llama_gguf
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.gguf import convert_gguf
from pipeserve.model.gguf_blocks import BLOCKS_FILE, GgufBlocks, Int4Embedding, Q8Embedding
from pipeserve.model.layers import Linear
from pipeserve.model.loader import load_stage_model
from pipeserve.model.quant import Int4Linear, native_kernels
from pipeserve.model.quant_q8 import ConcatLinear, Q8Linear
from pipeserve.model.stage_model import StageSpec

SPEC = {"layers": 2, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "vocab": 512}


def _uniform(qtype: Q):
    return lambda name: None if name.endswith("norm.weight") else qtype


MIXES = {"Q4_K_M": q4_k_m, **{t: _uniform(Q[t]) for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16")}}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    base = tmp_path_factory.mktemp("kquant")
    return {
        tied: write_demo_model(base / f"hf-{tied}", DemoSpec(tie_embeddings=tied, **SPEC))
        for tied in (False, True)
    }


def _converted(hf: Path, mix: str, tmp: Path) -> tuple[Path, Path]:
    src = write_llama_gguf(hf, tmp / f"{mix}.gguf", quant=MIXES[mix])
    return src, convert_gguf(src, tmp / f"{mix}-out")


def _stage(model_dir: Path, quantization: str = "gguf"):
    cfg = ModelConfig.from_dir(model_dir, "float32")
    return load_stage_model(
        model_dir, cfg, StageSpec(0, 1, 0, cfg.num_layers), 128, torch.device("cpu"), quantization
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_q4_k_m_is_served_from_its_blocks_within_1_1x_its_file(hf_dirs, tmp_path: Path, tied: bool) -> None:
    src, out = _converted(hf_dirs[tied], "Q4_K_M", tmp_path)
    with GgufBlocks(out) as blocks:
        assert blocks.types["model.layers.0.self_attn.v_proj.weight"] == "Q6_K"
        assert blocks.forms["model.layers.0.self_attn.q_proj.weight"] == "int4"
        assert blocks.forms["model.layers.1.mlp.down_proj.weight"] == "q8"
        assert blocks.forms["model.norm.weight"] == "dense"
        floats = {}
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            floats = {
                k: f.get_tensor(k)
                for k in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight")
            }
        # the float checkpoint is gguf's dequantization, which the exact forms hold bit for bit
        assert torch.equal(
            blocks.dequantized(["model.layers.0.mlp.down_proj.weight"]),
            floats["model.layers.0.mlp.down_proj.weight"],
        )
    model = _stage(out)
    for layer in model.layers:
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv, ConcatLinear)
        assert [type(p) for p in qkv.parts] == [Int4Linear, Int4Linear, Q8Linear]
        assert qkv.parts[2].sub == 16 and qkv.parts[2].mins is None
        assert isinstance(layer.self_attn.o_proj, Int4Linear) and isinstance(
            layer.mlp.gate_up_proj, Int4Linear
        )
        assert isinstance(layer.mlp.down_proj, Q8Linear) and layer.mlp.down_proj.sub == 16
        down = layer.mlp.down_proj  # per 256 weights, as the file: 192 bytes of values, 20 of scales
        assert (
            down.qweight.dtype == torch.uint8
            and down.qweight.numel() * 256 == down.in_features * down.out_features * 192
        )
        assert (
            down.scales.dtype == torch.uint8
            and down.scales.numel() * 256 == down.in_features * down.out_features * 20
        )
    assert [n for n, m in model.named_modules() if isinstance(m, Linear)] == []
    assert isinstance(model.embed_tokens, Int4Embedding)
    if tied:  # one copy of the vocabulary matrix: the embedding gathers from the head's nibbles
        assert isinstance(model.lm_head, Int4Linear)
        assert model.embed_tokens.qweight is model.lm_head.qweight
    else:
        assert isinstance(model.lm_head, Q8Linear) and model.lm_head.sub == 16
    # the embedding's rows are the file's values within the int4 form's bfloat16 scale and zero
    ids = torch.tensor([[0, 5, 511], [7, 7, 300]])
    want = floats["model.embed_tokens.weight"][ids]
    assert (model.embed_tokens(ids) - want).abs().max().item() <= 2**-7 * want.abs().max().item()
    # what the stage holds is the blocks' size, not float32's
    # Q6_K at its own size (6.6 bits a weight, not 10 as int8 and a float32 per 16): 1.06x here, was 1.26x
    assert model.weight_bytes() <= 1.1 * src.stat().st_size, (model.weight_bytes(), src.stat().st_size)


@pytest.mark.skipif(native_kernels() is None, reason="no C compiler: no native kernels")
def test_native_decode_step_reads_the_mixed_projections(hf_dirs, tmp_path: Path) -> None:
    from test_native_decode import _decode_batch

    _, out = _converted(hf_dirs[False], "Q4_K_M", tmp_path)
    model = _stage(out)
    assert model.native is not None  # qkv as W_CAT (Q4_K, Q4_K, Q6_K), down as W_Q8 per 16
    ids, batch, pool = _decode_batch(model, [5, 70, 33], [1, 2], seed=1)
    assert model.native.accepts(batch, 3, pool)
    pool_ref = pool.clone()
    got = model(ids, batch, pool)
    native, model.native = model.native, None
    want = model(ids, batch, pool_ref)
    model.native = native
    assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()
    assert (pool - pool_ref).abs().max().item() <= 1e-3 * pool_ref.abs().max().item()


@pytest.mark.parametrize(
    ("mix", "bar"),
    [
        ("Q4_K_M", 0.98),
        pytest.param("Q4_K", 0.98, marks=pytest.mark.slow),
        pytest.param("Q5_K", 0.98, marks=pytest.mark.slow),
        pytest.param("Q6_K", 0.98, marks=pytest.mark.slow),
        pytest.param("Q8_0", 0.995, marks=pytest.mark.slow),
    ],
)
def test_greedy_agrees_with_the_dequantized_model(hf_dirs, tmp_path: Path, mix: str, bar: float) -> None:
    from pipeserve.bench.agreement import PROMPTS, agreement

    _, out = _converted(hf_dirs[False], mix, tmp_path)
    result = agreement(str(out), "gguf", PROMPTS[:8], 32)
    assert result.tokens == 8 * 32
    assert result.rate >= bar, result


@pytest.mark.parametrize("mix", ["F16", "BF16"])
def test_16_bit_files_are_served_dense(hf_dirs, tmp_path: Path, mix: str) -> None:
    _, out = _converted(hf_dirs[False], mix, tmp_path)
    with safe_open(str(out / BLOCKS_FILE), framework="pt") as f:
        meta = f.metadata()
        assert list(f.keys()) == []
    assert set(json.loads(meta["forms"]).values()) == {"dense"}
    assert json.loads(meta["types"])["lm_head.weight"] == mix
    served, dense = _stage(out), _stage(out, "none")
    assert not isinstance(served.embed_tokens, Q8Embedding | Int4Embedding)
    assert served.weight_bytes() == dense.weight_bytes()
    for (name, a), (_, b) in zip(served.named_parameters(), dense.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_q4_k_m_is_the_same_for_every_pipeline_size(hf_dirs, tmp_path: Path) -> None:
    """Each stage serves its own layers' blocks (the head's Q6_K on the last): S=2 decodes what S=1 does."""
    from pipeserve.entrypoints.llm import LLM
    from pipeserve.sampling_params import SamplingParams

    _, out = _converted(hf_dirs[False], "Q4_K_M", tmp_path)
    prompts = [[5, 9, 13, 21, 34], list(range(40, 80)), [7] * 19]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for stages in (1, 2):
        with LLM(str(out), stages=stages, quantization="gguf") as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
    assert runs[0] == runs[1]
    assert all(len(ids) == 12 for ids in runs[0])
