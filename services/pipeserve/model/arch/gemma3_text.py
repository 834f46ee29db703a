"""gemma3_text (Gemma 3, text only: Gemma3ForCausalLM): gemma2.py's layer with a (1 + weight) RMSNorm
over each q and k head before rotary, no attention soft-capping (transformers' Gemma3Attention passes
none, whatever `attn_logit_softcapping` says), final logit soft-capping where the config sets it.

Local layers (`layer_types`, else all but every `sliding_window_pattern`-th, default 6) see the last
`sliding_window` positions and rotate with their own base (`rope_local_base_freq`, or transformers 5's
rope_parameters["sliding_attention"], default rope only): StageModel's second rotary table. Global
layers use rope_theta (default 1e6) with the config's rope scaling (rope_parameters["full_attention"]
or `rope_scaling`: e.g. Gemma 3 4B's linear factor 8).

GGUF: llama.cpp's `gemma3` (its text part): gemma2's names and norms (1 + w) plus the q/k norms;
`rope.freq_base` is the global layers' base, `rope.freq_base_swa` the local ones' (llama.cpp's
default 1e4), linear scaling on the global layers; local layers every but the 6th unless the file
says (`attention.sliding_window_pattern`), none without a window; no attention softcap, the final
one only where the file has it; the 27B (62 layers) scales by (hidden/heads)**-0.5.
"""

from __future__ import annotations

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import gemma2
from pipeserve.model.arch.base import Arch, GgufSpec
from pipeserve.model.arch.gemma2 import attention_spec, gemma_config, unsupported, weights
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_meta import GgufMeta
from pipeserve.model.sandwich import SandwichDecoderLayer


def pattern(raw: dict) -> int:
    return int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)


def rope_thetas(raw: dict) -> tuple[float, float]:
    """(the global layers' rope base, the local layers'), with transformers' defaults (1e6, 1e4)."""
    params = raw.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"gemma3 local layers with rope type {local['rope_type']!r}: only default")
    global_theta = full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
    return float(global_theta), float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))


def config(raw: dict) -> dict:
    global_theta, local_theta = rope_thetas(raw)
    return {
        **gemma_config(raw, pattern(raw)),
        "qk_norm": True,
        "rope_theta": global_theta,
        "local_rope_theta": local_theta,
    }


def layer(cfg: ModelConfig, index: int) -> SandwichDecoderLayer:
    return SandwichDecoderLayer(cfg, attention_spec(cfg, index, pattern(cfg.raw), softcap=False))


def gemma3_unsupported(cfg: ModelConfig) -> dict[str, str]:
    return {k: v for k, v in unsupported(cfg).items() if k != "sdpa"}  # no attention softcap


GGUF_NAMES = {
    **gemma2.GGUF_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def gguf_config(meta: GgufMeta) -> dict:
    full: dict = {"rope_type": "default", "rope_theta": meta.f32("rope.freq_base", 1_000_000.0)}
    if meta.get("rope.scaling.type", "none") == "linear":
        full.update(rope_type="linear", factor=meta.f32("rope.scaling.factor"))
    local = {"rope_type": "default", "rope_theta": meta.f32("rope.freq_base_swa", 10_000.0)}
    return {
        **gemma2.gguf_gemma_config(meta, 62, 6),
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta.f32("final_logit_softcapping", 0.0) or None,
    }


ARCH = Arch(
    "gemma3_text",
    "Gemma3ForCausalLM",
    config,
    weights=weights,
    layer=layer,
    unsupported=gemma3_unsupported,
    gguf=GgufSpec("gemma3", GGUF_NAMES, gguf_config, norm_shift=1.0),
)
