"""Kernel part of benchmarks/gpu_check.py: each Triton kernel vs its reference and vs SDPA, on cuda.

For every op: the largest difference (|a - b| / (1 + |b|)) from reference.py (the HF-numerics
oracle), the median time of the Triton kernel and of the reference, and the Triton kernel's
achieved bandwidth (bytes it must read and write / time) as a fraction of the device's measured
copy bandwidth (a torch copy of a 1 GiB tensor: read + write counted). Attention is also timed
against SDPA on contiguous K/V (enable_gqa): the bound a paged kernel should approach.
Llama-3-8B-like shapes (32 heads over 8 kv heads, head_dim 128, block size 16). Prepared for an
H200; not run yet (no GPU lent). A CPU smoke of this logic with tiny shapes under
TRITON_INTERPRET=1 printed every row within tolerance.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

import pipeserve_kernels.reference as ref
from pipeserve_kernels import triton_attention as tatt
from pipeserve_kernels import triton_ops as tops

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def timed(fn: Callable[[], object], iters: int = 20) -> float:
    """Median seconds of fn on the current stream (cuda events), after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device torch copy (read + write counted)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src))


def report(name: str, err: float, tol: float, t_kernel: float, t_ref: float, nbytes: int, bw: float) -> bool:
    ok = err <= tol
    print(
        f"  {name:34s} max rel diff {err:.2e} ({'ok' if ok else f'OVER {tol}'})"
        f"  triton {t_kernel * 1e6:8.1f} us"
        f"  reference {t_ref * 1e6:8.1f} us  {nbytes / t_kernel / 1e9:7.1f} GB/s = "
        f"{100 * nbytes / t_kernel / bw:5.1f}% of copy",
        flush=True,
    )
    return ok


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (1 + |b|): absolute near zero, relative for large values (bfloat16 ulps scale)."""
    return ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()


def elementwise(dtype: torch.dtype, bw: float) -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    t, hidden, inter, heads, kvh, d = 256, 4096, 14336, 32, 8, 128
    e = torch.tensor([], dtype=dtype).element_size()

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    x, r, w = rnd(t, hidden), rnd(t, hidden), rnd(hidden)
    pairs = zip(tops.rms_norm_residual(x, r, w, 1e-5), ref.rms_norm_residual(x, r, w, 1e-5), strict=True)
    ok = report(
        "rms_norm_residual",
        max(diff(a, b) for a, b in pairs),
        TOL[dtype],
        timed(lambda: tops.rms_norm_residual(x, r, w, 1e-5)),
        timed(lambda: ref.rms_norm_residual(x, r, w, 1e-5)),
        4 * t * hidden * e,
        bw,
    )
    q, k = rnd(t, heads, d), rnd(t, kvh, d)
    pos = torch.arange(t, device="cuda")[:, None] * torch.rand(d // 2, generator=g, device="cuda")
    cos, sin = torch.cat((pos, pos), -1).cos().to(dtype), torch.cat((pos, pos), -1).sin().to(dtype)
    got, want = tops.apply_rotary(q, k, cos, sin), ref.apply_rotary(q, k, cos, sin)
    ok &= report(
        "apply_rotary",
        max(diff(got[0], want[0]), diff(got[1], want[1])),
        TOL[dtype],
        timed(lambda: tops.apply_rotary(q, k, cos, sin)),
        timed(lambda: ref.apply_rotary(q, k, cos, sin)),
        2 * t * (heads + kvh) * d * e + 2 * t * d * e,
        bw,
    )
    gu = rnd(t, 2 * inter)
    ok &= report(
        "silu_and_mul",
        diff(tops.silu_and_mul(gu), ref.silu_and_mul(gu)),
        TOL[dtype],
        timed(lambda: tops.silu_and_mul(gu)),
        timed(lambda: ref.silu_and_mul(gu)),
        3 * t * inter * e,
        bw,
    )
    caches = [torch.zeros(4096, 16, kvh, d, dtype=dtype, device="cuda") for _ in range(4)]
    slots = torch.randperm(4096 * 16, generator=g, device="cuda")[:t]
    v = rnd(t, kvh, d)
    tops.store_kv(k, v, caches[0], caches[1], slots)
    ref.store_kv(k, v, caches[2], caches[3], slots)
    ok &= report(
        "store_kv",
        max(diff(caches[0], caches[2]), diff(caches[1], caches[3])),
        0.0,
        timed(lambda: tops.store_kv(k, v, caches[0], caches[1], slots)),
        timed(lambda: ref.store_kv(k, v, caches[2], caches[3], slots)),
        4 * t * kvh * d * e,
        bw,
    )
    return ok


def attention(dtype: torch.dtype, bw: float) -> bool:
    g = torch.Generator(device="cuda").manual_seed(1)
    heads, kvh, d, bs, batch, ctx = 32, 8, 128, 16, 64, 1024
    e = torch.tensor([], dtype=dtype).element_size()
    nb = ctx // bs + 1
    k_cache = torch.randn(batch * nb + 1, bs, kvh, d, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * nb, generator=g, device="cuda").view(batch, nb) + 1
    lens = torch.randint(ctx - 64, ctx + 1, (batch,), generator=g, device="cuda")
    q = torch.randn(batch, heads, d, generator=g, device="cuda").to(dtype)
    scale = d**-0.5
    # SDPA's bound: the same keys as contiguous [B, KVH, ctx, D] tensors, no paging, no masking.
    keys = k_cache[tables].view(batch, nb * bs, kvh, d)[:, :ctx].transpose(1, 2).contiguous()
    values = v_cache[tables].view(batch, nb * bs, kvh, d)[:, :ctx].transpose(1, 2).contiguous()
    t_sdpa = timed(
        lambda: F.scaled_dot_product_attention(q[:, :, None], keys, values, scale=scale, enable_gqa=True)
    )
    nbytes = int(lens.sum()) * kvh * d * e * 2 + 2 * q.numel() * e
    ok = report(
        f"paged_attention_decode B={batch} ctx~{ctx}",
        diff(
            tatt.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale),
            ref.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale),
        ),
        TOL[dtype],
        timed(lambda: tatt.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)),
        timed(lambda: ref.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)),
        nbytes,
        bw,
    )
    print(f"  {'(SDPA on contiguous K/V)':34s} {t_sdpa * 1e6:8.1f} us", flush=True)
    length, start = 512, 512
    qp = torch.randn(length, heads, d, generator=g, device="cuda").to(dtype)
    table = tables[0]
    ok &= report(
        f"paged_attention_prefill L={length}+{start}",
        diff(
            tatt.paged_attention_prefill(qp, k_cache, v_cache, table, start, scale),
            ref.paged_attention_prefill(qp, k_cache, v_cache, table, start, scale),
        ),
        TOL[dtype],
        timed(lambda: tatt.paged_attention_prefill(qp, k_cache, v_cache, table, start, scale)),
        timed(lambda: ref.paged_attention_prefill(qp, k_cache, v_cache, table, start, scale)),
        (start + length) * kvh * d * e * 2 + 2 * qp.numel() * e,
        bw,
    )
    return ok


def kernel_checks() -> bool:
    """Print the table; True if every kernel is within tolerance of its reference."""
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        print(f"kernels, {dtype}:", flush=True)
        ok &= elementwise(dtype, bw)
        ok &= attention(dtype, bw)
    from gpu_quant import quant_checks  # it imports this module's helpers

    ok &= quant_checks(bw)
    return ok
