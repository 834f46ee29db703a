"""Routed experts: a top-k router over E SwiGLU experts (Mixtral, Qwen3-MoE), as transformers 5 runs it.

Routing (transformers 5's `*TopKRouter`): logits = x @ gate.T; probs = softmax(logits) over the
experts, in float32; the top k probs per token, renormalized to sum to 1 where the family does
(Mixtral always, Qwen3-MoE when `norm_topk_prob`). Mixtral keeps the weights in float32, Qwen3-MoE
casts them back to the activations' dtype: only a low-precision model can tell the two apart.

Compute (a grouped dispatch, transformers' own `grouped_mm` order): the T*k (token, slot) pairs are
sorted by expert; each expert that got tokens runs one gate_up product, SiLU-and-mul and one down
product over its contiguous rows; each row is scaled by its routing weight, put back in (token,
slot) order and the k slots of a token summed. Experts no token picked cost nothing.

Weights (what every layout is turned into): `gate_up_proj` [E, 2I, H] (gate rows first, then up)
and `down_proj` [E, H, I], transformers 5's fused `experts.*` tensors; `fuse_expert_weights` builds
them from the per-expert tensors older checkpoints (and transformers' own `save_pretrained`) carry.
"""

from __future__ import annotations

import torch
from torch import nn

import pipeserve_kernels as K


class TopKRouter(nn.Module):
    """gate.weight [E, H] -> (weights [T, k], expert ids [T, k] long), top-k in descending prob."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, float_weights: bool
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
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


class SparseMoE(nn.Module):
    """The MLP of an MoE layer: `gate` (the router) and `experts`, HF's submodule names."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        float_weights: bool,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, float_weights)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


def fuse_expert_weights(
    gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert [I, H] gate, [I, H] up, [H, I] down (expert 0 first) -> gate_up [E, 2I, H], down [E, H, I].

    transformers 5's conversion of the v4 layout: each expert's gate then up rows, stacked in expert
    order (MergeModulelist(dim=0) then Concatenate(dim=1)).
    """
    if not len(gate) == len(up) == len(down) or not gate:
        raise ValueError(f"expert tensors disagree: {len(gate)} gate, {len(up)} up, {len(down)} down")
    gate_up = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
    return gate_up, torch.stack(down)
