"""Triton kernels for the element-wise layer ops (the GPU path); attention is in triton_attention.py.

Same signatures and results as reference.py (its HF numerics are the oracle):
every kernel loads in the tensor's dtype, computes in float32 and rounds to
the dtype exactly where the reference's PyTorch ops round (so bfloat16
results match it to the rounding of the last op, float32 to a few ulp).
Tested on the CPU with TRITON_INTERPRET=1 (tests/kernels/).

Grids: one program per token row (rms_norm, rotary, store_kv), or per
(row, column tile) for silu_and_mul; BLOCK sizes are the next power of two
of the row, masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeserve_kernels.triton_checks import INDEX_DTYPES, check_same_dtype, check_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n,
    x_stride,
    res_stride,
    out_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=m, other=0.0)
        # The sum is rounded to the dtype as `x + residual` in PyTorch; the norm reads the rounded sum.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * out_stride + cols, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    normed = (xf * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def _rms_launch(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    sizes = check_tensor(op, "x", x, ("T", "hidden"))
    if residual is not None:
        check_tensor(op, "residual", residual, ("T", "hidden"), sizes)
        check_same_dtype(op, x=x, residual=residual)
    check_tensor(op, "weight", weight, ("hidden",), sizes)
    check_same_dtype(op, x=x, weight=weight)
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    if t:
        _rms_norm_kernel[(t,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out if res_out is not None else out,
            n,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n),
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] in x.dtype; the statistic is taken in float32."""
    return _rms_launch("rms_norm", x, None, weight, eps)[0]


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), one pass over the row."""
    out, res_out = _rms_launch("rms_norm_residual", x, residual, weight, eps)
    assert res_out is not None
    return out, res_out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    x_stride_t,
    x_stride_h,
    cs_stride,
    HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
):
    # neox style (rotate_half): out[:h] = x1*cos1 - x2*sin1, out[h:] = x2*cos2 + x1*sin2.
    row = tl.program_id(0)
    hs = tl.arange(0, HEADS_P)[:, None]
    cols = tl.arange(0, HALF_P)[None, :]
    m = (hs < heads) & (cols < HALF)
    base = x_ptr + row * x_stride_t + hs * x_stride_h + cols
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    cm = cols < HALF
    c1 = tl.load(cos_ptr + row * cs_stride + cols, mask=cm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * cs_stride + HALF + cols, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * cs_stride + cols, mask=cm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * cs_stride + HALF + cols, mask=cm, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # Each product is rounded to the dtype before the sum, as `q * cos + rotate_half(q) * sin` does.
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    obase = out_ptr + row * heads * (2 * HALF) + hs * (2 * HALF) + cols
    tl.store(obase, o1.to(dt), mask=m)
    tl.store(obase + HALF, o2.to(dt), mask=m)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    t, heads, d = x.shape
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t:
        _rotary_kernel[(t,)](
            x,
            cos,
            sin,
            out,
            heads,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            HALF=d // 2,
            HEADS_P=triton.next_power_of_2(heads),
            HALF_P=triton.next_power_of_2(d // 2),
        )
    return out


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D], cos/sin [T, D] (gathered by position; llama3 scaling is in the table)."""
    op = "apply_rotary"
    sizes = check_tensor(op, "q", q, ("T", "H", "D"))
    check_tensor(op, "k", k, ("T", "KVH", "D"), sizes)
    check_tensor(op, "cos", cos, ("T", "D"), sizes)
    check_tensor(op, "sin", sin, ("T", "D"), sizes)
    if sizes["D"] % 2:
        raise ValueError(f"{op}: head dim D={sizes['D']} must be even")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"{op}: cos and sin must share strides, got {cos.stride()} and {sin.stride()}")
    check_same_dtype(op, q=q, k=k, cos=cos, sin=sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu rounds before the product
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dt), mask=m)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up, [T, I]."""
    check_tensor("silu_and_mul", "gate_up", gate_up, ("T", "2I"))
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"silu_and_mul: gate_up must be [T, 2I] with an even last dim, got {two_i}")
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    kv_heads,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    c_stride_n,
    c_stride_b,
    c_stride_h,
    BS: tl.constexpr,
    D: tl.constexpr,
    HEADS_P: tl.constexpr,
    D_P: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    hs = tl.arange(0, HEADS_P)[:, None]
    ds = tl.arange(0, D_P)[None, :]
    m = (hs < kv_heads) & (ds < D)
    dst = (slot // BS) * c_stride_n + (slot % BS) * c_stride_b + hs * c_stride_h + ds
    k = tl.load(k_ptr + row * k_stride_t + hs * k_stride_h + ds, mask=m)
    v = tl.load(v_ptr + row * v_stride_t + hs * v_stride_h + ds, mask=m)
    tl.store(kc_ptr + dst, k, mask=m)
    tl.store(vc_ptr + dst, v, mask=m)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into the cache slots [N, BS, KVH, D] named by slot_mapping [T].

    Slots are not bounds-checked on the device (a sync per step): the model
    runner checks block ids against the pool when it applies a plan.
    """
    op = "store_kv"
    sizes = check_tensor(op, "k", k, ("T", "KVH", "D"))
    check_tensor(op, "v", v, ("T", "KVH", "D"), sizes)
    check_tensor(op, "k_cache", k_cache, ("N", "BS", "KVH", "D"), sizes)
    check_tensor(op, "v_cache", v_cache, ("N", "BS", "KVH", "D"), sizes)
    check_tensor(op, "slot_mapping", slot_mapping, ("T",), sizes, dtypes=INDEX_DTYPES, unit_last=False)
    check_same_dtype(op, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{op}: k_cache and v_cache must share strides: {k_cache.stride()}, {v_cache.stride()}"
        )
    t, kvh, d = k.shape
    if t:
        _store_kv_kernel[(t,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            kvh,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            BS=k_cache.shape[1],
            D=d,
            HEADS_P=triton.next_power_of_2(kvh),
            D_P=triton.next_power_of_2(d),
        )
