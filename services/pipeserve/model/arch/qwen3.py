"""qwen3 (Qwen3 dense): the llama layer with an RMSNorm over each q and k head (head_dim wide, its
own weight) before rotary, `head_dim` independent of hidden/heads, no q/k/v/o biases unless
`attention_bias` (then on all four). YaRN rope scaling as Qwen's long-context configs set it.

The native decode step has no q/k norm: decode steps run the PyTorch layers (base.dense_unsupported)."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, check_activation
from pipeserve.model.arch.qwen2 import sliding_window


def config(raw: dict) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": bias,
        "attention_out_bias": bias,
        "qk_norm": True,
        "sliding_window": sliding_window(raw),
    }


ARCH = Arch("qwen3", "Qwen3ForCausalLM", config)
