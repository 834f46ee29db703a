"""ModelConfig: the parts of an HF `config.json` the engine needs, validated.

Accepts both the transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`)
and 5.x (`rope_parameters`, `dtype`) spellings. The fields every architecture has
(sizes, heads, rope, dtype, EOS ids) are parsed here; what one architecture adds
(biases, q/k norms, its sliding window, its activation) is parsed by its module
in model/arch/ (the registry names the supported `model_type`s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeserve.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Keys each rope type needs besides rope_theta (rope.py's math reads them).
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    # The window of the layers that slide (mistral, phi3: every layer; qwen2/qwen3: from
    # max_window_layers on), applied per layer by the paged kernels (layers.AttentionSpec.window);
    # None: no layer slides. Gemma's local layers read theirs from the raw config.
    sliding_window: int | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (layers.GATED_ACTIVATIONS)
    qk_norm: bool = False  # RMSNorm over each q/k head before rotary (qwen3)
    attention_out_bias: bool = False  # o_proj has a bias
    mlp_bias: bool = False  # gate/up/down have biases
    rotary_dim: int = 0  # the leading features of a head that rotate (partial_rotary_factor); 0: head_dim
    norm_unit_offset: bool = False  # every RMSNorm scales by 1 + weight (gemma: layers.UnitOffsetRMSNorm)
    embed_scale: float | None = None  # embeddings times this, cast to the model dtype (gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (gemma2/3)
    local_rope_theta: float | None = None  # default-rope base of AttentionSpec.local_rope layers (gemma3)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
        path = Path(model_dir)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path} is missing: not an HF-layout checkpoint")
        raw = json.loads(cfg_path.read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dict(raw, gen, dtype)

    @classmethod
    def from_dict(cls, raw: dict, gen: dict | None = None, dtype: str | None = None) -> ModelConfig:
        from pipeserve.model.arch import get_arch

        arch = get_arch(raw.get("model_type"))  # ModelLoadError naming the supported ones
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [k for k in (*required, "num_attention_heads") if k not in raw]
        if missing:
            raise ModelLoadError(f"config.json lacks {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads {heads} not divisible by kv heads {kv_heads}")
        theta, rope_scaling, rotary = _rope(raw, head_dim, arch.rope_aliases)
        dtype_name = dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
        eos: list[int] = []
        for src in (raw.get("eos_token_id"), (gen or {}).get("eos_token_id")):
            for tid in src if isinstance(src, list) else [src]:
                if tid is not None and int(tid) not in eos:
                    eos.append(int(tid))
        shared: dict[str, Any] = dict(
            model_type=raw["model_type"],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=parse_dtype(str(dtype_name)),
            eos_token_ids=tuple(eos),
            rotary_dim=rotary,
            raw=raw,
        )
        # The arch's own fields (attention_bias, sliding_window, ...), and its defaults where they
        # differ from the shared ones (gemma: tied embeddings).
        return cls(**{**shared, **arch.config(raw)})


def _rope(raw: dict, head_dim: int, aliases: dict[str, str]) -> tuple[float, dict | None, int]:
    """(rope_theta, the scaling dict rope.py reads or None, rotary_dim), resolved as transformers'
    standardize_rope_params does (a top-level original_max_position_embeddings wins)."""
    rope = dict(raw.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):  # transformers 5's per-layer-type form (gemma3)
        rope = dict(rope["full_attention"])  # the model's table; the arch reads the local one
    scaling = raw.get("rope_scaling")
    if scaling:
        rope.update(scaling)
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    rope_type = aliases.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary = int(head_dim * partial)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ModelLoadError(f"partial_rotary_factor {partial} gives {rotary} rotary features of {head_dim}")
    if rope_type == "default":
        return theta, None, rotary
    lacking = [k for k in _ROPE_KEYS[rope_type] if rope.get(k) is None]
    if lacking:
        raise ModelLoadError(f"rope type {rope_type!r} lacks {', '.join(lacking)}")
    old_len = raw.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    old_len = int(old_len or raw.get("max_position_embeddings", 2048))
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(rope[key]) != rotary // 2:
                n = len(rope[key])
                raise ModelLoadError(f"longrope {key} has {n} values for {rotary // 2} frequencies")
    return theta, {**rope, "rope_type": rope_type, "original_max_position_embeddings": old_len}, rotary
