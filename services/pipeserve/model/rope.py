"""Rotary position embeddings: each rope type's inverse frequencies and the cos/sin table.

The math is transformers' (modeling_rope_utils.py), float32 on the CPU, so a table entry is the
value transformers computes for the same position:

* default, linear (inv_freq / factor), llama3 (low frequencies divided by `factor`, a smooth blend
  between `low_freq_factor` and `high_freq_factor`);
* yarn: per dimension a ramp between interpolated (inv_freq / factor) and extrapolated (inv_freq)
  frequencies over [beta_fast, beta_slow] rotations, and cos/sin scaled by the attention factor
  (`attention_factor`, else 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio);
* longrope (phi3): inv_freq divided per dimension by `short_factor`, cos/sin scaled by
  sqrt(1 + ln(factor) / ln(original)). transformers switches a sequence longer than
  `original_max_position_embeddings` to `long_factor` for every position, recomputing its cache
  (Phi3ForCausalLM.prepare_inputs_for_generation): a paged cache keeps each position's rotation,
  so the context is capped at the original length (`exact_context`), where the short factors are
  transformers' own.

`cfg.rope_scaling` is the normalized dict config.py builds (rope_type, factor, and
original_max_position_embeddings resolved); only the first `cfg.rotary_dim` features of a head
rotate (partial_rotary_factor).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pipeserve.model.config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old_len = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1: keep the dimension's frequency, 0: interpolate it
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _longrope_attention(cfg: ModelConfig, s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def exact_context(cfg: ModelConfig) -> int | None:
    """The longest context this rope type is served exactly at, where that is below the model's."""
    s = cfg.rope_scaling
    if s is not None and s["rope_type"] == "longrope":
        return min(cfg.max_position_embeddings, s["original_max_position_embeddings"])
    return None


def inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] float32, attention factor cos/sin are scaled by)."""
    dim, theta, s = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
    inv = _base_inv_freq(theta, dim)
    if s is None:
        return inv, 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, s), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, s)
    if kind == "longrope":
        ext = torch.tensor(s["short_factor"], dtype=torch.float32, device="cpu")
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (ext * theta**shape), _longrope_attention(cfg, s)
    raise ValueError(f"rope type {kind!r}")  # config.py admits only its SUPPORTED_ROPE_TYPES


class RotaryTable(nn.Module):
    """cos/sin [max_len, rotary_dim] for every position up to max_len, float32 math as in transformers."""

    cos: torch.Tensor  # [max_len, rotary_dim] (buffers)
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        # Computed on the CPU even inside a meta-device context (the loader builds the model on
        # meta; every tensor here names the CPU): meta math would import torch._dynamo (~70 MiB).
        t = torch.arange(max_len, dtype=torch.int64, device="cpu").float()
        inv, attention = inv_freq(cfg)
        freqs = t[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention).to(cfg.dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).to(cfg.dtype), persistent=False)

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]
