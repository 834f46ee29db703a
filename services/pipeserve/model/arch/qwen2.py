"""qwen2 (Qwen2, Qwen2.5): the llama layer with q/k/v biases (o_proj has none); a sliding window
only where `use_sliding_window` is set, and then only on the layers `layer_types` names
sliding_attention (by default layer i >= max_window_layers, transformers 5's Qwen2Config), applied
per layer by the paged kernels (layers.AttentionSpec.window: the context is not capped).

GGUF: llama.cpp's `qwen2` (NEOX rope: q/k rows as HF has them), llama's names plus the q/k/v biases."""

from __future__ import annotations

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch.base import Arch, GgufSpec, check_activation
from pipeserve.model.arch.llama import GGUF_BLOCK_NAMES
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import AttentionSpec, DecoderLayer

SLIDING, FULL = "sliding_attention", "full_attention"


def sliding_layers(raw: dict) -> list[bool]:
    """Whether each layer slides, as transformers 5's Qwen2Config/Qwen3Config says: none unless
    use_sliding_window and a sliding_window; then `layer_types`, else layer i >= max_window_layers
    (default 28)."""
    n = int(raw["num_hidden_layers"])
    if not (raw.get("use_sliding_window", False) and raw.get("sliding_window")):
        return [False] * n
    kinds = raw.get("layer_types") or [
        SLIDING if i >= int(raw.get("max_window_layers", 28)) else FULL for i in range(n)
    ]
    if len(kinds) != n or not set(kinds) <= {SLIDING, FULL}:
        raise ModelLoadError(f"layer_types must name {n} layers, each {SLIDING!r} or {FULL!r}: {kinds!r}")
    return [k == SLIDING for k in kinds]


def sliding_window(raw: dict) -> int | None:
    """The window of qwen2/qwen3 configs: off unless use_sliding_window (transformers' rule) and some
    layer slides."""
    return int(raw["sliding_window"]) if any(sliding_layers(raw)) else None


def layer(cfg: ModelConfig, index: int) -> DecoderLayer:
    """The llama layer; the window only on the layers that slide (sliding_layers)."""
    window = cfg.sliding_window if sliding_layers(cfg.raw)[index] else None
    return DecoderLayer(cfg, AttentionSpec(scale=cfg.head_dim**-0.5, window=window))


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
ARCH = Arch("qwen2", "Qwen2ForCausalLM", config, layer=layer, gguf=GgufSpec("qwen2", GGUF_NAMES))
