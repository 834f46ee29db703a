"""The "sandwich" decoder layer of Gemma 2 and Gemma 3 (model/arch/gemma2.py, gemma3_text.py): a norm
before and after both attention and the MLP, in transformers' Gemma2DecoderLayer order:

    h   = x + post_attention_layernorm(attn(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

Its norms are the config's (layers.make_norm: Gemma's 1 + weight); attention per its AttentionSpec
(scale, window, softcap, local rope), the gated MLP with the config's activation (GeGLU).
"""

from __future__ import annotations

import torch
from torch import nn

from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import MLP, Attention, AttentionBatch, AttentionSpec, make_norm


class SandwichDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.input_layernorm = make_norm(cfg, size)
        self.self_attn = Attention(cfg, spec)
        self.post_attention_layernorm = make_norm(cfg, size)
        self.pre_feedforward_layernorm = make_norm(cfg, size)
        self.post_feedforward_layernorm = make_norm(cfg, size)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, batch: AttentionBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), batch, k_cache, v_cache)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
