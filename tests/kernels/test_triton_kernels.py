"""Every Triton kernel against its PyTorch reference (reference.py, HF numerics), on the CPU.

TRITON_INTERPRET=1 is set before triton is first imported (the kernel modules import it), so the
kernels run in Triton's interpreter. Small shapes; block boundaries (contexts of 1, BS-1, BS, BS+1
and past several blocks), GQA ratios 1/4/8, float32 and bfloat16.

Tolerances (atol = rtol): float32 1e-5 (summation order and rsqrt differ from PyTorch's by a few
ulp); bfloat16 3e-2, a few ulp (2^-8 relative each): the interpreter rounds exact ties away from
even, a one-ulp flip is then scaled by the next rounded op (the weight, the product), and attention
accumulates in float32 where SDPA rounds its intermediates.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before any triton import: kernels run on the CPU

import pytest
import torch

import pipeserve_kernels.reference as ref
from pipeserve_kernels import triton_attention as tatt
from pipeserve_kernels import triton_ops as tops
from pipeserve_kernels.dispatch import backend_from_env

DTYPES = [torch.float32, torch.bfloat16]
BS = 4


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 if got.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_residual(dtype: torch.dtype) -> None:
    x, r, w = randn(5, 40, dtype=dtype), randn(5, 40, dtype=dtype, seed=1), randn(40, dtype=dtype, seed=2)
    close(tops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    normed, res = tops.rms_norm_residual(x, r, w, 1e-5)
    want_normed, want_res = ref.rms_norm_residual(x, r, w, 1e-5)
    close(res, want_res)
    close(normed, want_normed)
    close(tops.rms_norm(x[:1], w, 1e-6), ref.rms_norm(x[:1], w, 1e-6))  # one token


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_qkv_views(dtype: torch.dtype) -> None:
    # q/k as the model passes them: views into one fused qkv projection (row stride != H * D).
    t, h, kvh, d = 3, 8, 2, 16
    qkv = randn(t, (h + 2 * kvh) * d, dtype=dtype)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    angles = torch.arange(t)[:, None] * torch.rand(d // 2, generator=torch.Generator().manual_seed(3))
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got_q, got_k = tops.apply_rotary(q, k, cos, sin)
    want_q, want_k = ref.apply_rotary(q, k, cos, sin)
    close(got_q, want_q)
    close(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    for t, inter in [(1, 8), (4, 50), (2, 1500)]:  # 1500 spans two column tiles
        gu = randn(t, 2 * inter, dtype=dtype)
        close(tops.silu_and_mul(gu), ref.silu_and_mul(gu))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_into_pages(dtype: torch.dtype) -> None:
    kvh, d = 2, 16
    kv = randn(5, 2 * kvh * d, dtype=dtype)  # strided views, as split from the qkv projection
    k, v = kv[:, : kvh * d].view(5, kvh, d), kv[:, kvh * d :].view(5, kvh, d)
    slots = torch.tensor([0, BS - 1, BS, 2 * BS + 1, 9 * BS + BS - 1])
    caches = [torch.zeros(10, BS, kvh, d, dtype=dtype) for _ in range(4)]
    tops.store_kv(k, v, caches[0], caches[1], slots)
    ref.store_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == k.count_nonzero()


def paged_cache(kvh: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(16, BS, kvh, d, dtype=dtype, seed=4), randn(16, BS, kvh, d, dtype=dtype, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode_block_boundaries_gqa(dtype: torch.dtype, group: int) -> None:
    kvh, d = 2, 16
    k_cache, v_cache = paged_cache(kvh, d, dtype)
    lens = torch.tensor([1, BS - 1, BS, BS + 1, 3 * BS + 2])
    # Scattered, 0-padded tables as the model runner builds them.
    tables = torch.tensor([[7, 0, 0, 0], [3, 0, 0, 0], [12, 0, 0, 0], [5, 9, 0, 0], [2, 15, 1, 11]])
    q = randn(len(lens), kvh * group, d, dtype=dtype, seed=6)
    got = tatt.paged_attention_decode(q, k_cache, v_cache, tables, lens, d**-0.5)
    close(got, ref.paged_attention_decode(q, k_cache, v_cache, tables, lens, d**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_prefill_over_cached_prefix(dtype: torch.dtype, group: int) -> None:
    kvh, d = 2, 16
    k_cache, v_cache = paged_cache(kvh, d, dtype)
    table = torch.tensor([6, 2, 14, 9, 0, 3, 8, 1, 13])
    for start, length in [(0, 1), (0, BS + 1), (BS - 1, BS), (BS + 1, 2 * BS + 3), (3 * BS, 1)]:
        q = randn(length, kvh * group, d, dtype=dtype, seed=start + length)
        got = tatt.paged_attention_prefill(q, k_cache, v_cache, table, start, d**-0.5)
        want = ref.paged_attention_prefill(q, k_cache, v_cache, table, start, d**-0.5)
        close(got, want)


def test_prefill_varlen_spans_equal_per_span_reference() -> None:
    kvh, group, d = 2, 4, 16
    k_cache, v_cache = paged_cache(kvh, d, torch.float32)
    spans = [
        (0, 5, [4, 7]),
        (BS, BS + 1, [1, 2, 3]),
        (BS + 3, 40, [5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0]),
    ]
    q = randn(sum(n for _, n, _ in spans), kvh * group, d, dtype=torch.float32, seed=7)
    width = max(len(t) for *_, t in spans)
    tables = torch.tensor([t + [0] * (width - len(t)) for *_, t in spans])
    cu = torch.tensor([0, 5, 5 + BS + 1, len(q)], dtype=torch.int32)
    starts = torch.tensor([s for s, _, _ in spans])
    got = tatt.paged_attention_prefill_varlen(q, k_cache, v_cache, tables, cu, starts, 40, d**-0.5)
    for i, (start, _, table) in enumerate(spans):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = ref.paged_attention_prefill(q[rows], k_cache, v_cache, torch.tensor(table), start, d**-0.5)
        close(got[rows], want)


def test_bad_shapes_raise_clear_errors() -> None:
    f32 = torch.float32
    k_cache, v_cache = paged_cache(2, 16, f32)
    q = randn(3, 8, 16, dtype=f32)
    tables, lens = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, dtype=torch.long)
    cases = [
        (
            lambda: tops.rms_norm(randn(4, 8, dtype=f32), randn(9, dtype=f32), 1e-6),
            r"weight must be \[hidden\]",
        ),
        (lambda: tops.rms_norm(randn(8, dtype=f32), randn(8, dtype=f32), 1e-6), r"x must be \[T, hidden\]"),
        (lambda: tops.silu_and_mul(randn(2, 7, dtype=f32)), r"gate_up must be \[T, 2I\]"),
        (lambda: tops.apply_rotary(q, q[:, :2], randn(3, 15, dtype=f32), randn(3, 15, dtype=f32)), "cos"),
        (
            lambda: tops.apply_rotary(
                q, q[:, :2], randn(3, 16, dtype=torch.bfloat16), randn(3, 16, dtype=f32)
            ),
            "dtype",
        ),
        (
            lambda: tops.store_kv(q, q, k_cache, v_cache, lens),
            r"k_cache must be \[N, BS, KVH, D\] with KVH=8",
        ),
        (lambda: tatt.paged_attention_decode(q, k_cache, v_cache, tables[:2], lens, 0.25), "block_tables"),
        (
            lambda: tatt.paged_attention_decode(q[:, :3], k_cache, v_cache, tables, lens, 0.25),
            "multiple of kv",
        ),
        (
            lambda: tatt.paged_attention_decode(q, k_cache, v_cache, tables.float(), lens, 0.25),
            "block_tables",
        ),
        (
            lambda: tatt.paged_attention_decode(q.transpose(1, 2), k_cache, v_cache, tables, lens, 0.25),
            "q must",
        ),
        (
            lambda: tatt.paged_attention_prefill(q, k_cache, v_cache, tables, 0, 0.25),
            r"block_table must be \[nb\]",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_backend_setting_is_validated() -> None:
    assert backend_from_env({}) == "auto"
    assert backend_from_env({"PIPESERVE_KERNELS": "Triton"}) == "triton"
    with pytest.raises(ValueError, match="PIPESERVE_KERNELS must be one of"):
        backend_from_env({"PIPESERVE_KERNELS": "cuda"})


def kernels_in_subprocess(env: dict[str, str], code: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PIPESERVE_KERNELS")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_dispatch_picks_the_backend_from_the_environment() -> None:
    # auto on a machine without CUDA: the CPU functions themselves, and triton never imported (start-up).
    probe = (
        "import sys, torch, pipeserve_kernels as K;"
        "print(K.BACKEND, K.paged_attention_decode.__module__, 'triton' in sys.modules)"
    )
    backend, module, imported = kernels_in_subprocess({}, probe).split()
    assert (backend, imported) == ("auto", "False") and "triton" not in module
    # triton forced without CUDA and without the interpreter: a clear error, not a crash in a launch.
    forced = (
        "import torch, pipeserve_kernels as K\n"
        "try:\n    K.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "except ValueError as e:\n    print(K.BACKEND, K.rms_norm.__module__, '|', e)\n"
    )
    out = kernels_in_subprocess({"PIPESERVE_KERNELS": "triton"}, forced)
    assert out.startswith("triton pipeserve_kernels.triton_ops |") and "TRITON_INTERPRET=1" in out
