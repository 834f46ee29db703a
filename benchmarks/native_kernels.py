"""The native CPU kernels (pipeserve_kernels/native/q4.c) against torch's, and the native decode step
against the PyTorch layers (issue 22).

    python benchmarks/native_kernels.py projections      # q4.c vs torch's int4pack, per M
    python benchmarks/native_kernels.py float32          # q4.c's float32 product vs oneDNN and MKL
    python benchmarks/native_kernels.py step --rows 1 4 16 --context 256 [--pool float16]

`projections`: the default model's projection shapes with random int4 weights (group 32); per M the
mean time of q4.c's product (int16 x up to 16 rows, float tiles above), of dequantize + torch GEMM,
and of torch's `_weight_int4pack_mm_for_cpu` on bfloat16 x. `step`: the default model's stage in
gguf mode, decode rows at `--context`, KV blocks scattered over a pool of `--pool` dtype; the mean
forward time with the native step and with the PyTorch layers over the same weights.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch


def timed(reps: int, f: Callable[..., object], *args: object) -> float:
    """Mean ms of f(*args) over reps calls, after one warm-up call."""
    f(*args)
    start = time.perf_counter()
    for _ in range(reps):
        f(*args)
    return (time.perf_counter() - start) / reps * 1e3


def projections() -> None:
    import pipeserve_kernels
    from pipeserve.model.quant import Int4Linear, pack_nibbles, quantize_int4
    from pipeserve_kernels import native

    kernels = native.load()
    if kernels is None:
        raise SystemExit("the native kernels did not build (no C compiler?)")
    print("| projection | M | q4.c | dequantize + GEMM | torch int4pack |")
    print("|---|---|---|---|---|")
    for n, k in [(3072, 576), (576, 1536), (960, 576)]:
        w = torch.randn(n, k)
        q, s, m = quantize_int4(w, 32)
        qn, sb, zb = pack_nibbles(q), s.bfloat16().contiguous(), (m + 8 * s).bfloat16().contiguous()
        pipeserve_kernels.BACKEND = "torch"  # this module in torch's layout
        torch_layer = Int4Linear(w, None, 32)
        pipeserve_kernels.BACKEND = "auto"
        for rows in (1, 4, 16, 64, 256, 2048):
            x = torch.randn(rows, k)
            reps = max(3, 400 // rows)
            y = torch.empty(rows, n)
            ptrs = (
                x.data_ptr(),
                rows,
                k,
                qn.data_ptr(),
                sb.data_ptr(),
                zb.data_ptr(),
                n,
                32,
                None,
                y.data_ptr(),
            )
            fused = timed(reps, kernels._q4_matmul, *ptrs)
            gemm = timed(reps, lambda x, w: x @ w().t(), x, partial(kernels.int4_dequant, qn, sb, zb, 32))
            ref = timed(reps, torch_layer, x)
            print(f"| {n}x{k} | {rows} | {fused:.3f} | {gemm:.3f} | {ref:.3f} |", flush=True)


def float32() -> None:
    """q4.c's dense float32 product against oneDNN on a packed weight and MKL (F.linear)."""
    import torch.nn.functional as F

    from pipeserve_kernels import cpu_linear, native

    kernels = native.load()
    if kernels is None:
        raise SystemExit("the native kernels did not build (no C compiler?)")
    print("| weight | M | q4.c f32 (GB/s at M=1) | oneDNN packed | MKL |")
    print("|---|---|---|---|---|")
    for n, k in [(1536, 1024), (5632, 1024), (1024, 2816), (32000, 1024)]:
        w = torch.randn(n, k)
        packed = cpu_linear.pack_weight(w)
        for rows in (1, 4, 16, 32):
            x = torch.randn(rows, k)
            reps = 20 if n * k > 1 << 25 else 100
            ours = timed(reps, kernels.f32_linear, x, w)
            onednn = timed(reps, cpu_linear.linear, x, packed, None)
            mkl = timed(reps, F.linear, x, w)
            rate = f" ({n * k * 4 / ours / 1e6:.0f})" if rows == 1 else ""
            print(f"| {n}x{k} | {rows} | {ours:.3f}{rate} | {onednn:.3f} | {mkl:.3f} |", flush=True)


def step(rows_list: list[int], context: int, pool_dtype: str) -> None:
    from pipeserve.model.config import ModelConfig
    from pipeserve.model.default import default_model
    from pipeserve.model.layers import AttentionBatch, DecodeGroup
    from pipeserve.model.loader import load_stage_model
    from pipeserve.model.stage_model import StageSpec

    model_dir = default_model()
    cfg = ModelConfig.from_dir(model_dir, "float32")
    model = load_stage_model(
        model_dir, cfg, StageSpec(0, 1, 0, cfg.num_layers), context + 64, torch.device("cpu"), "gguf"
    )
    if model.native is None:
        raise SystemExit("no native decode step (the native kernels did not build?)")
    print("| rows | native step (ms) | PyTorch layers (ms) |")
    print("|---|---|---|")
    for rows in rows_list:
        bs, per = 16, context // 16 + 1
        g = torch.Generator().manual_seed(rows)
        pool = (
            torch.randn(cfg.num_layers, 2, rows * per + 1, bs, cfg.num_kv_heads, cfg.head_dim, generator=g)
            * 0.1
        )
        pool = pool.to(getattr(torch, pool_dtype))
        tables = (torch.randperm(rows * per, generator=g) + 1).view(rows, per)
        lens = torch.full((rows,), context)
        pos = lens - 1
        cos, sin = model.rotary.gather(pos)
        slots = tables[:, (context - 1) // bs] * bs + (context - 1) % bs
        batch = AttentionBatch(pos, slots, cos, sin, rows, [DecodeGroup(0, rows, tables, lens)], [])
        ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
        reps = max(5, 200 // rows)
        native = timed(reps, model, ids, batch, pool)
        decoder, model.native = model.native, None
        layers = timed(reps, model, ids, batch, pool)
        model.native = decoder
        print(f"| {rows} | {native:.2f} | {layers:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["projections", "float32", "step"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--pool", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "projections":
        projections()
    elif args.what == "float32":
        float32()
    else:
        step(args.rows, args.context, args.pool)


if __name__ == "__main__":
    main()
