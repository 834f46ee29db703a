"""The faster CPU ops (kernels/pipeserve_kernels/cpu.py) against their references (reference.py, HF numerics).

rms_norm, rms_norm_residual, apply_rotary and silu_and_mul promise bit-identical float32 results
(the same products and sums in the same order), so they are compared with torch.equal. Decode
attention reads fewer padded keys (and, for consecutive blocks, a view of the pool): equal within
float rounding. Shapes cover block boundaries (contexts 1, BS-1, BS, BS+1, several blocks), GQA
ratios 1/4/8, a table wider than the longest context, consecutive and scattered block ids, mixed
lengths in a group, and a 16-bit cache under a float32 query.
"""

from __future__ import annotations

import pytest
import torch

import pipeserve_kernels as K
import pipeserve_kernels.reference as ref
from pipeserve_kernels import cpu

BS = 4


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_cpu_functions_are_the_exported_cpu_path() -> None:
    if K.BACKEND == "triton":
        pytest.skip("PIPESERVE_KERNELS=triton exports the Triton kernels")
    names = ("rms_norm", "rms_norm_residual", "apply_rotary", "silu_and_mul", "paged_attention_decode")
    for name in (*names, "paged_attention_prefill"):
        assert getattr(K, name) is getattr(cpu, name), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_bit_identical(dtype: torch.dtype) -> None:
    x, w, r = randn(5, 96, dtype=dtype), randn(96, seed=1, dtype=dtype), randn(5, 96, seed=2, dtype=dtype)
    assert torch.equal(cpu.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    got, want = cpu.rms_norm_residual(x, r, w, 1e-5), ref.rms_norm_residual(x, r, w, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_rotary_bit_identical(heads: int, kv_heads: int) -> None:
    t, d = 7, 16
    q, k = randn(t, heads, d), randn(t, kv_heads, d, seed=1)
    ang = randn(t, d // 2, seed=2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    (gq, gk), (wq, wk) = cpu.apply_rotary(q, k, cos, sin), ref.apply_rotary(q, k, cos, sin)
    assert gq.shape == wq.shape and gk.shape == wk.shape
    assert torch.equal(gq, wq) and torch.equal(gk, wk)


def test_silu_and_mul_bit_identical() -> None:
    x = randn(6, 2 * 40)
    assert torch.equal(cpu.silu_and_mul(x), ref.silu_and_mul(x))


def pool(blocks: int, kv_heads: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(blocks, BS, kv_heads, d, seed=3, dtype=dtype), randn(
        blocks, BS, kv_heads, d, seed=4, dtype=dtype
    )


@pytest.mark.parametrize("ctx", [1, BS - 1, BS, BS + 1, 5 * BS + 2])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_decode_one_row(ctx: int, consecutive: bool, heads: int, kv_heads: int) -> None:
    d, nb = 16, -(-ctx // BS)
    k_cache, v_cache = pool(32, kv_heads, d, torch.float32)
    ids = list(range(9, 9 + nb)) if consecutive else torch.randperm(32)[:nb].tolist()
    table = torch.tensor([[*ids, 0, 0]])  # wider than the context: padding is never read
    q, lens = randn(1, heads, d, seed=5), torch.tensor([ctx])
    want = ref.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.25)
    for ws in (None, k_cache.new_empty(2, table.numel(), BS, kv_heads, d)):
        torch.testing.assert_close(
            cpu.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.25, ws), want
        )


@pytest.mark.parametrize("lens", [[9, 9, 9], [13, 5, 1, 8], [BS, BS + 1]])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_group(lens: list[int], cache_dtype: torch.dtype) -> None:
    heads, kv_heads, d = 8, 2, 16
    k_cache, v_cache = pool(40, kv_heads, d, cache_dtype)
    width = -(-max(lens) // BS) + 1
    table = torch.randperm(40)[: len(lens) * width].view(len(lens), width)
    q, ctx = randn(len(lens), heads, d, seed=6), torch.tensor(lens)
    ws = k_cache.new_empty(2, table.numel(), BS, kv_heads, d)
    got = cpu.paged_attention_decode(q, k_cache, v_cache, table, ctx, 0.25, ws)
    torch.testing.assert_close(got, ref.paged_attention_decode(q, k_cache, v_cache, table, ctx, 0.25))


def test_decode_reads_no_slot_past_the_context() -> None:
    """A NaN in every slot past a row's context (padding, later tokens) must not reach the output."""
    heads, kv_heads, d, ctx = 8, 2, 16, 6
    k_cache, v_cache = pool(8, kv_heads, d, torch.float32)
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, d)[2 * BS + ctx :] = float("nan")
    table, lens = torch.tensor([[2, 3, 4, 5]]), torch.tensor([ctx])
    out = cpu.paged_attention_decode(randn(1, heads, d), k_cache, v_cache, table, lens, 0.25)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("length", [1, BS, 3 * BS + 1])
@pytest.mark.parametrize("start_pos", [0, BS + 2])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_prefill_chunk(length: int, start_pos: int, consecutive: bool, heads: int, kv_heads: int) -> None:
    """Causal attention of a chunk (a first chunk on SDPA's causal flag, a later one on the mask),
    with a NaN in every slot past the chunk's last token: none of them may be read."""
    d, ctx = 16, start_pos + length
    nb = -(-ctx // BS)
    k_cache, v_cache = pool(32, kv_heads, d, torch.float32)
    ids = list(range(9, 9 + nb)) if consecutive else torch.randperm(32)[:nb].tolist()
    for cache in (k_cache, v_cache):
        cache[ids[-1], ctx - (nb - 1) * BS :] = float("nan")
    table = torch.tensor(ids)
    q = randn(length, heads, d, seed=7)
    got = cpu.paged_attention_prefill(q, k_cache, v_cache, table, start_pos, 0.25)
    torch.testing.assert_close(got, ref.paged_attention_prefill(q, k_cache, v_cache, table, start_pos, 0.25))
    assert torch.isfinite(got).all()
