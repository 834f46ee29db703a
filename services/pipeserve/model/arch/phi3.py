"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): the llama layer with q/k/v fused in one checkpoint tensor
(`qkv_proj`: q rows, then k, then v) and gate/up in another (`gate_up_proj`: gate rows first), no
biases; longrope scaling (`su` and `yarn` in older configs mean longrope, as transformers reads
them), partial rotary (Phi-4-mini), and a sliding window on every layer applied by the paged kernels
(base.dense_layer; the context is not capped at it).

GGUF: llama.cpp's `phi3` keeps both fused tensors (`attn_qkv`, and `ffn_up` holding gate then up),
rows unpermuted (NEOX rope); `rope.dimension_count` is the rotated part of a head and a window of 0
means none. Its longrope factors are tensors (`rope_factors_long/short`), which are refused by name."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, Cat, Fused, GgufSpec, Source, check_activation, dense_weights
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_meta import GgufMeta


def config(raw: dict) -> dict:
    window = raw.get("sliding_window")
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": False,
        "sliding_window": int(window) if window else None,
    }


def weights(cfg: ModelConfig, index: int) -> dict[str, Source]:
    w: dict[str, Source] = {
        k: v for k, v in dense_weights(cfg, index).items() if isinstance(v, Cat) and len(v.names) == 1
    }
    w["self_attn.qkv_proj.weight"] = Fused("self_attn.qkv_proj.weight", ("q", "k", "v"), ("q", "k", "v"))
    w["mlp.gate_up_proj.weight"] = Fused("mlp.gate_up_proj.weight", ("gate", "up"), ("gate", "up"))
    return w


GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_config(meta: GgufMeta) -> dict:
    head_dim = int(meta.need("embedding_length")) // int(meta.need("attention.head_count"))
    window = int(meta.get("attention.sliding_window", 0))
    fields = {
        "partial_rotary_factor": int(meta.get("rope.dimension_count", head_dim)) / head_dim,
        "sliding_window": window or None,
    }
    original = meta.get("rope.scaling.original_context_length")
    if original:
        fields["original_max_position_embeddings"] = int(original)
    return fields


ARCH = Arch(
    "phi3",
    "Phi3ForCausalLM",
    config,
    weights=weights,
    gguf=GgufSpec("phi3", GGUF_NAMES, gguf_config),
    rope_aliases={"su": "longrope", "yarn": "longrope"},
)
