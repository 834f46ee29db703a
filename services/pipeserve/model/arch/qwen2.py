"""qwen2 (Qwen2, Qwen2.5): the llama layer with q/k/v biases (o_proj has none); a sliding window
only where `use_sliding_window` is set (it then caps the context, see layers.AttentionSpec).

GGUF: llama.cpp's `qwen2` (NEOX rope: q/k rows as HF has them), llama's names plus the q/k/v biases."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, GgufSpec, check_activation
from pipeserve.model.arch.llama import GGUF_BLOCK_NAMES


def sliding_window(raw: dict) -> int | None:
    """The window of qwen2/qwen3 configs: off unless use_sliding_window (transformers' rule)."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    return int(window) if window else None


def config(raw: dict) -> dict:
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": True,  # Qwen2Attention: q/k/v always biased, whatever the config says
        "sliding_window": sliding_window(raw),
    }


GGUF_NAMES = {
    **GGUF_BLOCK_NAMES,
    **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
}
# llama.cpp writes no window for qwen2 (use_sliding_window is off in every Qwen2/2.5 release).
ARCH = Arch("qwen2", "Qwen2ForCausalLM", config, gguf=GgufSpec("qwen2", GGUF_NAMES))
