"""llama (Llama 2/3, SmolLM, TinyLlama, ...): the pre-norm layer with separate q/k/v and gate/up
tensors, optional biases (`attention_bias` on q/k/v and o, `mlp_bias`), llama3/linear/yarn rope.

GGUF: llama.cpp's `llama` architecture (which Mistral files also use: they convert to llama, the
same layer without a window); its q/k rows (and biases) are permuted for llama.cpp's rope layout and
permuted back by gguf.py. A `llama` file with experts is mixtral's (mixtral.py)."""

from __future__ import annotations

from pipeserve.model.arch.base import Arch, GgufSpec, check_activation
from pipeserve.model.gguf_meta import GgufMeta

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
# The biases a file may hold (attention_bias: q/k/v and o; mlp_bias: gate/up/down), named alike.
GGUF_BIAS_NAMES = {
    k.replace(".weight", ".bias"): v.replace(".weight", ".bias")
    for k, v in GGUF_BLOCK_NAMES.items()
    if "norm" not in k
}


def config(raw: dict) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": check_activation(raw),
        "attention_bias": bias,
        "attention_out_bias": bias,  # LlamaAttention's o_proj follows attention_bias too
        "mlp_bias": bool(raw.get("mlp_bias", False)),
    }


def gguf_config(meta: GgufMeta) -> dict:
    """LlamaModel writes rope.dimension_count = head_dim (key_length only when the config names a
    head_dim); biases are there when their tensors are."""
    fields: dict = {
        "hidden_act": "silu",
        "attention_bias": bool(meta.blocks_with("attn_q.bias")),
        "mlp_bias": bool(meta.blocks_with("ffn_down.bias")),
    }
    if meta.get("attention.key_length") is None and meta.get("rope.dimension_count"):
        fields["head_dim"] = int(meta.get("rope.dimension_count"))
    return fields


ARCH = Arch(
    "llama",
    "LlamaForCausalLM",
    config,
    gguf=GgufSpec(
        "llama",
        {**GGUF_BLOCK_NAMES, **GGUF_BIAS_NAMES},
        gguf_config,
        permuted_qk=True,
        claims=lambda meta: not meta.get("expert_count"),  # with experts: mixtral
    ),
)
