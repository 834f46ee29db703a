"""Decoder building blocks over a paged KV cache, shared by the architectures of model/arch/.

Projections are fused (qkv, gate_up) — one matmul each per layer. Activations
are flat: [T, hidden] for the T tokens of a step, whatever request they belong
to; `AttentionBatch` says which rows decode and which prefill.

The parts: RMSNorm; Attention (optional per-head q/k RMSNorm, partial rotary, biases, and a
per-layer AttentionSpec: scale, sliding window, soft-capping); the gated MLP with an activation
from GATED_ACTIVATIONS; DecoderLayer, the pre-norm residual layer of llama, mistral, qwen2/3 and
phi3. Rotary tables are in rope.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import pipeserve_kernels as K
from pipeserve.errors import ModelLoadError
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


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as its architecture declares it (arch/base.py's `layer`).

    window: the layer's sliding window in tokens (None: full context). The paged kernels attend the
    whole context; the engine caps max_model_len at cfg.sliding_window (ring/build.py), the smallest
    window of any layer, which makes every window at least the context: exact. A layer whose window
    is below that cap is refused (it would attend past its window).
    softcap: tanh soft-capping of the logits (gemma2): the paged kernels do not take one yet.
    """

    scale: float  # logits scale: head_dim**-0.5, or query_pre_attn_scalar**-0.5 (gemma)
    window: int | None = None
    softcap: float | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec) -> None:
        super().__init__()
        if spec.softcap is not None:
            raise ModelLoadError("attention soft-capping is not implemented by the paged attention kernels")
        if spec.window is not None and (cfg.sliding_window is None or spec.window < cfg.sliding_window):
            cap = cfg.sliding_window
            raise ModelLoadError(f"a layer window of {spec.window} below the context cap {cap}")
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        # qwen3: each head's q and k normalized over head_dim before rotary.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_dim = cfg.rotary_dim
        self.scale = spec.scale

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary over the first rotary_dim features of each head (cos/sin [T, rotary_dim]); the rest pass."""
        r = self.rotary_dim
        if r == self.head_dim:
            return K.apply_rotary(q, k, cos, sin)
        q_rot, k_rot = K.apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        q, k = self._rotate(q, k, batch.cos, batch.sin)
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


# hidden_act -> fn(gate_up [T, 2I], gate first) -> act(gate) * up [T, I]. A new activation is one
# entry (a K op where the kernels have one, else PyTorch, which every backend runs).
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": K.silu_and_mul}


class MLP(nn.Module):
    """down(act(gate) * up): gate and up one fused projection (gate rows first)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_and_mul = GATED_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)): the pre-norm layer. `mlp`: any module [T, hidden] ->
    [T, hidden] (routed experts plug in here); the gated MLP by default."""

    def __init__(self, cfg: ModelConfig, spec: AttentionSpec, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, spec)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Any: the gated MLP or a module of its contract (routed experts). native_decode.py reads the
        # gated MLP's projections, only where the arch says its layer is one (arch.unsupported).
        self.mlp: Any = mlp if mlp is not None else MLP(cfg)

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        # x + attn and its norm together; the same float ops as HF's unfused add then norm.
        h, x = self.post_attention_layernorm.add_and_norm(attn, x)
        return x + self.mlp(h)
