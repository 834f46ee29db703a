"""Compile every Triton kernel for a GPU target, on a machine without a GPU.

    python tests/kernels/triton_compile.py [--arch 90]

The interpreter (TRITON_INTERPRET=1) runs a kernel as Python: it accepts what the compiler refuses
(a global that is not a constexpr, a construct the code generator lacks). So each kernel is also
put through Triton's real pipeline (AST -> TTIR -> TTGIR -> LLVM -> PTX -> cubin, ptxas from the
wheel) for an NVIDIA target, in every variant of its constexpr flags and in bfloat16 and float32,
with the argument types its wrapper passes. Must run WITHOUT TRITON_INTERPRET (the kernels must be
JITFunctions). Prints one line per variant; exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import traceback
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the interpreter does not compile")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pipeserve_kernels import triton_attention as att
from pipeserve_kernels import triton_ops as ops
from pipeserve_kernels import triton_quant as quant

# Scalars the wrappers pass as Python floats; every other scalar is an int (sizes, strides).
FLOAT_SCALARS = {"scale", "softcap", "eps"}
# Pointers to integers: block tables, lengths, slots (int32 as the runner builds them), packed weights.
INT_POINTERS = {
    "bt_ptr": "*i32",
    "lens_ptr": "*i32",
    "cu_ptr": "*i32",
    "start_ptr": "*i32",
    "slot_ptr": "*i64",
}
FLAGS = ("HAS_WINDOW", "HAS_SOFTCAP", "HAS_RESIDUAL", "HAS_MINS")


def _kernels(dtype: str) -> list[tuple[Any, dict[str, Any], dict[str, str]]]:
    """(kernel, constexprs other than the flags, pointer types other than `dtype`) per kernel."""
    f32 = dtype == "fp32"
    blocks = dict(BLOCK_M=16, BLOCK_N=quant.BLOCK_N, BLOCK_K=quant.BLOCK_K, DOT_F32=f32)
    return [
        (att._decode_kernel, dict(G=4, G_P=4, D=64, D_P=64, BS=16, TILE=64), {}),
        (att._prefill_kernel, dict(G=4, D=64, D_P=64, BS=16, BM=32, BN=32, DOT_F32=f32), {}),
        (ops._rms_norm_kernel, dict(BLOCK=1024), {}),
        (ops._rotary_kernel, dict(HALF=32, HEADS_P=8, HALF_P=32), {}),
        (ops._silu_mul_kernel, dict(BLOCK=1024), {}),
        (ops._store_kv_kernel, dict(BS=16, D=64, HEADS_P=4, D_P=64), {}),
        (quant._int4_kernel, dict(GROUP=32, **blocks), {"w_ptr": "*u8"}),
        (quant._int8_kernel, blocks, {"w_ptr": "*i8"}),
        (quant._q8_blocks_kernel, dict(SUB=32, **blocks), {"w_ptr": "*i8"}),
    ]


def _signature(kernel: Any, consts: dict[str, Any], pointers: dict[str, str], dtype: str) -> dict[str, str]:
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = pointers.get(p.name) or INT_POINTERS.get(p.name) or f"*{dtype}"
        else:
            sig[p.name] = "fp32" if p.name in FLOAT_SCALARS else "i32"
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in consts]
    if missing:
        raise KeyError(f"{kernel.fn.__name__}: no value for constexpr {missing}")
    return sig


def variants(dtype: str) -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """Every (name, kernel, signature, constexprs), each flag of a kernel on and off."""
    out = []
    for kernel, consts, pointers in _kernels(dtype):
        flags = [p.name for p in kernel.params if p.name in FLAGS]
        for values in itertools.product((False, True), repeat=len(flags)):
            full = {**consts, **dict(zip(flags, values, strict=True))}
            sig = _signature(kernel, full, pointers, dtype)
            on = ",".join(f for f, v in zip(flags, values, strict=True) if v) or "-"
            out.append((f"{kernel.fn.__name__}[{dtype}; {on}]", kernel, sig, full))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for dtype in ("bf16", "fp32"):
        for name, kernel, sig, consts in variants(dtype):
            try:
                source = ASTSource(fn=kernel, signature=sig, constexprs=consts)
                compiled = triton.compile(source, target=target)
                print(f"ok   {name}: {len(compiled.asm['cubin'])} bytes of sm_{args.arch} cubin", flush=True)
            except Exception:  # noqa: BLE001 - report every variant's failure, then fail the run
                failed += 1
                print(f"FAIL {name}\n{traceback.format_exc(limit=-3)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
