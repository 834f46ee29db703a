"""Triton weight-only int4 / int8 projections (the GPU path of model/quant.py's Int4Linear / Int8Linear).

y = x @ w.T with x [M, K] in the model dtype (float32, float16 or bfloat16) and w stored quantized;
each K tile of w is dequantized in registers, cast to x's dtype and fed to `tl.dot`, which
accumulates in float32; y [M, N] is rounded to x's dtype once, at the end.

Layouts (N = output features, K = input features, G = group, K % G == 0, K even):
  int4_linear(x, qweight, scales, zeros, group)
    qweight  uint8 [N, K/2]   two nibbles a byte: element 2j of a row is byte j & 15 (low nibble),
                              element 2j + 1 is byte j >> 4 (high nibble); q in 0..15
    scales   [N, K/G]         float32/float16/bfloat16, unit stride along K/G
    zeros    [N, K/G]         same dtype rules
    w[n, k] = (q[n, k] - 8) * scales[n, k // G] + zeros[n, k // G]
    (the same scale/zero convention as torch's `_weight_int4pack_mm_for_cpu`, so one Int4Linear
    dequantizes alike on either path: z = m + 8 s for w = q s + m)
  int8_linear(x, qweight, scales)
    qweight  int8 [N, K]      q in -127..127
    scales   [N]              per output channel: w[n, k] = q[n, k] * scales[n]
    (the scale is applied to the float32 accumulator, once per output)
  q8_blocks_linear(x, qweight, scales, mins)   GGUF's 8-bit block forms (quant_q8.Q8Linear: Q8_0, and
                              Q5_0, Q5_1, Q5_K, Q6_K as model/gguf_types.py stores them)
    qweight  int8 [N, K]
    scales   [N, K/S]         S = 32, or 16 (Q6_K): w[n, k] = q[n, k] * scales[n, k // S]
    mins     [N, K/32] or None  + mins[n, k // 32] (Q5_1, Q5_K)
    (dequantized per tile in float32, then rounded to x's dtype, as int4)

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); BLOCK_M = 16 for decode-sized M (tl.dot's minimum)
up to 64, BLOCK_N = 64, BLOCK_K = 64, K masked (a K that is a multiple of G but not of BLOCK_K is
fine: the group index is taken per element). Tested with TRITON_INTERPRET=1 on the CPU
(tests/kernels/test_triton_quant.py); timed against the dense bfloat16 matmul by
benchmarks/gpu_kernels.py where a GPU is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeserve_kernels.triton_checks import FLOAT_DTYPES, check_tensor, interpreting

BLOCK_N = 64
BLOCK_K = 64


def _dot_f32(x: torch.Tensor) -> bool:
    # float32 dots in IEEE precision (no TF32 rounding); the interpreter's 16-bit tl.dot is wrong
    # (triton 3.9), so there the tile, already rounded to x's dtype, is multiplied in float32.
    return x.dtype == torch.float32 or interpreting()


def _block_m(m: int) -> int:
    return max(16, min(64, triton.next_power_of_2(m)))


# The parts every kernel below shares: a K tile of x, the mask of w.T's tile, the dot, the store.
@triton.jit
def _x_tile(x_ptr, rm, rk, M, K, stride_xm):
    """x [BLOCK_M, BLOCK_K], zero outside [M, K]."""
    xm = (rm[:, None] < M) & (rk < K)[None, :]
    return tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=xm, other=0.0)


@triton.jit
def _w_mask(rk, rn, N, K):
    """The [BLOCK_K, BLOCK_N] mask of w.T's tile."""
    return (rk < K)[:, None] & (rn[None, :] < N)


@triton.jit
def _dot(acc, x, w, DOT_F32: tl.constexpr):
    if DOT_F32:
        x, w = x.to(tl.float32), w.to(tl.float32)
    return acc + tl.dot(x, w, input_precision="ieee")


@triton.jit
def _store(y_ptr, y, rm, rn, M, N, stride_ym):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_ym,
    GROUP: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, rm, rk, M, K, stride_xm)
        wm = _w_mask(rk, rn, N, K)
        # [BLOCK_K, BLOCK_N] tile of w.T: byte k // 2 holds element k in its low (even k) or high nibble.
        packed = tl.load(w_ptr + rn[None, :] * stride_wn + (rk // 2)[:, None], mask=wm, other=0)
        q = (packed >> ((rk % 2) * 4)[:, None]) & 15
        g = (rk // GROUP)[:, None]
        s = tl.load(s_ptr + rn[None, :] * stride_sn + g, mask=wm, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn[None, :] * stride_zn + g, mask=wm, other=0.0).to(tl.float32)
        w = ((q.to(tl.float32) - 8.0) * s + z).to(x.dtype)
        acc = _dot(acc, x, w, DOT_F32)
    _store(y_ptr, acc, rm, rn, M, N, stride_ym)


@triton.jit
def _int8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, rm, rk, M, K, stride_xm)
        wm = _w_mask(rk, rn, N, K)
        q = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=wm, other=0)
        w = q.to(tl.float32).to(x.dtype)  # |q| <= 127: exact in float16 and bfloat16
        acc = _dot(acc, x, w, DOT_F32)
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    _store(y_ptr, acc * s[None, :], rm, rn, M, N, stride_ym)


@triton.jit
def _q8_blocks_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    m_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_mn,
    stride_ym,
    SUB: tl.constexpr,
    HAS_MINS: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, rm, rk, M, K, stride_xm)
        wm = _w_mask(rk, rn, N, K)
        q = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=wm, other=0)
        s = tl.load(s_ptr + rn[None, :] * stride_sn + (rk // SUB)[:, None], mask=wm, other=0.0)
        w = q.to(tl.float32) * s.to(tl.float32)
        if HAS_MINS:
            mn = tl.load(m_ptr + rn[None, :] * stride_mn + (rk // 32)[:, None], mask=wm, other=0.0)
            w = w + mn.to(tl.float32)
        w = w.to(x.dtype)
        acc = _dot(acc, x, w, DOT_F32)
    _store(y_ptr, acc, rm, rn, M, N, stride_ym)


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype, over the nibble layout above."""
    op = "int4_linear"
    if group <= 0 or group % 2:
        raise ValueError(f"{op}: group must be a positive even number, got {group}")
    sizes = check_tensor(op, "x", x, ("M", "K"))
    k = sizes["K"]
    if k % group:
        raise ValueError(f"{op}: x's K={k} must be a multiple of the group {group}")
    sizes.update({"K/2": k // 2, "K/G": k // group})
    check_tensor(op, "qweight", qweight, ("N", "K/2"), sizes, dtypes=(torch.uint8,))
    check_tensor(op, "scales", scales, ("N", "K/G"), sizes, dtypes=FLOAT_DTYPES)
    check_tensor(op, "zeros", zeros, ("N", "K/G"), sizes, dtypes=FLOAT_DTYPES)
    m, n = sizes["M"], sizes["N"]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        bm = _block_m(m)
        _int4_kernel[(triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))](
            x, qweight, scales, zeros, y, m, n, k,
            x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
            GROUP=group, DOT_F32=_dot_f32(x), BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return y


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype, w = qweight * scales[:, None]."""
    op = "int8_linear"
    sizes = check_tensor(op, "x", x, ("M", "K"))
    check_tensor(op, "qweight", qweight, ("N", "K"), sizes, dtypes=(torch.int8,))
    check_tensor(op, "scales", scales, ("N",), sizes, dtypes=FLOAT_DTYPES)
    m, n, k = sizes["M"], sizes["N"], sizes["K"]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        bm = _block_m(m)
        _int8_kernel[(triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))](
            x, qweight, scales, y, m, n, k, x.stride(0), qweight.stride(0), y.stride(0),
            DOT_F32=_dot_f32(x), BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return y


def q8_blocks_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype, w = qweight * scales per 16 or 32 (+ mins per 32)."""
    op = "q8_blocks_linear"
    sizes = check_tensor(op, "x", x, ("M", "K"))
    k = sizes["K"]
    sub = k // scales.shape[-1] if scales.dim() == 2 and scales.shape[-1] else 0
    if sub not in (16, 32) or k % 32:
        raise ValueError(f"{op}: scales {tuple(scales.shape)} are not one per 16 or 32 of K={k}")
    sizes.update({"K/S": k // sub, "K/32": k // 32})
    check_tensor(op, "qweight", qweight, ("N", "K"), sizes, dtypes=(torch.int8,))
    check_tensor(op, "scales", scales, ("N", "K/S"), sizes, dtypes=FLOAT_DTYPES)
    if mins is not None:
        check_tensor(op, "mins", mins, ("N", "K/32"), sizes, dtypes=FLOAT_DTYPES)
    m, n = sizes["M"], sizes["N"]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        bm = _block_m(m)
        mp = scales if mins is None else mins  # not read without mins
        _q8_blocks_kernel[(triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))](
            x, qweight, scales, mp, y, m, n, k,
            x.stride(0), qweight.stride(0), scales.stride(0), mp.stride(0), y.stride(0),
            SUB=sub, HAS_MINS=mins is not None, DOT_F32=_dot_f32(x),
            BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip
    return y
