"""Quantized projections (model/quant.py) against their dequantized float references.

Tolerance: a quantized layer's output equals F.linear(bf16-rounded x, dequantized weight) within
3e-2 of max |y| (the kernels run on bf16 activations and return bf16). A whole demo model,
quantized, gives the same greedy ids as the float model built from its dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeserve.config import EngineConfig
from pipeserve.errors import ConfigError
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Linear
from pipeserve.model.loader import load_stage_model, model_fingerprint
from pipeserve.model.quant import Int4Linear, Int8Linear, dequantize_int4, quantize_int4
from pipeserve.model.quant_q8 import q8_native
from pipeserve.model.stage_model import StageSpec

REL_TOL = 3e-2


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert (y - ref).abs().max().item() <= REL_TOL * ref.abs().max().item()


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear_matches_dequantized_reference(rows: int, kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    w, b, x = (
        torch.randn(96, 64, generator=g),
        torch.randn(96, generator=g),
        torch.randn(rows, 64, generator=g),
    )
    layer = Int8Linear(w, b) if kind == "int8" else Int4Linear(w, b, 32)
    ref = F.linear(x.bfloat16().float(), layer.dequantized(), b)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    _close(y, ref)
    # the quantized weight is near the original one (int4: within half a step of its group)
    assert (layer.dequantized() - w).abs().max().item() < (0.05 if kind == "int8" else 0.3)


def test_int4_zero_point_is_used() -> None:
    """A weight far from zero (all positive) survives only if the group minimum is applied."""
    w = torch.rand(64, 64) + 5.0
    q, s, m = quantize_int4(w, 32)
    layer = Int4Linear(w, None, 32)
    assert (layer.dequantized() - dequantize_int4(q, s, m, 32)).abs().max().item() < 0.05
    assert (layer.dequantized() - w).abs().max().item() < 0.1


def _stage(model_dir: Path, quantization: str):
    cfg = ModelConfig.from_dir(model_dir, "float32")
    spec = StageSpec(0, 1, 0, cfg.num_layers)
    return load_stage_model(model_dir, cfg, spec, 64, torch.device("cpu"), quantization, 32)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_demo_model_quantized_layers_swapped(llama_dir: Path, quantization: str) -> None:
    model = _stage(llama_dir, quantization)
    kinds = {type(m).__name__ for m in model.modules()}
    # int8: Q8_0-style blocks where the native CPU kernels serve them (q8_native), per channel else
    int8 = "Q8Linear" if q8_native(torch.device("cpu")) else "Int8Linear"
    assert (int8 if quantization == "int8" else "Int4Linear") in kinds
    # lm_head stays float; int4 leaves float only projections without whole groups
    left = [m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"]
    assert all(quantization == "int4" and m.in_features % 32 for m in left)


def test_fingerprint_names_the_quantization(llama_dir: Path) -> None:
    fps = {model_fingerprint(llama_dir, torch.float32, q, 32) for q in ("none", "int8", "int4")}
    fps.add(model_fingerprint(llama_dir, torch.float32, "int4", 64))
    assert len(fps) == 4
    assert model_fingerprint(llama_dir, torch.float32) == model_fingerprint(
        llama_dir, torch.float32, "none", 32
    )


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"quantization": "int3"}, "quantization"),
        ({"quantization_group_size": 48}, "quantization_group_size"),
    ],
)
def test_bad_values_refused(llama_dir: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(model=str(llama_dir), **kwargs)
