"""ModelConfig: the parts of an HF `config.json` the engine needs, validated.

Accepts both the transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`)
and 5.x (`rope_parameters`, `dtype`) spellings.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeserve.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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
    sliding_window: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

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
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [k for k in (*required, "num_attention_heads") if k not in raw]
        if missing:
            raise ModelLoadError(f"config.json lacks {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads {heads} not divisible by kv heads {kv_heads}")
        rope = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling")
        if scaling:
            rope.update(scaling)
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        dtype_name = dtype or raw.get("dtype") or raw.get("torch_dtype") or "float32"
        eos: list[int] = []
        for src in (raw.get("eos_token_id"), (gen or {}).get("eos_token_id")):
            for tid in src if isinstance(src, list) else [src]:
                if tid is not None and int(tid) not in eos:
                    eos.append(int(tid))
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
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
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            dtype=parse_dtype(str(dtype_name)),
            eos_token_ids=tuple(eos),
            sliding_window=int(window) if window else None,
            raw=raw,
        )

    def inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies [head_dim/2], float32, with rope scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
        if self.rope_scaling is None:
            return inv
        s = self.rope_scaling
        if s["rope_type"] == "linear":
            return inv / float(s["factor"])
        # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s.get("original_max_position_embeddings", self.max_position_embeddings))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
