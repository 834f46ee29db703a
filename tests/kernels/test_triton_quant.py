"""The Triton weight-only int4 / int8 projections (triton_quant.py) and Int4Linear / Int8Linear on
their Triton path, on the CPU under TRITON_INTERPRET=1 (set before triton is first imported); also
GGUF's 8-bit block forms (q8_blocks_linear: scales per 32 or 16, mins) and Q8Linear over them.

Oracle: F.linear in float32 over the dequantized weight (w rounded to the activation dtype for int4,
as the kernel feeds tl.dot with it), on the activation's values. Tolerance on max |y - ref|:
float32 1e-5 * (1 + max |ref|) (summation order); float16 1e-2 * max |ref| (the output is rounded
once to the dtype, and int8's scale is applied to the accumulator instead of to each rounded
weight); bfloat16 3e-2 * max |ref|, as test_triton_kernels.py: the interpreter (triton 3.9) converts
float32 to bfloat16 by truncation, not round-to-nearest (checked on a copy kernel), so the weight
tile and the output are each up to an ulp off, with a bias (seen: 1e-2 of max |ref| at K = 128).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any triton import: kernels run on the CPU

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import pipeserve_kernels
from conftest import hf_greedy, random_prompts
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.model.gguf_types import pack_q6k_scales, q6k_values
from pipeserve.model.quant import (
    INT4PACK_LAYOUT,
    NIBBLE_LAYOUT,
    Int4Linear,
    Int8Linear,
    pack_nibbles,
    quantize_int4,
    unpack_nibbles,
)
from pipeserve.model.quant_q8 import Q8Linear
from pipeserve_kernels.triton_quant import BLOCK_K, int4_linear, int8_linear, q8_blocks_linear

RUN = Path(__file__).with_name("engine_run.py")
MAX_TOKENS = 5


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    err = (got.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    tol = {torch.float32: 1e-5 * (1 + scale), torch.float16: 1e-2 * scale}.get(got.dtype, 3e-2 * scale)
    assert err <= tol, f"max error {err} > {tol} (max |ref| {scale})"


def int4_case(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    z = torch.randn(n, k // group, generator=g) * 0.1
    w = ((q.float() - 8).reshape(n, k // group, group) * s[..., None] + z[..., None]).reshape(n, k)
    return q, s, z, w


# K = 96 and 160 are multiples of the group 32 but not of BLOCK_K (64); K = 256 spans two groups of 128.
SHAPES = [(1, 48, 96, 32), (5, 70, 160, 32), (16, 64, 256, 128), (64, 20, 128, 128)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("m,n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_linear_matches_the_dequantized_weight(m: int, n: int, k: int, group: int, dtype) -> None:
    assert BLOCK_K == 64 and any(k % BLOCK_K for _, _, k, _ in SHAPES)
    q, s, z, _ = int4_case(n, k, group, seed=m)
    s, z = s.to(dtype), z.to(dtype)  # scales in the activation dtype
    groups = (q.float() - 8).reshape(n, k // group, group)
    w = (groups * s.float()[..., None] + z.float()[..., None]).reshape(n, k)
    x = randn(m, k, seed=m + 1).to(dtype)
    got = int4_linear(x, pack_nibbles(q), s, z, group)
    assert got.dtype == dtype
    close(got, F.linear(x.float(), w.to(dtype).float()))


@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (5, 70, 160), (16, 64, 64), (64, 20, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_matches_the_dequantized_weight(m: int, n: int, k: int, dtype) -> None:
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(dtype)
    x = randn(m, k, seed=m + 1).to(dtype)
    got = int8_linear(x, q, s)
    assert got.dtype == dtype
    close(got, F.linear(x.float(), q.float() * s.float()[:, None]))


def q8_blocks_case(n: int, k: int, sub: int, mins: bool, seed: int):
    """GGUF's 8-bit block forms: q int8, scales per `sub` (32; 16: Q6_K), mins per 32 (Q5_1, Q5_K)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // sub, generator=g) * 0.01 + 1e-3
    m = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1 if mins else None
    w = (q.float().reshape(n, -1, sub) * s[..., None]).reshape(n, k)
    if m is not None:
        w = (w.reshape(n, -1, 32) + m[..., None]).reshape(n, k)
    return q, s, m, w


@pytest.mark.parametrize(("sub", "mins"), [(32, False), (32, True), (16, False)])
@pytest.mark.parametrize("m,n,k", [(1, 48, 96), (5, 70, 160), (64, 20, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_blocks_linear_matches_the_dequantized_weight(
    m: int, n: int, k: int, sub: int, mins: bool, dtype
) -> None:
    q, s, mn, w = q8_blocks_case(n, k, sub, mins, seed=m + sub)
    x = randn(m, k, seed=m).to(dtype)
    got = q8_blocks_linear(x, q, s, mn)
    assert got.dtype == dtype
    close(got, F.linear(x.float(), w.to(dtype).float()))


def test_gguf_8_bit_blocks_on_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8Linear (a Q6_K or Q5_K tensor's form) computes with the Triton kernel where it runs."""
    monkeypatch.setattr(pipeserve_kernels, "BACKEND", "triton")
    for sub, mins in ((16, False), (32, True)):
        q, s, mn, w = q8_blocks_case(24, 256, sub, mins, seed=9)
        if sub == 16:  # Q6_K as the file has it: its 6-bit packing, d per 256, int8 sub-scales
            q = torch.randint(
                0, 256, (24, 192), generator=torch.Generator().manual_seed(9), dtype=torch.uint8
            )
            d, sc = s.abs().amax(dim=1, keepdim=True).half().float() / 127, torch.randint(-127, 128, (24, 16))
            s = (d * sc.float()).reshape(24, 16)
            w = (q6k_values(q).float().reshape(24, -1, 16) * s[..., None]).reshape(24, 256)
            s = pack_q6k_scales(d, sc.to(torch.int8))
        bias = randn(24, seed=10)
        lin = Q8Linear(q, s, bias, torch.float32, mins=mn, fallback=True)
        assert torch.equal(lin.dequantized(), w)
        x = randn(2, 3, 256, seed=11)
        close(lin(x), F.linear(x, w, bias))


def test_nibble_order() -> None:
    q = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_nibbles(q).tolist() == [[0x21, 0x43]]  # element 2j low, 2j + 1 high
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)


def test_gguf_built_int4_linear_on_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Int4Linear built on the CPU from GGUF-style blocks (q, d, m), as gguf mode builds it before
    the stage moves to its device, converts to the Triton layout when moved under the Triton backend
    (as `.to("cuda")` does), computes F.linear over its own dequantized() weight there, and converts
    back to the CPU int4pack bit for bit."""
    n, k, group = 48, 96, 32
    q, d, _, _ = int4_case(n, k, group, seed=3)
    mins = -8.0 * d + 0.01  # Q4_1-style block minimum
    bias = randn(n, seed=4)
    monkeypatch.setattr(pipeserve_kernels, "BACKEND", "torch")  # torch's int4pack, not the native kernels
    lin = Int4Linear(None, bias, group, quantized=(q, d, mins), out_dtype=torch.float32)
    assert lin.layout == INT4PACK_LAYOUT
    packed_cpu, cpu_ref = lin.qweight.clone(), lin.dequantized()
    monkeypatch.setattr(pipeserve_kernels, "BACKEND", "triton")
    lin.to("cpu")
    assert lin.layout == NIBBLE_LAYOUT and lin.qweight.shape == (n, k // 2)
    assert torch.equal(unpack_nibbles(lin.qweight), q)
    ref = lin.dequantized()
    torch.testing.assert_close(ref, cpu_ref, atol=0.0, rtol=2**-8)  # the CPU one is rounded to bf16
    x = randn(2, 3, k, seed=5)
    close(lin(x), F.linear(x, ref, bias))
    monkeypatch.setattr(pipeserve_kernels, "BACKEND", "torch")
    lin.to("cpu")
    assert lin.layout == INT4PACK_LAYOUT and torch.equal(lin.qweight, packed_cpu)


def test_modules_built_for_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeserve_kernels, "BACKEND", "triton")
    w = randn(24, 64, seed=6).bfloat16()
    lin4 = Int4Linear(w, None, 32)
    assert lin4.layout == NIBBLE_LAYOUT
    q, _, _ = quantize_int4(w, 32)
    assert torch.equal(unpack_nibbles(lin4.qweight), q)
    x = randn(3, 64, seed=7).bfloat16()
    close(lin4(x), F.linear(x.float(), lin4.dequantized().bfloat16().float()))
    lin8 = Int8Linear(w, None)
    close(lin8(x), F.linear(x.float(), lin8.dequantized()))


def test_refusals() -> None:
    q = torch.zeros(8, 32, dtype=torch.uint8)
    s = torch.ones(8, 2)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        int4_linear(x, q.to(torch.int8), s, s, 32)
    with pytest.raises(ValueError, match=r"x's K=64 must be a multiple of the group 128"):
        int4_linear(x, q, s, s, 128)
    with pytest.raises(ValueError, match=r"qweight must be \[N, K/2\]"):
        int4_linear(x, torch.zeros(8, 64, dtype=torch.uint8), s, s, 32)
    with pytest.raises(ValueError, match=r"zeros must be \[N, K/G\]"):
        int4_linear(x, q, s, torch.ones(8, 4), 32)
    with pytest.raises(ValueError, match="x must have dtype"):
        int4_linear(x.to(torch.int32), q, s, s, 32)
    with pytest.raises(ValueError, match=r"scales must be \[N\]"):
        int8_linear(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(7))
    with pytest.raises(ValueError, match="qweight must have dtype"):
        int8_linear(x, torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8))
    with pytest.raises(ValueError, match="not one per 16 or 32"):
        q8_blocks_linear(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 8))
    with pytest.raises(ValueError, match=r"mins must be \[N, K/32\]"):
        q8_blocks_linear(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), torch.ones(8, 4))


def dequantized_checkpoint(model: Path, out: Path, group: int) -> Path:
    """model's files with every decoder projection replaced by the weight Int4Linear computes with on
    the Triton path: (q - 8) * bf16(s) + bf16(m + 8 s), exact in float32."""
    shutil.copytree(model, out)
    tensors = load_file(model / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("proj.weight") and w.shape[1] % group == 0:
            q, s, m = quantize_int4(w, group)
            sb, zb = s.bfloat16().float(), (m + 8.0 * s).bfloat16().float()
            groups = (q.float() - 8.0).reshape(w.shape[0], -1, group)
            tensors[name] = (groups * sb[..., None] + zb[..., None]).reshape(w.shape).to(w.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_engine_int4_on_the_triton_path_equals_hf_on_its_dequantized_weights(tmp_path: Path) -> None:
    """The engine with --quantization int4 on the Triton kernels (a subprocess: PIPESERVE_KERNELS=triton,
    TRITON_INTERPRET=1; every projection is an Int4Linear in the Triton layout, float32 activations)
    generates transformers' greedy ids over the same dequantized weights."""
    spec = DemoSpec(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=1)
    model = write_demo_model(tmp_path / "tiny", spec)
    prompts = [[5], *random_prompts(2, 5, 14, 1024, seed=12)]
    env = {**os.environ, "PIPESERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(RUN), str(model), "1", json.dumps(prompts), str(MAX_TOKENS), "int4"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton"
    reference = dequantized_checkpoint(model, tmp_path / "dequantized", 32)
    assert out["ids"] == [hf_greedy(reference, p, MAX_TOKENS, ignore_eos=True) for p in prompts]
