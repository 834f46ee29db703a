"""gemma (Gemma 1, CodeGemma): the llama pre-norm layer with Gemma's parts and none of Gemma 2's
additions. Gemma's (1 + weight) RMSNorm everywhere (layers.make_norm), GeGLU (`hidden_act`
gelu_pytorch_tanh; the releases' legacy "gelu" means the tanh approximation, as transformers reads
it), embeddings times sqrt(hidden_size) in the model dtype, attention at head_dim**-0.5 over every
position (no window, no soft-capping), tied embeddings by default.

GGUF: llama.cpp's `gemma` (NEOX rope: q/k rows unpermuted): llama's tensor names, every norm weight
stored as 1 + w (norm_shift), lm_head left out (tied), head_dim as `attention.key_length`."""

from __future__ import annotations

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch.base import Arch, GgufSpec, dense_unsupported
from pipeserve.model.arch.llama import GGUF_BLOCK_NAMES
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_meta import GgufMeta
from pipeserve.model.layers import GATED_ACTIVATIONS


def config(raw: dict) -> dict:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    act = "gelu_pytorch_tanh" if act == "gelu" else act  # GemmaConfig's own correction
    if act not in GATED_ACTIVATIONS:
        raise ModelLoadError(f"unsupported hidden_act {act!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention (an encoder's attention) is not served")
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": act,
        "attention_bias": bias,
        "attention_out_bias": bias,  # GemmaAttention's o_proj follows attention_bias too
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "norm_unit_offset": True,
        "embed_scale": float(raw["hidden_size"]) ** 0.5,
    }


def unsupported(cfg: ModelConfig) -> dict[str, str]:
    gaps = dense_unsupported(cfg).get("native", "")
    return {"native": ", ".join(g for g in (gaps, "(1 + w) RMSNorm, scaled embeddings") if g)}


def gguf_config(meta: GgufMeta) -> dict:
    return {"hidden_act": "gelu_pytorch_tanh"}


ARCH = Arch(
    "gemma",
    "GemmaForCausalLM",
    config,
    unsupported=unsupported,
    gguf=GgufSpec("gemma", GGUF_BLOCK_NAMES, gguf_config, norm_shift=1.0),
)
