"""llama (Llama 2/3, SmolLM, TinyLlama, ...): the pre-norm layer with separate q/k/v and gate/up
tensors, optional biases (`attention_bias` on q/k/v and o, `mlp_bias`), llama3/linear/yarn rope.

GGUF: llama.cpp's `llama` architecture (which Mistral files also use: they convert to llama, the
same layer without a window); its q/k rows (and biases) are permuted for llama.cpp's rope layout and
permuted back by gguf.py. A `llama` file with experts is mixtral's (mixtral.py). Llama 3.1+'s llama3
rope scaling is a tensor there (`rope_freqs`: each frequency's divisor), read back into the four
parameters that give exactly those divisors (`llama3_rope`), or refused."""

from __future__ import annotations

import math

import numpy as np

from pipeserve.errors import ModelLoadError
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
    if "rope_freqs.weight" in meta.tensor_names:
        theta = meta.f32("rope.freq_base", 10000.0)
        llama3 = llama3_rope(meta.tensor("rope_freqs.weight"), theta)
        fields["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, **llama3}
    return fields


KEYS = ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor")


def _wavelengths(n: int, theta: float) -> np.ndarray:
    return 2 * math.pi * theta ** (np.arange(0, 2 * n, 2, dtype=np.float64) / (2 * n))


def _llama3_divisors(n: int, theta: float, factor: float, old: float, low: float, high: float) -> np.ndarray:
    """llama.cpp's rope_freqs for these llama3 parameters (LlamaModel.generate_extra_tensors)."""
    wavelen = _wavelengths(n, theta)
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def llama3_rope(divisors: np.ndarray, theta: float) -> dict:
    """The llama3 parameters (factor, low/high_freq_factor, original_max_position_embeddings) whose
    divisors are the file's: factor their largest; between the two wavelengths 1/divisor is linear in
    1/wavelength, so two such points give the original length and high for low = 1 (Llama 3's, which
    is tried first: 8192, 1, 4). A candidate must give back every divisor; none: a ModelLoadError."""
    r = np.asarray(divisors, dtype=np.float64).reshape(-1)
    factor, n = float(np.float32(r.max())), r.size
    wavelen = _wavelengths(n, theta)
    mid = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    candidates = [(8192, 1.0, 4.0)]  # Llama 3.1-3.3's
    if factor > 1 and mid.sum() >= 2:
        smooth = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)  # = old/(h-l) / wavelen - l/(h-l)
        slope, offset = np.polyfit(1 / wavelen[mid], smooth, 1)
        # The divisors fix only old/(high - low) and low/(high - low): take low = 1, as every Llama 3
        # config has it (any other such triple gives the same divisors).
        old = round(slope / -offset)
        candidates.append((old, 1.0, float(f"{1 + old / slope:.6g}")))  # short decimals: fit noise off
    for old, low, high in candidates:
        if np.allclose(_llama3_divisors(n, theta, factor, old, low, high), r, rtol=1e-5, atol=0):
            return {"factor": factor, **dict(zip(KEYS, (old, low, high), strict=True))}
    raise ModelLoadError("GGUF tensor rope_freqs.weight: no llama3 rope parameters give its factors")


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
