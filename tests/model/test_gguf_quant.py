"""The reference quantizer (model/gguf_quant.py) and the GGUF test-file writer built on it.

gguf-py's own dequantizer reads every block we write back to the values quantized, within each
type's error; our Q5_0 / Q5_1 bytes equal gguf-py's quantizer (which follows ggml's reference
bit for bit); the K-quants' searches make them finer than their legacy siblings at the same bits;
degenerate blocks (zeros, constants, one outlier) stay finite and exact where they can be. The
writer makes a llama GGUF with a Q4_K_M file's mix of types, and F16 / BF16 files.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gguf_support import gguf_name, q4_k_m, write_llama_gguf
from pipeserve.model import gguf_quant
from pipeserve.model.demo import DemoSpec, write_demo_model

# relative RMS error of each type on gaussian weights (measured: Q4_K 0.071, Q5_K 0.036,
# Q6_K 0.018, Q5_0 0.043, Q5_1 0.038), with a margin
RMSE = {"Q4_K": 0.08, "Q5_K": 0.042, "Q6_K": 0.021, "Q5_0": 0.05, "Q5_1": 0.045}


def _weights(seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((48, 512)).astype(np.float32) * 0.02
    w[1] = 0.0  # an all-zero row
    w[2, :256] = 0.013  # a constant super-block
    w[3, 7] = 0.5  # one outlier
    w[4] = np.abs(w[4])  # all positive: mins of 0
    return w


def _rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


@pytest.mark.parametrize("qtype", gguf_quant.TYPES)
def test_gguf_reads_back_what_was_quantized(qtype: str) -> None:
    w = _weights()
    blocks = gguf_quant.quantize(w, qtype)
    per_row = w.shape[1] // gguf_quant.BLOCK_SIZE[qtype] * gguf_quant.BLOCK_BYTES[qtype]
    assert blocks.shape == (w.shape[0], per_row) and blocks.dtype == np.uint8
    back = gguf.quants.dequantize(blocks, Q[qtype]).reshape(w.shape)
    assert np.isfinite(back).all()
    assert _rmse(back[5:], w[5:]) <= RMSE[qtype]
    assert np.array_equal(back[1], w[1])  # zeros stay zeros
    assert np.abs(back[2, :256] - 0.013).max() <= 0.013 * 2**-7  # a constant: the scales' rounding
    # the outlier keeps its size within its block's step
    assert abs(back[3, 7] - 0.5) <= 0.5 * 2 * RMSE[qtype]


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_legacy_5_bit_bytes_are_ggmls(qtype: str) -> None:
    w = _weights(1)
    assert np.array_equal(gguf_quant.quantize(w, qtype), gguf.quants.quantize(w, Q[qtype]))


@pytest.mark.parametrize(("kquant", "legacy"), [("Q4_K", "Q4_1"), ("Q5_K", "Q5_1")])
def test_k_quants_search_a_finer_fit_than_their_legacy_siblings(kquant: str, legacy: str) -> None:
    # Q4_K spends 4.5 bits a weight as Q4_1 does 5: its weighted scale/min search still fits closer
    w = _weights(2)[5:]
    k = gguf.quants.dequantize(gguf_quant.quantize(w, kquant), Q[kquant]).reshape(w.shape)
    old = gguf.quants.dequantize(gguf.quants.quantize(w, Q[legacy]), Q[legacy]).reshape(w.shape)
    assert _rmse(k, w) < _rmse(old, w)


def test_bad_shapes_and_types_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_quant.quantize(np.zeros((2, 96), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="Q4_K"):
        gguf_quant.quantize(np.zeros((2, 256), np.float32), "Q2_K")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
    return write_demo_model(tmp_path_factory.mktemp("kq") / "hf", spec)


def test_writer_mixes_types_as_a_q4_k_m_file(hf_dir: Path, tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_llama_gguf(hf_dir, tmp_path / "m.gguf", quant=q4_k_m))
    types = {t.name: Q(t.tensor_type).name for t in reader.tensors}
    assert types[gguf_name("lm_head.weight")] == "Q6_K"
    assert types[gguf_name("model.embed_tokens.weight")] == "Q4_K"
    for i in range(2):
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == "Q6_K"
        for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{n}.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_writer_makes_16_bit_files(hf_dir: Path, tmp_path: Path, qtype: Q) -> None:
    def mix(name: str) -> Q | None:
        return None if name.endswith("norm.weight") else qtype

    reader = gguf.GGUFReader(write_llama_gguf(hf_dir, tmp_path / "m.gguf", quant=mix))
    matrices = [t for t in reader.tensors if not t.name.endswith("norm.weight")]
    assert {Q(t.tensor_type) for t in matrices} == {qtype}
    embd = next(t for t in matrices if t.name == "token_embd.weight")
    assert tuple(int(d) for d in embd.shape) == (256, 512)
