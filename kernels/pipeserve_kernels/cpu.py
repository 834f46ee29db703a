"""Faster CPU (PyTorch) implementations of part of the kernel interface.

Same contracts as `reference.py` (the oracle; tests/kernels/test_cpu_ops.py checks each
against it). A decode step of a small model on a CPU is mostly weight reads plus a few dozen
small ops per layer, each costing a dispatch and often an allocation, so these cut op counts:

* rms_norm: no dtype round trips for float32, epsilon and rsqrt in place — bit-identical.
* apply_rotary: q and k rotated as one [T, H+KVH, D] tensor; rotate_half(x) * sin is written as
  roll(x, D/2) * (sin with its first half negated), the same products — bit-identical.
* silu_and_mul: the product is written into SiLU's output — bit-identical.
* paged_attention_decode: reads a row's blocks as a view of the pool when they are consecutive
  block ids (a lone request's usual table) instead of gathering them; a group whose rows all have
  the group's longest context needs no mask; keys past the longest context are not read.
  Equal to the reference within float rounding (SDPA over fewer padded keys).
* paged_attention_prefill: a chunk that starts the sequence (start_pos 0: every fresh prompt)
  attends with SDPA's own causal flag over the query heads (keys shared by GQA groups), so no
  [G*L, ctx] mask is built and the masked half of the scores is skipped (2.2x at 2048 tokens);
  a later chunk keeps the reference's mask. Equal to the reference within float rounding.
* window / softcap (reference.py's attention options): a decode with a window reads only the keys
  from the earliest one a row of the group sees; a softcap (explicit scores) and a windowed prefill
  run the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeserve_kernels import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] in x.dtype; the statistic in float32, as reference.rms_norm."""
    if x.dtype != torch.float32:
        return reference.rms_norm(x, weight, eps)
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * var.add_(eps).rsqrt_())


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), as reference.rms_norm_residual."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D], cos/sin [T, D] -> rotated (q, k), as reference.apply_rotary."""
    heads, half = q.shape[1], q.shape[-1] // 2
    qk = torch.cat((q, k), dim=1)  # [T, H+KVH, D]
    # rotate_half(x) = cat(-x2, x1) = roll(x, half) with the first half negated; the sign moves
    # onto sin (negation is exact), so the products and the sum are the reference's.
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
    out = qk * cos.unsqueeze(1)
    out += qk.roll(half, dims=-1).mul_(signed_sin)
    return out[:, :heads], out[:, heads:]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _consecutive(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def _pool_view(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: list[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The K and V blocks of one sequence as views of the pool (nothing copied), where its block ids
    are consecutive (a lone request's usual table); else None."""
    if not _consecutive(blocks):
        return None
    lo, hi = blocks[0], blocks[0] + len(blocks)
    return k_cache[lo:hi], v_cache[lo:hi]


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per row, q [B, H, D] -> [B, H, D]; contract of reference.paged_attention_decode."""
    if softcap is not None:  # SDPA has no softcap: the reference's explicit scores
        return reference.paged_attention_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, workspace, window, softcap
        )
    b = block_tables.shape[0]
    bs = k_cache.shape[1]
    lens = context_lens.tolist()
    longest = max(lens)
    # The first key any row sees: a window hides every key before ctx - window (the row's token is ctx - 1).
    first = max(0, min(lens) - window) if window is not None else 0
    nb = -(-longest // bs)  # blocks holding the longest context; the table may be wider
    if b == 1 and (view := _pool_view(k_cache, v_cache, block_tables[0, :nb].tolist())) is not None:
        return _attend(q, *view, 1, nb, first, longest, None, scale)
    flat = block_tables[:, :nb].reshape(-1)
    if workspace is None:
        k_blocks, v_blocks = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    else:
        k_blocks = torch.index_select(k_cache, 0, flat, out=workspace[0, : b * nb])
        v_blocks = torch.index_select(v_cache, 0, flat, out=workspace[1, : b * nb])
    mask = None
    if min(lens) < longest:  # rows of one length see exactly keys first..longest-1
        pos = torch.arange(first, longest, device=q.device)
        mask = reference.visible(pos[None, :], context_lens[:, None] - 1, window)[:, None, None, :]
    return _attend(q, k_blocks, v_blocks, b, nb, first, longest, mask, scale)


def _attend(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    b: int,
    nb: int,
    first: int,
    length: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """SDPA of q over slots first..length-1 of each row's nb blocks ([b*nb, BS, KVH, D])."""
    bs, kvh, d = k_blocks.shape[1:]
    # A cache in another dtype than q (--kv-cache-dtype) is upcast here; a no-op otherwise.
    keys = k_blocks.reshape(b, nb * bs, kvh, d)[:, first:length].transpose(1, 2).to(q.dtype)
    values = v_blocks.reshape(b, nb * bs, kvh, d)[:, first:length].transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q.view(b, kvh, -1, d), keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, -1, d)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """reference.paged_attention_prefill's contract: q [L, H, D] at positions start_pos.. -> [L, H, D]."""
    # A later chunk sees the cached prefix and its own chunk (the reference's offset mask); a window
    # or a softcap is beyond SDPA's causal flag.
    if start_pos or window is not None or softcap is not None:
        return reference.paged_attention_prefill(
            q, k_cache, v_cache, block_table, start_pos, scale, window, softcap
        )
    length, heads, d = q.shape
    kvh = k_cache.shape[2]
    view = _pool_view(k_cache, v_cache, block_table.tolist())
    k_blocks, v_blocks = view if view is not None else (k_cache[block_table], v_cache[block_table])
    keys = k_blocks.reshape(-1, kvh, d)[:length].transpose(0, 1).to(q.dtype)[None]
    values = v_blocks.reshape(-1, kvh, d)[:length].transpose(0, 1).to(q.dtype)[None]
    gqa = kvh != heads  # SDPA pairs each kv head with its group of query heads
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, is_causal=True, scale=scale, enable_gqa=gqa
    )
    return out[0].transpose(0, 1)
