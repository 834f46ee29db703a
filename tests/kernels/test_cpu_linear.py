"""Projections through oneDNN on packed weights (pipeserve_kernels/cpu_linear.py) and how a stage uses them.

Packed products sum in oneDNN's order, not MKL's, so they are compared with F.linear within
float32 rounding, over the row counts a stage sees (one decode row, a decode batch, prefill
chunks) and the awkward inputs (a bias, a non-contiguous view, no rows). The loader must pack
every float32 projection of a CPU stage, keep a tied lm_head dense (packing it would hold the
vocabulary matrix twice), leave other dtypes alone, and report the same weight bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import pipeserve_kernels as K
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.layers import Linear
from pipeserve.model.loader import load_stage_model
from pipeserve.model.stage_model import StageSpec
from pipeserve_kernels import cpu_linear
from pipeserve_kernels.native import F32_K_MULTIPLE

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 32, 33, 67, 256, 257, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    w, x = randn(96, 80), randn(rows, 80, seed=1)
    b = randn(96, seed=2) if bias else None
    packed = cpu_linear.pack_weight(w)
    assert packed.is_mkldnn and tuple(packed.shape) == (96, 80)
    got = cpu_linear.linear(x, packed, b)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_row_pieces_cover_every_row_once_with_a_bounded_set_of_shapes() -> None:
    """oneDNN keeps a compiled primitive per input shape: the shapes it sees must be a small fixed set."""
    shapes = set()
    for rows in range(0, 4097):
        covered = 0
        for start, n, run in cpu_linear.row_pieces(rows):
            assert (start == covered and 0 <= n <= run <= cpu_linear.CHUNK_ROWS) or rows == 0
            assert run == n if n <= cpu_linear.EXACT_ROWS else run % cpu_linear.ROW_QUANTUM == 0
            assert run - n < cpu_linear.ROW_QUANTUM  # padding wastes less than one quantum
            covered += n
            shapes.add(run)
        assert covered == rows
    assert len(shapes) <= cpu_linear.EXACT_ROWS + 1 + cpu_linear.CHUNK_ROWS // cpu_linear.ROW_QUANTUM


@needs_onednn
def test_packed_linear_keeps_leading_dims() -> None:
    w, x = randn(24, 16), randn(2, 40, 16, seed=1)
    got = cpu_linear.linear(x, cpu_linear.pack_weight(w), None)
    assert got.shape == (2, 40, 24)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_takes_a_non_contiguous_input() -> None:
    w, x = randn(32, 48), randn(48, 5, seed=1).t()
    assert not x.is_contiguous()
    torch.testing.assert_close(cpu_linear.linear(x, cpu_linear.pack_weight(w), None), F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_stay_dense(dtype: torch.dtype) -> None:
    w = randn(16, 8).to(dtype)
    assert cpu_linear.pack_weight(w) is w
    x = randn(2, 8, seed=1).to(dtype)
    assert torch.equal(cpu_linear.linear(x, w, None), F.linear(x, w))


def _stage(model_dir: Path, dtype: str = "float32"):
    cfg = ModelConfig.from_dir(model_dir, dtype)
    return load_stage_model(model_dir, cfg, StageSpec(0, 1, 0, cfg.num_layers), 64, torch.device("cpu"))


@needs_onednn
@pytest.mark.parametrize("tied", [False, True])
def test_loader_packs_every_projection_but_a_tied_head(tmp_path: Path, tied: bool) -> None:
    """Every projection is packed for oneDNN unless the native kernels read it dense (where they
    build, for K % 16 == 0)."""
    if K.BACKEND != "auto":
        pytest.skip("weights are packed in auto mode only")
    path = write_demo_model(tmp_path / "m", DemoSpec(layers=2, tie_embeddings=tied))
    model = _stage(path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    native = K.native.load() is not None
    for m in linears:
        if tied and m is model.lm_head:
            assert not m.weight.is_mkldnn
            assert m.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
        else:
            read_dense = native and K.cpu_linear.native_f32_rows(K.native.load()) > 0
            assert m.weight.is_mkldnn == (not read_dense or m.in_features % F32_K_MULTIPLE != 0)
    dense = sum(t.numel() * t.element_size() for t in _dense_tensors(path))
    assert model.weight_bytes() == dense


def _dense_tensors(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).values())


def test_bfloat16_stage_keeps_dense_weights(tmp_path: Path) -> None:
    path = write_demo_model(tmp_path / "m", DemoSpec(layers=1))
    model = _stage(path, "bfloat16")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert not any(m.weight.is_mkldnn for m in linears)
    # Left as they were: still Parameters of the model, counted once each.
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in linears)
    dense = sum(t.numel() * 2 for t in _dense_tensors(path))  # the checkpoint's tensors in bfloat16
    assert model.weight_bytes() == dense


def test_rows_that_win_is_the_prefix_where_native_was_never_slower() -> None:
    onednn = {1: 1.0, 4: 2.0, 16: 4.0, 32: 8.0}
    assert K.cpu_linear.rows_that_win({1: 0.5, 4: 1.0, 16: 5.0, 32: 1.0}, onednn) == 4
    assert K.cpu_linear.rows_that_win({1: 0.5, 4: 2.0, 16: 4.0, 32: 8.0}, onednn) == 32
    assert K.cpu_linear.rows_that_win({1: 1.5, 4: 1.0, 16: 1.0, 32: 1.0}, onednn) == 0


_CALIBRATED_STAGE = """
import json, sys
import torch
from pipeserve_kernels import native
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Linear
from pipeserve.model.loader import load_stage_model
from pipeserve.model.stage_model import StageSpec
lib = native.load()
lib.path.with_suffix(".f32rows.json").write_text(json.dumps({"rows": int(sys.argv[2])}))
cfg = ModelConfig.from_dir(sys.argv[1], "float32")
model = load_stage_model(sys.argv[1], cfg, StageSpec(0, 1, 0, cfg.num_layers), 64, torch.device("cpu"))
packed = [m.weight.is_mkldnn for m in model.layers.modules() if isinstance(m, Linear)]
print(json.dumps({"packed": packed, "native_rows": model.native.max_rows if model.native else None}))
"""


@needs_onednn
@pytest.mark.skipif(K.native.load() is None or K.BACKEND != "auto", reason="needs the native kernels")
@pytest.mark.parametrize(("rows", "packed", "native_rows"), [(0, True, None), (4, False, 4), (32, False, 32)])
def test_a_cpu_where_the_native_product_loses_packs_for_onednn(
    tmp_path: Path, rows: int, packed: bool, native_rows: int | None
) -> None:
    """The per-CPU guard read from the calibration file beside the library (a private
    PIPESERVE_HOME): 0 rows keeps no weight dense and the stage decodes on the PyTorch layers;
    otherwise weights stay dense and the native step takes at most that many rows."""
    import json
    import os
    import subprocess
    import sys

    path = write_demo_model(tmp_path / "m", DemoSpec(layers=2))
    env = {**os.environ, "PIPESERVE_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [sys.executable, "-c", _CALIBRATED_STAGE, str(path), str(rows)],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["packed"] == [packed] * 8
    assert got["native_rows"] == native_rows
