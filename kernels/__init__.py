"""Kernel interface for the layer ops of a stage (package `pipeserve_kernels`).

Every op has a PyTorch reference in `reference.py`; that is the CPU path and
the oracle that faster (Triton) kernels are tested against. Model code calls
only the names exported here, so a backend swap touches this file alone.

Shapes (T = tokens in the step, H / KVH = query / kv heads, D = head_dim,
N = KV blocks, BS = block size):
  k_cache, v_cache      [N, BS, KVH, D]   one layer's slice of the KV pool
  slot_mapping          [T]               block_id * BS + offset, per new token
  block_tables          [B, max_blocks]   padded with 0 past a row's blocks
"""

from pipeserve_kernels.reference import (
    apply_rotary,
    paged_attention_decode,
    paged_attention_prefill,
    rms_norm,
    silu_and_mul,
    store_kv,
)

__all__ = [
    "apply_rotary",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
