"""What an architecture module declares (`Arch`), and the parts llama-like ones share.

An Arch says, for one `model_type`:

* `config(raw)`: the ModelConfig fields it reads from config.json beyond the shared ones
  (config.py parses those: sizes, heads, rope, dtype, EOS); it raises ModelLoadError for what it
  does not implement.
* `layer(cfg, i)`: decoder layer i (global index: per-layer attention specs, e.g. alternating
  sliding windows), built from layers.py's parts. Its forward is (x [T, hidden], AttentionBatch,
  k_cache, v_cache) -> [T, hidden].
* `weights(cfg, i)`: layer i's parameter name -> its `Source` in the checkpoint, names relative to
  `model.layers.{i}.` (layers of one model may differ: qwen3_moe's dense and MoE layers). The
  embedding, final norm and lm_head are the same for every arch (TOP).
* `gguf`: llama.cpp's architecture name and per-block tensor names (GgufSpec), or None where
  GGUF files of this arch are not converted.
* `unsupported(cfg)`: kernel path -> why this arch's layer cannot run on it ("native": decode.c's
  one-call decode step). The stage then runs the PyTorch layers for it and says so once.
* `split(num_layers, stages)`: each stage's contiguous layer range.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import GATED_ACTIVATIONS, AttentionSpec, DecoderLayer

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
LAYER_PREFIX = "model.layers.{}."


@dataclass(frozen=True)
class Cat:
    """Checkpoint tensors concatenated along dim 0, in this order (one name: the tensor itself)."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class Fused:
    """One checkpoint tensor holding several parts stacked along dim 0 in the checkpoint's `order`
    (phi3's qkv_proj, gate_up_proj); the parameter holds them in `want` order. Part sizes: part_sizes."""

    name: str
    order: tuple[str, ...]
    want: tuple[str, ...]

    def reorder(self, t: torch.Tensor, sizes: Mapping[str, int]) -> torch.Tensor:
        if self.order == self.want:
            return t
        parts = dict(zip(self.order, t.split([sizes[p] for p in self.order]), strict=True))
        return torch.cat([parts[p] for p in self.want])


@dataclass(frozen=True)
class Stack:
    """Per-expert checkpoint tensors stacked along a new dim 0, expert 0 first: each expert's `parts`
    (names with `{e}`) concatenated along dim 0 first, so gate then up rows make [E, 2I, H], as
    transformers 5 fuses the per-expert tensors of v4 checkpoints (MergeModulelist, Concatenate)."""

    parts: tuple[str, ...]
    num_experts: int

    def names(self) -> tuple[str, ...]:
        return tuple(p.format(e=e) for e in range(self.num_experts) for p in self.parts)


@dataclass(frozen=True)
class Either:
    """The first of `options` whose tensors the checkpoint holds: one parameter stored in more than
    one layout (transformers 5's fused experts, or the per-expert tensors of older checkpoints)."""

    options: tuple[Cat | Fused | Stack, ...]

    def choose(self, present: Callable[[str], bool]) -> Cat | Fused | Stack:
        """The first option all of whose names `present` holds; else the first (its names then show
        up as missing)."""
        return next((o for o in self.options if all(map(present, checkpoint_names(o)))), self.options[0])


Source = Cat | Fused | Stack | Either


def part_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Rows of each part of the fused projections (layers.Attention.qkv_proj, layers.MLP.gate_up_proj)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": q, "k": kv, "v": kv, "gate": cfg.intermediate_size, "up": cfg.intermediate_size}


def checkpoint_names(source: Cat | Fused | Stack) -> tuple[str, ...]:
    if isinstance(source, Cat):
        return source.names
    return source.names() if isinstance(source, Stack) else (source.name,)


@dataclass(frozen=True)
class GgufSpec:
    """How llama.cpp's converter (convert_hf_to_gguf.py) writes this arch; gguf.py reads it back.

    * `name`: `general.architecture`; `claims(meta)`: whether a file of that name is this arch (llama
      and mixtral share "llama": mixtral's has experts).
    * `block_names`: per block (`blk.N.` + key) the HF tensor (`model.layers.N.` + value); a value
      with `{e}` is an expert tensor stacked along dim 0 ([E, ...]), one HF tensor per expert.
    * `config(meta)`: this arch's config.json fields from the metadata (model/gguf_meta.GgufMeta)
      beyond the shared ones gguf.hf_config reads (sizes, heads, rope base and scaling, eps, EOS).
    * `permuted_qk`: q/k rows permuted for llama.cpp's interleaved rope (llama's; NEOX-rope archs
      such as qwen2/qwen3/phi3/gemma are written unpermuted).
    * `norm_shift`: what llama.cpp added to every `*norm.weight` (gemma's (1 + w) RMSNorm: 1.0)."""

    name: str
    block_names: Mapping[str, str]
    config: Callable[[Any], dict[str, Any]] = lambda meta: {}
    permuted_qk: bool = False
    norm_shift: float = 0.0
    claims: Callable[[Any], bool] = lambda meta: True


def balanced_layer_split(num_layers: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ranges, sizes differing by at most one, larger ones first."""
    if world_size > num_layers:
        raise ModelLoadError(f"{world_size} stages for {num_layers} layers: each stage needs a layer")
    base, extra = divmod(num_layers, world_size)
    out, lo = [], 0
    for r in range(world_size):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def dense_weights(cfg: ModelConfig, index: int) -> dict[str, Source]:
    """A llama-like layer's parameters from separate q/k/v and gate/up tensors, biases and q/k norms
    as the config has them (llama, mistral, qwen2, qwen3)."""
    w: dict[str, Source] = {
        "input_layernorm.weight": Cat(("input_layernorm.weight",)),
        "post_attention_layernorm.weight": Cat(("post_attention_layernorm.weight",)),
        "self_attn.o_proj.weight": Cat(("self_attn.o_proj.weight",)),
        "mlp.down_proj.weight": Cat(("mlp.down_proj.weight",)),
    }
    for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
        w[f"self_attn.qkv_proj.{kind}"] = Cat(tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv"))
    for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
        w[f"mlp.gate_up_proj.{kind}"] = Cat((f"mlp.gate_proj.{kind}", f"mlp.up_proj.{kind}"))
    if cfg.mlp_bias:
        w["mlp.down_proj.bias"] = Cat(("mlp.down_proj.bias",))
    if cfg.attention_out_bias:
        w["self_attn.o_proj.bias"] = Cat(("self_attn.o_proj.bias",))
    if cfg.qk_norm:
        w["self_attn.q_norm.weight"] = Cat(("self_attn.q_norm.weight",))
        w["self_attn.k_norm.weight"] = Cat(("self_attn.k_norm.weight",))
    return w


def dense_layer(cfg: ModelConfig, index: int) -> nn.Module:
    """layers.DecoderLayer at the head_dim**-0.5 scale, every layer alike: full attention, or the
    config's sliding window on each (mistral, phi3)."""
    return DecoderLayer(cfg, AttentionSpec(scale=cfg.head_dim**-0.5, window=cfg.sliding_window))


def dense_unsupported(cfg: ModelConfig) -> dict[str, str]:
    """What decode.c's step (native_decode.py) lacks for layers.DecoderLayer under this config."""
    gaps = []
    if cfg.qk_norm:
        gaps.append("q/k RMSNorm")
    if cfg.rotary_dim != cfg.head_dim:
        gaps.append("partial rotary")
    if cfg.hidden_act != "silu":
        gaps.append(f"{cfg.hidden_act} MLP")
    if cfg.sliding_window is not None:
        gaps.append("sliding window")
    return {"native": ", ".join(gaps)} if gaps else {}


def check_activation(raw: dict) -> str:
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in GATED_ACTIVATIONS:
        raise ModelLoadError(f"unsupported hidden_act {act!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
    return act


@dataclass(frozen=True)
class Arch:
    model_type: str
    hf_class: str  # config.json's `architectures` entry (transformers' class)
    config: Callable[[dict], dict]
    weights: Callable[[ModelConfig, int], dict[str, Source]] = dense_weights  # (cfg, layer index)
    layer: Callable[[ModelConfig, int], nn.Module] = dense_layer
    unsupported: Callable[[ModelConfig], dict[str, str]] = dense_unsupported
    gguf: GgufSpec | None = None
    rope_aliases: Mapping[str, str] = field(default_factory=dict)  # config rope_type -> rope.py's name
    split: Callable[[int, int], list[tuple[int, int]]] = field(default=balanced_layer_split)
