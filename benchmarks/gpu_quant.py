"""Quant part of benchmarks/gpu_kernels.py: the Triton weight-only int4 / int8 projections on cuda.

Int4Linear (group 128) and Int8Linear built on the device from a random bfloat16 weight, so they run
pipeserve_kernels.triton_quant; each against F.linear over its own dequantized() weight in bfloat16
(diff as gpu_kernels.diff), timed against the dense bfloat16 matmul of the same shape (cuBLAS), with
the bytes the kernel must move (quantized weight + scales + activations) as achieved bandwidth.
Llama-3-8B-like projections (gate_up 4096 -> 28672, down 14336 -> 4096) at decode (M = 1, 16) and
prefill (M = 256) sizes. Prepared for an H200; not run yet (no GPU lent). Its logic was checked on
the CPU under TRITON_INTERPRET=1 with tiny shapes (tests/kernels/test_triton_quant.py covers the
kernels themselves).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from gpu_kernels import diff, report, timed

from pipeserve.model.quant import Int4Linear, Int8Linear

SHAPES = [("gate_up", 28672, 4096), ("down", 4096, 14336)]
DEVICE = "cuda"  # the CPU smoke (interpreter, tiny SHAPES) sets "cpu"
TOL = 3e-2  # bfloat16: output rounding of both sides, the weight rounded to bf16 before the dot


def quant_checks(bw: float) -> bool:
    """Print the rows (gpu_kernels' format); True if every layer is within TOL of its reference."""
    g = torch.Generator(device=DEVICE).manual_seed(2)
    ok = True
    print("weight-only projections, bfloat16 activations (reference time: dense bf16 F.linear):", flush=True)
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, generator=g, device=DEVICE) * 0.02).to(torch.bfloat16)
        layers: dict[str, Int4Linear | Int8Linear] = {
            "int4 g128": Int4Linear(w, None, 128),
            "int8": Int8Linear(w, None),
        }
        for label, lin in layers.items():
            wq = lin.dequantized().to(torch.bfloat16)
            qbytes = sum(b.numel() * b.element_size() for b in lin.buffers())
            for m in (1, 16, 256):
                x = torch.randn(m, k, generator=g, device=DEVICE).to(torch.bfloat16)
                ok &= report(
                    f"{label} {name} M={m}",
                    diff(lin(x), F.linear(x, wq)),
                    TOL,
                    timed(functools.partial(lin, x)),
                    timed(functools.partial(F.linear, x, w)),
                    qbytes + 2 * m * (n + k),
                    bw,
                )
            del wq
    return ok
