"""Routed experts: a top-k router over E SwiGLU experts (Mixtral, Qwen3-MoE), as transformers 5 runs it.

Routing (transformers 5's `*TopKRouter`): logits = x @ gate.T; probs = softmax(logits) over the
experts, in float32; the top k probs per token, renormalized to sum to 1 where the family does
(Mixtral always, Qwen3-MoE when `norm_topk_prob`). Mixtral keeps the weights in float32, Qwen3-MoE
casts them back to the activations' dtype: only a low-precision model can tell the two apart.

Compute (a grouped dispatch, transformers' own `grouped_mm` order): the T*k (token, slot) pairs are
sorted by expert; each expert that got tokens runs one gate_up product, SiLU-and-mul and one down
product over its contiguous rows; each row is scaled by its routing weight, put back in (token,
slot) order and the k slots of a token summed. Experts no token picked cost nothing.

Weights: `gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and `down_proj`
[E, H, I], transformers 5's fused `experts.*` tensors; the loader stacks them from the per-expert
tensors of older checkpoints (and of transformers' own `save_pretrained`): arch/routed.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import pipeserve_kernels as K
from pipeserve.errors import ModelLoadError


class TopKRouter(nn.Module):
    """gate.weight [E, H] -> (weights [T, k], expert ids [T, k] long), top-k in descending prob."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, float_weights: bool
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        self.float_weights = float_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(x.dtype)), ids


class Experts(nn.Module):
    """E SwiGLU experts as two stacked tensors; forward runs the grouped dispatch."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights / ids [T, k] -> sum over the k slots of weight * expert(x), [T, H]."""
        t, k = ids.shape
        flat = ids.reshape(-1)  # [T*k], pair p = token p // k, slot p % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one sync per layer
        rows = x[order // k]  # [T*k, H] in expert order
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(start, start + n)
            h = K.silu_and_mul(K.linear(rows[seg], self.gate_up_proj[e], None))
            out[seg] = K.linear(h, self.down_proj[e], None)
            start += n
        weighted = out * weights.reshape(-1)[order, None]  # float32 weights promote, as in HF
        unsorted = torch.empty_like(weighted)
        unsorted[order] = weighted
        return unsorted.view(t, k, -1).sum(dim=1).to(x.dtype)


@dataclass(frozen=True)
class MoeSpec:
    """An MoE model's routed experts, as its architecture module reads them from config.json.

    dense_layers: the layers whose MLP is the dense gated MLP instead (qwen3_moe's `mlp_only_layers`
    and `decoder_sparse_step`); every other layer's MLP is a SparseMoE.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (moe_intermediate_size; Mixtral: intermediate_size)
    renormalize: bool  # top-k weights divided by their sum
    float_weights: bool  # routing weights stay float32 (Mixtral) or take the activations' dtype
    dense_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok {self.top_k} must be in 1..the number of experts ({self.num_experts})"
            )
        if self.intermediate_size <= 0:
            raise ModelLoadError(f"expert intermediate size {self.intermediate_size} must be positive")


class SparseMoE(nn.Module):
    """The MLP of an MoE layer: `gate` (the router) and `experts`, HF's submodule names."""

    def __init__(self, hidden_size: int, spec: MoeSpec) -> None:
        super().__init__()
        self.gate = TopKRouter(
            hidden_size, spec.num_experts, spec.top_k, spec.renormalize, spec.float_weights
        )
        self.experts = Experts(hidden_size, spec.intermediate_size, spec.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)
