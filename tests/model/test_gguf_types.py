"""Each GGUF type served from its blocks (model/gguf_types.py) against gguf-py's dequantization.

One GGUF file holds a [24, 512] tensor of every block type, written by the project's writer
(gguf-py's quantizers, our reference quantizer for Q5_x and the K-quants). For each:
* the q8 form (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) holds exactly gguf's values (bit for bit);
* the int4 form (Q4_0, Q4_1, Q4_K): the blocks' own scale/min give gguf's values bit for bit, and
  the served weight differs only by rounding scale and zero to bfloat16 (the kernel's type);
* the served projection computes x @ W^T with the weight it claims, at decode and prefill row
  counts (x rounded to int16 per 32 by the kernels: 1e-3 of the largest output), and so does each
  8-bit form on the native kernels built for every x86 level this CPU runs (AVX-512 VNNI's
  vnni.c, AVX2's int16 path, the float tiles without AVX2), K with a tail past 512 and 64;
* without the native kernels (PIPESERVE_KERNELS=torch) the 8-bit forms dequantize per call into
  torch's product, said once (CUDA: tests/kernels/test_triton_quant.py).
A file with a type outside the served ones is refused before anything is written, naming the
type and the supported ones (the CLI: exit 2, no traceback).
"""

from __future__ import annotations

import logging
import platform
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
from pipeserve.model.quant import Int4Linear, native_kernels
from pipeserve.model.quant_q8 import Q8Linear
from pipeserve_kernels import native

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


# x86 levels other than this CPU's (gcc -march) and the CPU flags each needs to run here, as
# tests/kernels/test_native.py builds them: AVX-512 without VNNI and AVX2 alone take dense.c's int16
# path, x86-64-v2 the float tiles; this CPU's own build (AVX-512 VNNI here) takes vnni.c.
LEVELS = {
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma", "f16c"},
    "haswell": {"avx2", "fma", "f16c", "bmi2"},
    "x86-64-v2": {"sse4_2", "popcnt"},
}


@pytest.fixture(scope="module", params=["native", *LEVELS])
def level_kernels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> native.Native:
    if native_kernels() is None:
        pytest.skip("no C compiler: no native kernels")
    if request.param == "native":
        return native_kernels()
    flags = set()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    if platform.machine() not in ("x86_64", "AMD64") or not LEVELS[request.param] <= flags:
        pytest.skip(f"this CPU cannot run code built for {request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPESERVE_HOME", str(tmp_path_factory.mktemp(request.param)))
        return native.Native(native.build(native.find_compiler(), request.param))


# K per 8-bit form: vnni.c takes 16 blocks of 32 at a time and Q6_K 256 at a time, so each K leaves a
# tail: 1280 (K-quants: 40 blocks, 5 super-blocks) and 1312 (41 blocks: an odd one, half a vector).
WIDE_K = {"Q5_K": 1280, "Q6_K": 1280, "Q8_0": 1312, "Q5_0": 1312, "Q5_1": 1312}


@pytest.fixture(scope="module")
def wide_tensors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each 8-bit form's type over [40, WIDE_K] (40 rows: dense.c's tasks of 16 and a tail)."""
    w = np.random.default_rng(5).standard_normal((40, 1312)).astype(np.float32) * 0.03
    w[:, 1200:] *= 20.0  # one region far larger: scales differ along the row
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name in Q8_TYPES:
        wk = np.ascontiguousarray(w[:, : WIDE_K[name]])
        writer.add_tensor(name, gguf_tensor(wk, Q[name]), raw_dtype=Q[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 13])
@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_8_bit_forms_compute_on_every_level(wide_tensors, level_kernels, qtype: str, rows: int) -> None:
    """The projection against float64 x @ W^T over gguf's values: within the bound x's rounding
    per 32 implies, |err| <= sum_k |w| max|x block| / 65278 (int16 steps; float tiles: exact)."""
    t, k = wide_tensors[qtype], WIDE_K[qtype]
    want_w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(40, k)
    module = _served(qtype, read_blocks(t))
    module._kernels = level_kernels
    assert torch.equal(module.dequantized(), want_w)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[0, 64:96] *= 100.0  # one block of x far larger than the rest: x's scales are per block
    got = module(x).double()
    ref = x.double() @ want_w.double().t()
    block_max = x.abs().reshape(rows, -1, 32).amax(dim=2).repeat_interleave(32, dim=1).double()
    bound = (block_max / 65278) @ want_w.abs().double().t() + 1e-5 * ref.abs().max()
    assert bool(((got - ref).abs() <= bound).all()), ((got - ref).abs() / bound).max().item()


@pytest.mark.parametrize("qtype", Q8_TYPES)
def test_without_native_kernels_the_8_bit_forms_dequantize_per_call(
    tensors, qtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeserve.model import quant_q8

    module = _served(qtype, read_blocks(tensors[qtype]))
    module._kernels = None  # as built where the native kernels are off (PIPESERVE_KERNELS=torch)
    quant_q8._fallback_once.cache_clear()
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="pipeserve.model.quant_q8"):
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
