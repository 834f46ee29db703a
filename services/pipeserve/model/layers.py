"""Decoder building blocks over a paged KV cache, shared by the architectures of model/arch/.

Projections are fused (qkv, gate_up) — one matmul each per layer. Activations
are flat: [T, hidden] for the T tokens of a step, whatever request they belong
to; `AttentionBatch` says which rows decode and which prefill.

The parts: RMSNorm and Gemma's UnitOffsetRMSNorm (make_norm picks by the config); Attention
(optional per-head q/k RMSNorm, partial rotary, biases, and a per-layer AttentionSpec: scale, sliding
window, soft-capping, local rope); the gated MLP with an activation from GATED_ACTIVATIONS (SiLU,
GeGLU); DecoderLayer, the pre-norm residual layer of llama, mistral, qwen2/3 and phi3 (Gemma's
pre+post norm layer is sandwich.py's). Rotary tables are in rope.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
    # cos/sin [T, D] of the local rope table (gemma3's sliding layers: rope_local_base_freq), gathered
    # by StageModel.forward where the model has one; layers whose AttentionSpec.local_rope read them.
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None


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


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm (transformers' Gemma2RMSNorm / Gemma3RMSNorm): x / rms(x) * (1 + weight), the
    statistic, the offset and the product in float32, cast to x's dtype last (Llama's norm casts
    before the product). The checkpoint's `weight` is the offset from 1 (near 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The float32 kernel computes weight * (x * rsqrt(mean(x^2) + eps)): transformers' products in
        # the other order (exact: a float32 product commutes).
        return K.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        return self(h), h


def make_norm(cfg: ModelConfig, size: int) -> RMSNorm:
    """The architecture's RMSNorm over `size` features: Gemma's (1 + weight) where cfg.norm_unit_offset."""
    return (UnitOffsetRMSNorm if cfg.norm_unit_offset else RMSNorm)(size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as its architecture declares it (arch/base.py's `layer`).

    window: the layer's sliding window in tokens (None: full context), applied by the paged attention
    kernels: key p is visible to the query at position i iff i - window < p <= i (transformers'
    sliding-window mask), in decode and chunked prefill, over a cached prefix too. The blocks that
    fell out of every layer's window stay allocated (the whole context is kept).
    softcap: logits become softcap * tanh(logits / softcap) before the mask (gemma2). The CPU path
    then computes explicit scores (SDPA has no softcap); the Triton kernels take it in place.
    local_rope: the layer rotates with the local rope table (AttentionBatch.local_cos/sin: gemma3's
    sliding layers), else the model's (cfg.rope_theta, cfg.rope_scaling).
    """

    scale: float  # logits scale: head_dim**-0.5, or query_pre_attn_scalar**-0.5 (gemma)
    window: int | None = None
    softcap: float | None = None
    local_rope: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec) -> None:
        super().__init__()
        if spec.window is not None and spec.window < 1:
            raise ModelLoadError(f"a sliding window of {spec.window} tokens: it must be at least 1")
        if spec.softcap is not None and not spec.softcap > 0:
            raise ModelLoadError(f"attention soft-capping of {spec.softcap}: it must be > 0")
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        # qwen3, gemma3: each head's q and k normalized over head_dim before rotary.
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.rotary_dim = cfg.rotary_dim
        self.scale = spec.scale
        self.window, self.softcap, self.local_rope = spec.window, spec.softcap, spec.local_rope

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
        if self.local_rope:
            if batch.local_cos is None or batch.local_sin is None:
                raise RuntimeError("a local-rope layer ran without the local rope table's cos/sin")
            q, k = self._rotate(q, k, batch.local_cos, batch.local_sin)
        else:
            q, k = self._rotate(q, k, batch.cos, batch.sin)
        K.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if len(batch.decodes) == 1 and batch.num_decode == t:
            out = self._decode(q, k_cache, v_cache, batch.decodes[0], batch.workspace)
        else:
            out = torch.empty_like(q)
            for group in batch.decodes:
                rows = slice(group.row, group.row + group.n)
                out[rows] = self._decode(q[rows], k_cache, v_cache, group, batch.workspace)
            for span in batch.prefills:
                rows = slice(span.row, span.row + span.length)
                out[rows] = K.paged_attention_prefill(
                    q[rows],
                    k_cache,
                    v_cache,
                    span.block_table,
                    span.start_pos,
                    self.scale,
                    self.window,
                    self.softcap,
                )
        return self.o_proj(out.reshape(t, self.q_size))

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
        workspace: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [n, H, D] of one decode group -> [n, H, D]."""
        return K.paged_attention_decode(
            q,
            k_cache,
            v_cache,
            group.block_tables,
            group.context_lens,
            self.scale,
            workspace,
            self.window,
            self.softcap,
        )


# hidden_act -> fn(gate_up [T, 2I], gate first) -> act(gate) * up [T, I]. A new activation is one
# entry (a K op where the kernels have one, else PyTorch, which every backend runs).
def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (gemma): gelu(gate, tanh approximation) * up, as transformers' gelu_pytorch_tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": K.silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}


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
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, spec)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
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
