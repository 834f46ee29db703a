"""gemma3_text (Gemma 3, text only: Gemma3ForCausalLM): gemma2.py's layer with a (1 + weight) RMSNorm
over each q and k head before rotary, no attention soft-capping (transformers' Gemma3Attention passes
none, whatever `attn_logit_softcapping` says), final logit soft-capping where the config sets it.

Local layers (`layer_types`, else all but every `sliding_window_pattern`-th, default 6) see the last
`sliding_window` positions and rotate with their own base (`rope_local_base_freq`, or transformers 5's
rope_parameters["sliding_attention"], default rope only): StageModel's second rotary table. Global
layers use rope_theta (default 1e6) with the config's rope scaling (rope_parameters["full_attention"]
or `rope_scaling`: e.g. Gemma 3 4B's linear factor 8).
"""

from __future__ import annotations

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch.base import Arch
from pipeserve.model.arch.gemma2 import attention_spec, gemma_config, unsupported, weights
from pipeserve.model.config import ModelConfig
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


ARCH = Arch(
    "gemma3_text",
    "Gemma3ForCausalLM",
    config,
    weights=weights,
    layer=layer,
    unsupported=gemma3_unsupported,
)
