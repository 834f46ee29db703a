"""The native decode step (model/native_decode.py, native/decode.c::decode_step) against the PyTorch layers.

Both paths run on one stage's weights and one KV pool: a native step must give the hidden states
and the K/V writes of the PyTorch layers within 1e-3 of the largest value (float32 rounding, and
both quantize x to int16 at slightly different values; two ulps of a 16-bit pool), for ragged
lengths, several decode groups, scattered blocks, GQA, a qkv bias (qwen2) and 16-bit pools. The
engine serves the same greedy ids with it and without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeserve.model.config import ModelConfig
from pipeserve.model.demo import write_demo_model
from pipeserve.model.demo_spec import DemoSpec
from pipeserve.model.layers import AttentionBatch, DecodeGroup, Linear, PrefillSpan
from pipeserve.model.loader import load_stage_model
from pipeserve.model.native_decode import MAX_ROWS
from pipeserve.model.quant import native_kernels
from pipeserve.model.stage_model import StageModel, StageSpec

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C compiler: no native kernels")

BLOCK = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(arch=request.param, layers=3, hidden=128, intermediate=320, heads=8, kv_heads=2)
    return write_demo_model(tmp_path_factory.mktemp(request.param), spec)


def _stage(model_dir: Path, quantization: str = "int4") -> StageModel:
    cfg = ModelConfig.from_dir(model_dir, "float32")
    return load_stage_model(
        model_dir, cfg, StageSpec(0, 1, 0, cfg.num_layers), 512, torch.device("cpu"), quantization
    )


def _decode_batch(model: StageModel, lens: list[int], groups: list[int], seed: int):
    """A decode-only step: row r at context lens[r] (its new token's slot included), blocks scattered
    over a pool; rows split into decode groups of the sizes in `groups`."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lens)
    blocks = len(lens) * width + 2
    pool = torch.randn(cfg.num_layers, 2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=g)
    tables = (torch.randperm(blocks - 1, generator=g)[: len(lens) * width] + 1).view(len(lens), width)
    lens_t = torch.tensor(lens)
    pos = lens_t - 1
    slots = tables.gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK
    cos, sin = model.rotary.gather(pos)
    decodes, row = [], 0
    for n in groups:
        decodes.append(DecodeGroup(row, n, tables[row : row + n], lens_t[row : row + n]))
        row += n
    batch = AttentionBatch(pos, slots, cos, sin, len(lens), decodes, [])
    ids = torch.randint(0, cfg.vocab_size, (len(lens),), generator=g)
    return ids, batch, pool


@pytest.mark.parametrize(
    ("lens", "groups"),
    [
        ([1], [1]),
        ([200], [1]),
        ([5, 130, 64], [3]),
        ([300, 17, 129, 2, 40], [2, 3]),
        ([33] * MAX_ROWS, [MAX_ROWS]),
    ],
)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
def test_native_step_equals_the_pytorch_layers(
    model_dir: Path, lens: list[int], groups: list[int], pool_dtype: torch.dtype, quantization: str
) -> None:
    model = _stage(model_dir, quantization)
    assert model.native is not None
    ids, batch, pool = _decode_batch(model, lens, groups, seed=len(lens))
    pool = pool.to(pool_dtype)
    if len(lens) > model.native.max_rows:  # float32 past what this CPU's calibration lets it take
        assert quantization == "none"
        assert not model.native.accepts(batch, len(lens), pool)
        return
    assert model.native.accepts(batch, len(lens), pool)
    pool_ref = pool.clone()
    got = model(ids, batch, pool)
    native, model.native = model.native, None
    want = model(ids, batch, pool_ref)
    model.native = native
    # a 16-bit pool rounds K/V that differ by float rounding to values up to one of its ulps apart
    ulp = {torch.float32: 0.0, torch.float16: 2**-10, torch.bfloat16: 2**-7}[pool_dtype]
    tol = max(1e-3, 2 * ulp)
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    assert (pool.float() - pool_ref.float()).abs().max().item() <= tol * pool_ref.float().abs().max().item()
    # only the new tokens' slots were written
    assert torch.equal(pool.flatten(3)[:, :, 0, 0], pool_ref.flatten(3)[:, :, 0, 0])


def test_steps_it_does_not_take(model_dir: Path) -> None:
    model = _stage(model_dir)
    assert model.native is not None
    _, batch, pool = _decode_batch(model, [10, 20], [2], seed=3)
    assert model.native.accepts(batch, 2, pool)
    with_prefill = AttentionBatch(
        batch.positions, batch.slot_mapping, batch.cos, batch.sin, 1, batch.decodes[:1],
        [PrefillSpan(1, 1, 19, batch.decodes[0].block_tables[1])],
    )  # fmt: skip
    assert not model.native.accepts(with_prefill, 2, pool)
    assert not model.native.accepts(batch, 2, pool.double())  # a pool dtype the native kernels do not read
    _, big, pool = _decode_batch(model, [8] * (MAX_ROWS + 1), [MAX_ROWS + 1], seed=4)
    assert not model.native.accepts(big, MAX_ROWS + 1, pool)


def test_which_stages_have_a_native_step(model_dir: Path, tmp_path: Path) -> None:
    """int4, int8 (Q8Linear) and float32 stages whose widths suit the native kernels (multiples of
    16) have one, and keep float32 weights dense for it; a float32 model of other widths keeps its
    oneDNN-packed weights and the PyTorch layers."""
    float_stage = _stage(model_dir, "none")
    assert float_stage.native is not None
    assert not any(m.weight.is_mkldnn for m in float_stage.modules() if isinstance(m, Linear))
    assert _stage(model_dir, "int8").native is not None  # Q8Linear projections
    odd = write_demo_model(
        tmp_path / "odd", DemoSpec(layers=2, hidden=128, intermediate=200, heads=4, kv_heads=2)
    )
    odd_stage = _stage(odd, "none")
    assert odd_stage.native is None
    assert odd_stage.layers[0].mlp.down_proj.weight.is_mkldnn  # K = 200: packed for oneDNN


@pytest.mark.parametrize("quantization", ["int4", "int8", "none"])
def test_engine_greedy_ids_are_the_same_with_and_without_it(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, quantization: str
) -> None:
    from pipeserve.entrypoints.llm import LLM
    from pipeserve.sampling_params import SamplingParams

    prompts = ["the quick brown fox", "a", "pipeline parallel serving of large models " * 3]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(native: bool) -> list[list[int]]:
        llm = LLM(str(model_dir), quantization=quantization, dtype="float32")
        try:
            assert (llm.engine.executor.runner.model.native is not None) == native
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    with_native = run(True)
    monkeypatch.setattr(StageModel, "use_native_decode", lambda self: False)
    assert run(False) == with_native


def test_float32_engine_with_the_native_step_matches_hf(model_dir: Path) -> None:
    """A float32 model whose widths suit the native kernels decodes through the native step, and the engine's
    greedy ids are transformers' (HF-exact holds on this path: sums in another order only)."""
    from conftest import assert_matches_hf, random_prompts
    from pipeserve.entrypoints.llm import LLM
    from pipeserve.sampling_params import SamplingParams

    prompts = random_prompts(10, 1, 40, 1024, seed=21) + random_prompts(3, 150, 300, 1024, seed=22)
    with LLM(str(model_dir), max_model_len=512, num_kv_blocks=512) as llm:
        assert llm.engine.executor.runner.model.native is not None
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert_matches_hf(model_dir, prompts, outs, 24)
