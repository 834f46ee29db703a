"""mistral: the llama layer without biases, and a sliding window on every layer (Mistral 7B v0.1:
4096) that the paged kernels apply (layers.AttentionSpec.window; base.dense_layer): the context is
not capped at it. GGUF files of
Mistral models use llama.cpp's `llama` architecture (llama.py)."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, check_activation


def config(raw: dict) -> dict:
    window = raw.get("sliding_window")
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": False,
        "sliding_window": int(window) if window else None,
    }


ARCH = Arch("mistral", "MistralForCausalLM", config)
