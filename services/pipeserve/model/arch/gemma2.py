"""gemma2 (Gemma 2): the sandwich layer (model/sandwich.py: a norm before and after attention and
the MLP), Gemma's (1 + weight) RMSNorm everywhere, GeGLU (`hidden_activation` gelu_pytorch_tanh),
embeddings times sqrt(hidden_size) in the model dtype, attention scaled by query_pre_attn_scalar**-0.5,
attention logit soft-capping (`attn_logit_softcapping`) and final logit soft-capping
(`final_logit_softcapping`), tied embeddings by default.

Local and global layers alternate (`layer_types`; else every even layer is local): a local layer sees
the last `sliding_window` positions (layers.AttentionSpec.window, applied by the paged attention
kernels, so the context is not capped). With a softcap the CPU path computes explicit attention
scores (SDPA has none): said once in the log (arch `unsupported`: "sdpa").

gemma3_text.py reuses these parts.

GGUF: llama.cpp's `gemma2` (NEOX rope: rows unpermuted) stores every norm weight as 1 + w (given back
by gguf.py: norm_shift), names the four norms attn_norm, post_attention_norm, ffn_norm and
post_ffw_norm, leaves lm_head out (tied), and keeps no query_pre_attn_scalar: it scales by
head_dim**-0.5, by (hidden/heads)**-0.5 for the 27B (46 layers), which is what Gemma's configs say.
Local layers: `attention.sliding_window_pattern` (a bool per layer, or every n-th layer global), else
llama.cpp's default for the arch (2); softcaps default to llama.cpp's (50, 30).
"""

from __future__ import annotations

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch.base import Arch, Cat, GgufSpec, Source, dense_weights
from pipeserve.model.arch.llama import GGUF_BLOCK_NAMES
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_meta import GgufMeta
from pipeserve.model.layers import GATED_ACTIVATIONS, AttentionSpec
from pipeserve.model.sandwich import SandwichDecoderLayer

SLIDING, FULL = "sliding_attention", "full_attention"


def positive(raw: dict, key: str) -> float | None:
    """raw[key] as a float > 0, or None where it is absent or null."""
    value = raw.get(key)
    if value is None:
        return None
    if not float(value) > 0:
        raise ModelLoadError(f"{key} must be > 0 or null, got {value!r}")
    return float(value)


def layer_types(raw: dict, pattern: int) -> list[str]:
    """Each layer's attention kind: `layer_types`, else every `pattern`-th layer global (transformers'
    default: gemma2 every 2nd, gemma3 every 6th, `sliding_window_pattern`)."""
    n = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(kinds) != n or not set(kinds) <= {SLIDING, FULL}:
        raise ModelLoadError(f"layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}: {kinds!r}")
    return list(kinds)


def gemma_config(raw: dict, pattern: int) -> dict:
    """The ModelConfig fields Gemma 2 and 3 share, and a ModelLoadError for what they do not serve."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GATED_ACTIVATIONS:
        supported = ", ".join(GATED_ACTIVATIONS)
        raise ModelLoadError(f"unsupported hidden_activation {act!r}; supported: {supported}")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention (an encoder's attention) is not served")
    if SLIDING in layer_types(raw, pattern) and positive(raw, "sliding_window") is None:
        raise ModelLoadError("local (sliding_attention) layers need a sliding_window")
    positive(raw, "query_pre_attn_scalar")
    positive(raw, "attn_logit_softcapping")
    bias = bool(raw.get("attention_bias", False))
    return {
        "hidden_act": act,
        "attention_bias": bias,
        "attention_out_bias": bias,  # o_proj follows attention_bias too
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "norm_unit_offset": True,
        "embed_scale": float(raw["hidden_size"]) ** 0.5,
        "final_logit_softcap": positive(raw, "final_logit_softcapping"),
    }


def attention_spec(cfg: ModelConfig, index: int, pattern: int, softcap: bool) -> AttentionSpec:
    """Layer `index`'s attention: query_pre_attn_scalar**-0.5; a local layer's window and rope."""
    raw = cfg.raw
    local = layer_types(raw, pattern)[index] == SLIDING
    return AttentionSpec(
        scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,  # transformers' default: 256
        window=int(raw["sliding_window"]) if local else None,
        softcap=positive(raw, "attn_logit_softcapping") if softcap else None,
        local_rope=local and cfg.local_rope_theta is not None,
    )


def weights(cfg: ModelConfig, index: int) -> dict[str, Source]:
    """The llama layer's tensors (q/k norms where gemma3 has them) and the two norms around the MLP."""
    w = dense_weights(cfg, index)
    for name in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"):
        w[name] = Cat((name,))
    return w


def unsupported(cfg: ModelConfig) -> dict[str, str]:
    gaps = {
        "native": "the sandwich layer (pre and post norms, (1 + w) RMSNorm, GeGLU)",
        "triton": "the GeGLU activation",
    }
    if positive(cfg.raw, "attn_logit_softcapping") is not None:
        gaps["sdpa"] = "attention logit soft-capping"
    return gaps


def config(raw: dict) -> dict:
    return gemma_config(raw, 2)


def layer(cfg: ModelConfig, index: int) -> SandwichDecoderLayer:
    return SandwichDecoderLayer(cfg, attention_spec(cfg, index, 2, softcap=True))


GGUF_NAMES = {
    **{k: v for k, v in GGUF_BLOCK_NAMES.items() if "norm" not in k},
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def gguf_layer_types(meta: GgufMeta, default: int) -> list[str]:
    """llama.cpp's local layers: the pattern's bool per layer, or layer i local unless
    i % n == n - 1 (hparams.set_swa_pattern), n the file's or the arch's default."""
    n_layers = int(meta.need("block_count"))
    pattern = meta.get("attention.sliding_window_pattern", default)
    if isinstance(pattern, list):
        return [SLIDING if local else FULL for local in pattern]
    return [SLIDING if i % int(pattern) < int(pattern) - 1 else FULL for i in range(n_layers)]


def gguf_gemma_config(meta: GgufMeta, big_layers: int, pattern: int) -> dict:
    """What Gemma 2 and 3 files share: the activation, the attention scale llama.cpp uses (the 27B's,
    `big_layers` deep, is (hidden/heads)**-0.5), local layers and their window."""
    hidden, heads = int(meta.need("embedding_length")), int(meta.need("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    big = int(meta.need("block_count")) == big_layers
    window = int(meta.get("attention.sliding_window", 0))
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "sliding_window": window or None,
        "layer_types": gguf_layer_types(meta, pattern) if window else [FULL] * int(meta.need("block_count")),
    }


def gguf_config(meta: GgufMeta) -> dict:
    return {
        **gguf_gemma_config(meta, 46, 2),
        "sliding_window": int(meta.get("attention.sliding_window", 4096)),
        "layer_types": gguf_layer_types(meta, 2),
        "attn_logit_softcapping": meta.f32("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.f32("final_logit_softcapping", 30.0),
    }


ARCH = Arch(
    "gemma2",
    "Gemma2ForCausalLM",
    config,
    weights=weights,
    layer=layer,
    unsupported=unsupported,
    gguf=GgufSpec("gemma2", GGUF_NAMES, gguf_config, norm_shift=1.0),
)
