"""Decoder building blocks over a paged KV cache (Llama / Qwen2 / Mistral).

Projections are fused (qkv, gate_up) — one matmul each per layer. Activations
are flat: [T, hidden] for the T tokens of a step, whatever request they belong
to; `AttentionBatch` says which rows decode and which prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import pipeserve_kernels as K
from pipeserve.model.config import ModelConfig


@dataclass
class PrefillSpan:
    """Rows [row, row+length) are one sequence's chunk starting at position start_pos."""

    row: int
    length: int
    start_pos: int
    block_table: torch.Tensor  # [nb] long


@dataclass
class DecodeGroup:
    """Rows [row, row+n) are single-token rows of similar context length.

    Decode attention pads every row of a group to the group's longest context,
    so rows are grouped by length to bound the padding.
    """

    row: int
    n: int
    block_tables: torch.Tensor  # [n, max_blocks] long, 0-padded
    context_lens: torch.Tensor  # [n] long


@dataclass
class AttentionBatch:
    """Per-step attention inputs, shared by every layer of the stage.

    DecodeGroups cover rows [0, num_decode); PrefillSpans follow. cos/sin are
    already gathered for `positions`.
    """

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    cos: torch.Tensor  # [T, D]
    sin: torch.Tensor  # [T, D]
    num_decode: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # [2, blocks, BS, KVH, D] scratch for decode gathers, reused by every layer and step.
    workspace: torch.Tensor | None = None


class Linear(nn.Linear):
    """nn.Linear whose weight may be swapped for a packed one (pack_weight), via K.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.linear(x, self.weight, self.bias)

    def pack_weight(self) -> None:
        """Keep the weight in the kernel's preferred layout (oneDNN's on the CPU; else unchanged).

        Call once the weight is loaded and on its device. A packed weight is a plain attribute, not
        a Parameter: it cannot move devices or be saved, and the dense copy is dropped.
        """
        dense = self.weight.data  # one object: each `.data` access makes a new tensor
        packed = K.pack_linear_weight(dense)
        if packed is not dense:
            del self.weight
            self.weight = packed


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel (one pass over the row on the GPU)."""
        return K.rms_norm_residual(x, residual, self.weight, self.eps)


class RotaryTable(nn.Module):
    """cos/sin for every position up to max_len, float32 math as in transformers."""

    cos: torch.Tensor  # [max_len, head_dim] (buffers)
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        # Computed on the CPU even inside a meta-device context (the loader builds the
        # model on meta): meta math would import torch._dynamo (~70 MiB per stage).
        t = torch.arange(max_len, dtype=torch.int64, device="cpu").float()
        freqs = t[:, None] * cfg.inv_freq()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(cfg.dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(cfg.dtype), persistent=False)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = K.apply_rotary(q, k, batch.cos, batch.sin)
        K.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if len(batch.decodes) == 1 and batch.num_decode == t:
            group = batch.decodes[0]
            out = K.paged_attention_decode(
                q, k_cache, v_cache, group.block_tables, group.context_lens, self.scale, batch.workspace
            )
        else:
            out = torch.empty_like(q)
            for group in batch.decodes:
                rows = slice(group.row, group.row + group.n)
                out[rows] = K.paged_attention_decode(
                    q[rows],
                    k_cache,
                    v_cache,
                    group.block_tables,
                    group.context_lens,
                    self.scale,
                    batch.workspace,
                )
            for span in batch.prefills:
                rows = slice(span.row, span.row + span.length)
                out[rows] = K.paged_attention_prefill(
                    q[rows], k_cache, v_cache, span.block_table, span.start_pos, self.scale
                )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(K.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        # x + attn and its norm together; the same float ops as HF's unfused add then norm.
        h, x = self.post_attention_layernorm.add_and_norm(attn, x)
        return x + self.mlp(h)
