"""Kernel interface for the layer ops of a stage (package `pipeserve_kernels`).

Every op has a PyTorch reference in `reference.py`: the oracle that faster
kernels are tested against, and the CPU path unless `cpu.py` has a faster
PyTorch version (fewer ops, no KV gather for consecutive blocks). Model code calls
only the names exported here, so a backend swap touches this file alone.
Triton kernels (triton_ops.py, triton_attention.py) run for CUDA tensors;
PIPESERVE_KERNELS forces a backend (dispatch.py). The weight-only int4/int8
projections (triton_quant.py) are not in this table: model/quant.py's modules
call them for CUDA tensors or under PIPESERVE_KERNELS=triton.

Shapes (T = tokens in the step, H / KVH = query / kv heads, D = head_dim,
N = KV blocks, BS = block size):
  k_cache, v_cache      [N, BS, KVH, D]   one layer's slice of the KV pool
  slot_mapping          [T]               block_id * BS + offset, per new token
  block_tables          [B, max_blocks]   padded with 0 past a row's blocks
"""

import torch

from pipeserve_kernels import cpu, cpu_linear, native, reference
from pipeserve_kernels.dispatch import backend_from_env, cuda_triton_available, select

# PIPESERVE_KERNELS=auto|torch|triton (dispatch.py); read once at import, an immutable choice.
BACKEND = backend_from_env()
_GPU = BACKEND == "auto" and cuda_triton_available()

# The dispatch table: exported name -> its CPU function; the Triton kernel of the same name is found
# by dispatch.TRITON_MODULES. A faster CPU implementation replaces the second argument only.
rms_norm = select("rms_norm", cpu.rms_norm, BACKEND, _GPU)
rms_norm_residual = select("rms_norm_residual", cpu.rms_norm_residual, BACKEND, _GPU)
apply_rotary = select("apply_rotary", cpu.apply_rotary, BACKEND, _GPU)
silu_and_mul = select("silu_and_mul", cpu.silu_and_mul, BACKEND, _GPU)
store_kv = select("store_kv", reference.store_kv, BACKEND, _GPU)
paged_attention_decode = select("paged_attention_decode", cpu.paged_attention_decode, BACKEND, _GPU)
paged_attention_prefill = select("paged_attention_prefill", cpu.paged_attention_prefill, BACKEND, _GPU)
# Projections (cpu_linear.py), float32 on the CPU in auto mode: the native kernels' product on a dense
# weight (native/: decode-sized M at the memory's rate; F.linear above), where they build and
# the weight's width suits them; else oneDNN on a weight packed at load. F.linear for any other
# weight (CUDA, bfloat16/float16, PIPESERVE_KERNELS=torch|triton).


def _native() -> native.Native | None:
    return native.load() if BACKEND == "auto" else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_linear.linear(x, weight, bias, _native())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight a projection should keep: dense where the native kernels read it, packed for oneDNN
    on the CPU in auto mode, else itself."""
    if BACKEND != "auto":
        return weight
    kernels = _native()
    if kernels is not None and cpu_linear.native_weight(weight):
        if cpu_linear.native_f32_rows(kernels):  # this CPU's calibration: the native product wins
            return weight
    return cpu_linear.pack_weight(weight)


__all__ = [
    "BACKEND",
    "apply_rotary",
    "linear",
    "pack_linear_weight",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rms_norm_residual",
    "silu_and_mul",
    "store_kv",
]
