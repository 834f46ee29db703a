"""phi3 (Phi-3, Phi-3.5, Phi-4-mini): the llama layer with q/k/v fused in one checkpoint tensor
(`qkv_proj`: q rows, then k, then v) and gate/up in another (`gate_up_proj`: gate rows first), no
biases; longrope scaling (`su` and `yarn` in older configs mean longrope, as transformers reads
them), partial rotary (Phi-4-mini), and a sliding window that caps the context."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, Cat, Fused, Source, check_activation, dense_weights
from pipeserve.model.config import ModelConfig


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


ARCH = Arch(
    "phi3",
    "Phi3ForCausalLM",
    config,
    weights=weights,
    rope_aliases={"su": "longrope", "yarn": "longrope"},
)
