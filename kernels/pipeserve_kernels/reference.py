"""PyTorch reference implementations of the kernel interface.

Numerics follow Hugging Face transformers' Llama modules (float32 RMS
statistics, `rotate_half` rotary) so greedy outputs match it token for token.

Attention options (both paged attention ops), as transformers' Gemma 2/3 and Mistral:
  window   key p is visible to a query at position i iff i - window < p <= i (masking_utils'
           sliding_window_overlay: the current token plus the window - 1 before it); None: causal only.
  softcap  scores become softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2's
           eager attention). SDPA has no softcap, so these scores are computed explicitly here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] in x.dtype; the statistic is taken in float32."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D], cos/sin [T, D] (already gathered by position)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, KVH, D] into the cache slots named by slot_mapping [T], cast to the cache's
    dtype (a 16-bit pool under a float32 model: --kv-cache-dtype)."""
    kvh, d = k.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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
    """One query token per row. q [B, H, D] -> [B, H, D].

    Row b attends to the first context_lens[b] slots of its block table
    (its own token included: store_kv ran first). Query head h reads kv head
    h // (H / KVH), as transformers' repeat_kv; the G query heads of a kv head
    are batched as G query rows so K/V are never repeated.

    workspace [2, >= B*max_blocks, BS, KVH, D], if given, receives the gathered
    blocks; a buffer reused across calls avoids page-faulting a fresh one.
    """
    b, nb = block_tables.shape
    bs, kvh, d = k_cache.shape[1:]
    g = q.shape[1] // kvh
    flat = block_tables.reshape(-1)
    if workspace is None:
        k_blocks, v_blocks = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    else:
        k_blocks = torch.index_select(k_cache, 0, flat, out=workspace[0, : b * nb])
        v_blocks = torch.index_select(v_cache, 0, flat, out=workspace[1, : b * nb])
    # A cache in another dtype than q (--kv-cache-dtype) is upcast here; a no-op otherwise.
    keys = k_blocks.view(b, nb * bs, kvh, d).transpose(1, 2).to(q.dtype)
    values = v_blocks.view(b, nb * bs, kvh, d).transpose(1, 2).to(q.dtype)
    pos = torch.arange(nb * bs, device=q.device)
    # The row's token sits at position ctx - 1; padding past it is never visible.
    mask = visible(pos[None, :], context_lens[:, None] - 1, window)[:, None, None, :]  # [B, 1, 1, S]
    out = attend(q.view(b, kvh, g, d), keys, values, mask, scale, softcap)
    return out.reshape(b, kvh * g, d)


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
    """A chunk of L query tokens of one sequence at positions start_pos..start_pos+L-1.

    q [L, H, D] -> [L, H, D]; keys are slots 0..start_pos+L-1 of block_table
    [nb] (the chunk's own keys already stored); causal. Grouped like the
    decode op: rows of the attention are (query head within group, token).
    """
    length, heads, d = q.shape
    ctx = start_pos + length
    kvh = k_cache.shape[2]
    g = heads // kvh
    keys = k_cache[block_table].view(-1, kvh, d)[:ctx].transpose(0, 1).to(q.dtype)
    values = v_cache[block_table].view(-1, kvh, d)[:ctx].transpose(0, 1).to(q.dtype)
    qg = q.transpose(0, 1).reshape(kvh, g * length, d)
    rows = torch.arange(length, device=q.device).repeat(g)[:, None] + start_pos
    mask = visible(torch.arange(ctx, device=q.device)[None, :], rows, window)  # [G*L, ctx]
    # A leading batch dim selects torch's fused CPU attention over the generic path.
    out = attend(qg[None], keys[None], values[None], mask, scale, softcap)
    return out[0].view(heads, length, d).transpose(0, 1)


def visible(kpos: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees (broadcast kpos against qpos): causal, and within the window."""
    seen = kpos <= qpos
    if window is not None:
        seen &= kpos > qpos - window
    return seen


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v over [..., rows, D] x [..., S, D]; mask broadcasts to [..., rows, S].

    With softcap, the scores are explicit, in transformers' eager order: scale, cap, mask, softmax
    in float32 (every row sees at least its own key, so no row is fully masked).
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: (rms_norm(x + residual), x + residual), [T, hidden] each.

    The sum is rounded to the dtype first (as the unfused `x = x + y` is), then normed.
    """
    h = x + residual
    return rms_norm(h, weight, eps), h
