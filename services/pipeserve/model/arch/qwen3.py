"""qwen3 (Qwen3 dense): the llama layer with an RMSNorm over each q and k head (head_dim wide, its
own weight) before rotary, `head_dim` independent of hidden/heads, no q/k/v/o biases unless
`attention_bias` (then on all four). YaRN rope scaling as Qwen's long-context configs set it.

The native decode step has no q/k norm: decode steps run the PyTorch layers (base.dense_unsupported).

A sliding window as qwen2's (use_sliding_window, the layers from max_window_layers on: qwen2.layer).

GGUF: llama.cpp's `qwen3` (NEOX rope: q/k rows unpermuted), llama's names plus the q/k norms; the
head_dim is `attention.key_length`."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, GgufSpec, check_activation
from pipeserve.model.arch.llama import GGUF_BIAS_NAMES, GGUF_BLOCK_NAMES
from pipeserve.model.arch.qwen2 import layer, sliding_window
from pipeserve.model.gguf_meta import GgufMeta


def config(raw: dict) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": bias,
        "attention_out_bias": bias,
        "qk_norm": True,
        "sliding_window": sliding_window(raw),
    }


GGUF_NAMES = {
    **GGUF_BLOCK_NAMES,
    **{k: v for k, v in GGUF_BIAS_NAMES.items() if k.startswith("attn_")},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def gguf_config(meta: GgufMeta) -> dict:
    return {"attention_bias": bool(meta.blocks_with("attn_q.bias"))}


ARCH = Arch("qwen3", "Qwen3ForCausalLM", config, layer=layer, gguf=GgufSpec("qwen3", GGUF_NAMES, gguf_config))
