"""EngineConfig: every engine setting, validated in one place.

Invalid values raise ConfigError (a ValueError) naming the field. Environment
variables, where a setting may come from one, use the PIPESERVE_ prefix and
are read by the CLI, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from pipeserve.errors import ConfigError

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str | None = None  # None: the checkpoint's dtype
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # explicit pool size (tests); wins over kv_cache_gb
    kv_cache_gb: float | None = None  # None: a share of available memory, see kv_cache.py
    kv_cache_memory_fraction: float = 0.25
    enable_prefix_caching: bool = True
    stages: int = 1
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{name}: {msg} (got {getattr(self, name)!r})")

        need(Path(self.model).is_dir(), "model", "must be a checkpoint directory")
        need(self.device.split(":")[0] in DEVICES, "device", f"must be one of {DEVICES}")
        need(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            "must be a power of 2 <= 128",
        )
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        need(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0")
        need(
            0 < self.kv_cache_memory_fraction <= 0.9,
            "kv_cache_memory_fraction",
            "must be in (0, 0.9]",
        )
        need(self.stages >= 1, "stages", "must be >= 1")
        need(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
