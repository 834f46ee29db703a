"""Demo checkpoints of the registered architectures beyond llama/qwen2 (demo.py writes those two by
hand, byte for byte as before): each one's config.json fields, and weights named and shaped as the
architecture's checkpoints are, derived from the registry itself.

The weights: pipeserve's own StageModel for the config (on the meta device: shapes only) gives each
parameter's shape; the arch's `weights(cfg, i)` says which checkpoint tensors make it (base.Cat rows
split into q/k/v by base.part_sizes, gate/up in halves; base.Fused one tensor; base.Stack one per
expert; base.Either its first layout, transformers 5's). So a new architecture in the registry gets a
demo checkpoint with no code here beyond its config fields (ARCH_FIELDS), and the loader's own view of
the names is what is written. transformers loads them (tests/model/test_demo_archs.py).
"""

from __future__ import annotations

import math

import torch

from pipeserve.model.arch import get_arch
from pipeserve.model.arch.base import EMBED, HEAD, LAYER_PREFIX, NORM, Cat, Either, Fused, Stack, part_sizes
from pipeserve.model.config import ModelConfig
from pipeserve.model.demo_spec import DemoSpec
from pipeserve.model.stage_model import StageModel, StageSpec

WINDOW = 128  # the demo's sliding window where the family has one (shorter than its context)


def arch_fields(spec: DemoSpec) -> dict:
    """config.json fields of `spec.arch` beyond the shared ones (demo._config writes those)."""
    experts = {"num_experts_per_tok": 2}
    gemma = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.hidden // spec.heads,
        "sliding_window": WINDOW,
    }
    fields: dict[str, dict] = {
        "mistral": {"sliding_window": WINDOW},
        "qwen3": {"use_sliding_window": False, "sliding_window": None, "attention_bias": False},
        "phi3": {"sliding_window": WINDOW},
        "gemma": {"hidden_activation": "gelu_pytorch_tanh"},
        "gemma2": {**gemma, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        "gemma3_text": {**gemma, "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0},
        "qwen3_moe": {
            **experts,
            "num_experts": 4,
            "moe_intermediate_size": max(spec.intermediate // 4, 1),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            "sliding_window": None,
        },
        "mixtral": {**experts, "num_local_experts": 4, "sliding_window": None},
    }
    return fields.get(spec.arch, {})


def _parts(source: Cat | Fused | Stack, shape: tuple[int, ...], sizes: dict[str, int]) -> list[tuple]:
    """(checkpoint name, shape) of each tensor that makes a parameter of `shape`."""
    if isinstance(source, Fused):
        return [(source.name, shape)]
    if isinstance(source, Stack):  # [E, rows, ...]: each expert's parts stacked along its rows
        rows = shape[1] // len(source.parts)
        return [(name, (rows, *shape[2:])) for name in source.names()]
    if len(source.names) == 1:
        return [(source.names[0], shape)]
    keys = [n.split(".")[-2].removesuffix("_proj") for n in source.names]
    split: list[int] = (
        [sizes[k] for k in keys] if set(keys) <= {"q", "k", "v"} else [shape[0] // len(keys)] * len(keys)
    )
    return [(n, (r, *shape[1:])) for n, r in zip(source.names, split, strict=True)]


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of `cfg`'s model, named as its architecture's checkpoints name them."""
    with torch.device("meta"):
        own = {
            n: tuple(p.shape)
            for n, p in StageModel(cfg, StageSpec(0, 1, 0, cfg.num_layers), 16).named_parameters()
        }
    shapes = {EMBED: own["embed_tokens.weight"], NORM: own["norm.weight"]}
    if not cfg.tie_word_embeddings:
        shapes[HEAD] = own["lm_head.weight"]
    arch, sizes = get_arch(cfg.model_type), part_sizes(cfg)
    for i in range(cfg.num_layers):
        for param, source in arch.weights(cfg, i).items():
            chosen = source.options[0] if isinstance(source, Either) else source
            for name, shape in _parts(chosen, own[f"layers.{i}.{param}"], sizes):
                shapes[LAYER_PREFIX.format(i) + name] = shape
    return shapes


def arch_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights at the demo's scales (demo._weights): projections 1/sqrt(fan_in), norms around
    1 (around 0 for Gemma's (1 + w) norms), biases 0.1, embeddings 0.25, lm_head 4/sqrt(hidden)."""
    g = torch.Generator().manual_seed(seed)
    norm_base = 0.0 if cfg.norm_unit_offset else 1.0
    out = {}
    for name, shape in sorted(checkpoint_shapes(cfg).items()):
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            out[name] = norm_base + 0.1 * noise
        elif name.endswith(".bias"):
            out[name] = 0.1 * noise
        elif name == EMBED:
            out[name] = 0.25 * noise
        elif name == HEAD:
            out[name] = noise * 4 / math.sqrt(shape[-1])
        else:
            out[name] = noise / math.sqrt(shape[-1])
    return out
