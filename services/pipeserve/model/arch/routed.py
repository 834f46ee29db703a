"""What the routed-experts architectures (qwen3_moe, mixtral) share: their layer, weight sources and
kernel gaps around model/moe.py's SparseMoE. Not an architecture itself (no REGISTRY line).

A layer is layers.DecoderLayer with a SparseMoE as its MLP, or the dense gated MLP on the layers the
MoeSpec names dense. Its experts live in that layer, so in the stage that owns it (stage splits
are by layer). Checkpoints carry the experts in one of two layouts, both read:

* transformers 5's fused tensors: `mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj` [E, 2I, H],
  `mlp.experts.down_proj` [E, H, I] (`save_pretrained(save_original_format=False)`);
* the per-expert tensors of v4 checkpoints, and of transformers 5's own default `save_pretrained`,
  which reverts its fusion: `<prefix>.{e}.<gate>.weight` [I, H] and so on, stacked by the loader
  (base.Stack: each expert's gate then up rows, expert 0 first).
"""

from __future__ import annotations

from torch import nn

from pipeserve.model.arch.base import (
    Cat,
    Either,
    Source,
    Stack,
    dense_layer,
    dense_unsupported,
    dense_weights,
)
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import DecoderLayer
from pipeserve.model.moe import MoeSpec, SparseMoE


def routed_layer(cfg: ModelConfig, index: int, spec: MoeSpec) -> nn.Module:
    layer = dense_layer(cfg, index)
    if index not in spec.dense_layers and isinstance(layer, DecoderLayer):
        layer.mlp = SparseMoE(cfg.hidden_size, spec)
    return layer


def routed_weights(
    cfg: ModelConfig,
    index: int,
    spec: MoeSpec,
    routers: tuple[str, ...],
    per_expert: str,
    gate_up_down: tuple[str, str, str],
) -> dict[str, Source]:
    """Layer `index`'s sources: dense_weights for a dense layer; else its attention and norms, the
    router (the first of `routers` the checkpoint has) and the experts, fused or per expert
    (`{per_expert}.{e}.{name}.weight` for the gate, up and down names `gate_up_down`)."""
    dense = dense_weights(cfg, index)
    if index in spec.dense_layers:
        return dense
    w = {k: v for k, v in dense.items() if not k.startswith("mlp.")}
    gate, up, down = (f"{per_expert}.{{e}}.{name}.weight" for name in gate_up_down)
    n = spec.num_experts
    w["mlp.gate.weight"] = Either(tuple(Cat((r,)) for r in routers))
    w["mlp.experts.gate_up_proj"] = Either((Cat(("mlp.experts.gate_up_proj",)), Stack((gate, up), n)))
    w["mlp.experts.down_proj"] = Either((Cat(("mlp.experts.down_proj",)), Stack((down,), n)))
    return w


def routed_unsupported(cfg: ModelConfig) -> dict[str, str]:
    """decode.c's step has no routed experts (and lacks what dense_unsupported names); on CUDA the
    experts' products run through the kernels, their dispatch in PyTorch."""
    gaps = ["routed experts", dense_unsupported(cfg).get("native", "")]
    return {"native": ", ".join(g for g in gaps if g), "triton": "the routed experts' dispatch"}
