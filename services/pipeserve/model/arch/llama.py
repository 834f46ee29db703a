"""llama (Llama 2/3, SmolLM, TinyLlama, ...): the pre-norm layer with separate q/k/v and gate/up
tensors, optional biases (`attention_bias` on q/k/v and o, `mlp_bias`), llama3/linear/yarn rope.

GGUF: llama.cpp's `llama` architecture (which Mistral-style files also use); its q/k rows are
permuted for llama.cpp's rope layout and permuted back by gguf.py."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, GgufSpec, check_activation

# GGUF name per block (`blk.N.` + key) -> HF name per layer (`model.layers.N.` + value).
GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def config(raw: dict) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": bias,
        "attention_out_bias": bias,  # LlamaAttention's o_proj follows attention_bias too
        "mlp_bias": bool(raw.get("mlp_bias", False)),
    }


ARCH = Arch("llama", "LlamaForCausalLM", config, gguf=GgufSpec("llama", GGUF_BLOCK_NAMES))
