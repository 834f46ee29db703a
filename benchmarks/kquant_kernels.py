"""One projection of the 169M checkpoint's shapes in isolation: Q6_K (its 6-bit packing), Q5_K's int8
form (scales and mins per 32) and the 4-bit path (Q4_1/Q4_K), µs per call (issue 28, point 3).

    python benchmarks/kquant_kernels.py --rows 1                    # this tree's native kernels
    python benchmarks/kquant_kernels.py --rows 1 --other old.so     # beside another build of them

`--other`: a shared object built from other sources (e.g. an earlier commit's native/*.c:
gcc -march=native -O3 -fopenmp -shared -fPIC -std=gnu11 *.c -o old.so -lm); rounds alternate the
libraries, medians and [min-max] are printed. Random weights (speed does not depend on them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from pipeserve.model.gguf_types import pack_q6k_scales
from pipeserve.model.quant import pack_nibbles
from pipeserve_kernels import native

SHAPES = [(1024, 2816), (1536, 1024), (2816 * 2, 1024)]  # down, qkv, gate_up of hidden 1024


def weights(n: int, k: int, g: torch.Generator) -> dict[str, tuple[torch.Tensor, ...]]:
    q6 = torch.randint(0, 256, (n, k // 256 * 192), generator=g, dtype=torch.uint8)
    d6 = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    q8 = torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8)
    qn = pack_nibbles(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    s, z = (torch.rand(n, k // 32, generator=g).bfloat16() for _ in range(2))
    d8, mn = torch.rand(n, k // 32, generator=g), torch.rand(n, k // 32, generator=g)
    return {"Q6_K": (q6, pack_q6k_scales(d6, sc)), "Q5_K int8": (q8, d8, mn), "4-bit": (qn, s, z)}


def call(lib: native.Native, kind: str, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> None:
    if kind == "Q6_K":
        lib.int8_linear(x, w[0], w[1], None)
    elif kind == "Q5_K int8":
        lib.int8_linear(x, w[0], w[1], None, w[2])
    else:
        lib.int4_linear(x, *w, 32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--other", type=Path, help="another build of the native kernels, timed beside")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    compiler = native.find_compiler()
    assert compiler is not None, "no C compiler"
    libs = {"this tree": native.Native(native.build(compiler))}
    if args.other:
        libs["other"] = native.Native(args.other)
    g = torch.Generator().manual_seed(0)
    w = {shape: weights(*shape, g) for shape in SHAPES}
    x = {k: torch.randn(args.rows, k, generator=g) for k in {k for _, k in SHAPES}}
    times: dict[tuple[str, str, tuple[int, int]], list[float]] = {}
    for r in range(args.rounds):
        for name, lib in list(libs.items())[:: 1 if r % 2 == 0 else -1]:
            for shape in SHAPES:
                for kind, wk in w[shape].items():
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        call(lib, kind, x[shape[1]], wk)
                    t = (time.perf_counter() - start) / args.calls * 1e6
                    times.setdefault((name, kind, shape), []).append(t)
    print(f"rows {args.rows}, {args.threads} thread(s), µs per call; load after: {os.getloadavg()}")
    print("| library | weight | [N, K] | µs, median [min–max] |\n|---|---|---|---:|")
    for (name, kind, shape), v in times.items():
        print(f"| {name} | {kind} | {list(shape)} | {statistics.median(v):.0f} [{min(v):.0f}–{max(v):.0f}] |")


if __name__ == "__main__":
    main()
