"""Each GGUF type served from its blocks (model/gguf_types.py) against gguf-py's dequantization.

One GGUF file holds a [24, 512] tensor of every block type, written by the project's writer
(gguf-py's quantizers, our reference quantizer for Q5_x and the K-quants). For each:
* the q8 form (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) holds exactly gguf's values (bit for bit);
* the int4 form (Q4_0, Q4_1, Q4_K): the blocks' own scale/min give gguf's values bit for bit, and
  the served weight differs only by rounding scale and zero to bfloat16 (the kernel's type);
* the served projection computes x @ W^T with the weight it claims, at decode and prefill row
  counts (x rounded to int16 per 32 by the kernels: 1e-3 of the largest output);
* without the native kernels (PIPESERVE_KERNELS=torch) the 8-bit forms dequantize per call into
  torch's product, said once (CUDA: tests/kernels/test_triton_quant.py).
A file with a type outside the served ones is refused before anything is written, naming the
type and the supported ones (the CLI: exit 2, no traceback).
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from gguf_support import UNSERVED, gguf_tensor, write_llama_gguf
from pipeserve.cli import main
from pipeserve.errors import ModelLoadError
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.gguf import convert_gguf
from pipeserve.model.gguf_types import (
    INT4_TYPES,
    Q8_TYPES,
    SERVED_TYPES,
    form,
    pack_q6k_scales,
    read_blocks,
)
from pipeserve.model.quant import Int4Linear, Q8Linear, native_kernels

N, K = 24, 512


@pytest.fixture(scope="module")
def tensors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    w = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32) * 0.03
    w[0, :32] = 0.0
    w[1] = np.abs(w[1])
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name in (*INT4_TYPES, *Q8_TYPES):
        writer.add_tensor(name, gguf_tensor(w, Q[name]), raw_dtype=Q[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _gguf_values(t) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(N, K)


def _served(qtype: str, blocks: dict[str, torch.Tensor]) -> torch.nn.Module:
    if form(qtype) == "int4":
        q = torch.cat([blocks["qs"] & 15, blocks["qs"] >> 4], dim=-1).reshape(N, K)
        d, m = blocks["d"].float(), blocks["m"].float()
        return Int4Linear(None, None, 32, quantized=(q, d, m), out_dtype=torch.float32)
    if "q6" in blocks:  # Q6_K: the file's packing and scales
        q, d = blocks["q6"], pack_q6k_scales(blocks["d"], blocks["sc"])
    else:
        q, d = blocks["q8"], blocks["d"]
    return Q8Linear(q, d, None, torch.float32, mins=blocks.get("m"), fallback=True)


@pytest.mark.parametrize("qtype", [*INT4_TYPES, *Q8_TYPES])
def test_served_weight_is_the_files(tensors, qtype: str) -> None:
    want = _gguf_values(tensors[qtype])
    blocks = read_blocks(tensors[qtype])
    module = _served(qtype, blocks)
    got = module.dequantized()
    if form(qtype) == "q8":
        assert torch.equal(got, want)
        return
    # the blocks' own affine per 32 is gguf's exactly ...
    q = torch.cat([blocks["qs"] & 15, blocks["qs"] >> 4], dim=-1).reshape(N, -1, 32).float()
    d, m = blocks["d"].float()[..., None], blocks["m"].float()[..., None]
    assert torch.equal((q * d + m).reshape(N, K), want)
    # ... and the kernel's differs only by scale and zero in bfloat16: (q - 8) s' + z', z = m + 8 s
    s16 = d.to(torch.bfloat16).float()
    z16 = (m + 8.0 * d).to(torch.bfloat16).float()
    assert torch.equal(got, ((q - 8.0) * s16 + z16).reshape(N, K))
    bound = (8.0 * d.abs() + (m + 8.0 * d).abs()) * 2.0**-8  # half a bf16 ulp of each, times |q - 8| <= 8
    assert ((got - want).reshape(N, -1, 32).abs() <= bound).all()


@pytest.mark.skipif(native_kernels() is None, reason="no C compiler: no native kernels")
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("qtype", [*INT4_TYPES, *Q8_TYPES])
def test_served_projection_computes_with_that_weight(tensors, qtype: str, rows: int) -> None:
    module = _served(qtype, read_blocks(tensors[qtype]))
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    want = x @ module.dequantized().t()
    got = module(x)
    assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()


@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_without_native_kernels_the_8_bit_forms_dequantize_per_call(
    tensors, qtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeserve.model import quant

    module = _served(qtype, read_blocks(tensors[qtype]))
    module._kernels = None  # as built where the native kernels are off (PIPESERVE_KERNELS=torch)
    quant._fallback_once.cache_clear()
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="pipeserve.model.quant"):
        assert torch.equal(module(x), F.linear(x, module.dequantized()))
        module(x)
    assert len([r for r in caplog.records if "dequantizes" in r.getMessage()]) == 1


@pytest.mark.parametrize("qtype", UNSERVED)
def test_an_unserved_type_is_refused_by_name(tmp_path: Path, qtype: Q, capsys) -> None:
    spec = DemoSpec(layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, vocab=512)
    hf = write_demo_model(tmp_path / "hf", spec)

    def mix(name: str) -> Q | None:
        return qtype if name.endswith("mlp.up_proj.weight") else None

    src = write_llama_gguf(hf, tmp_path / "m.gguf", quant=mix)
    with pytest.raises(ModelLoadError, match=f"{qtype.name} \\(e.g. blk.0.ffn_up.weight\\)") as err:
        convert_gguf(src, tmp_path / "out")
    assert f"supported: {', '.join(SERVED_TYPES)}" in str(err.value)
    assert not (tmp_path / "out").exists()
    assert main(["convert-gguf", str(src), str(tmp_path / "out")]) == 2
    printed = capsys.readouterr()
    assert qtype.name in printed.err and "Traceback" not in printed.err + printed.out
