"""Building a stage's HiCache pieces from its config (called by stage/assemble.py).

The L3 fingerprint extends the model fingerprint (config, weight headers and
sampled weight bytes, dtype) with the group's layer split and block size:
pages of another checkpoint or split have other keys, so they are never read.
"""

from __future__ import annotations

import torch
import xxhash

from pipeserve.config import EngineConfig
from pipeserve.hicache.directory import LoadDeadline, RedisDirectory
from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.redis_tier import RedisTier
from pipeserve.hicache.stage_tiers import StageTiers
from pipeserve.hicache.writer import PageWriter
from pipeserve.model.config import ModelConfig


def l3_fingerprint(model_fingerprint: str, split: list[tuple[int, int]], block_size: int) -> str:
    text = f"{model_fingerprint}|{','.join(f'{lo}:{hi}' for lo, hi in split)}|b{block_size}"
    return xxhash.xxh3_64_hexdigest(text.encode())


def page_layouts(
    fingerprint: str,
    split: list[tuple[int, int]],
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype | None = None,
) -> list[PageLayout]:
    """Every stage's page layout, in rank order (stage 0 asks L3 about all of them). Pages carry the
    KV pool's `dtype` (default: the model's): its name is in the key and the header, so a page of a
    16-bit pool is never read into a 32-bit one."""
    dtype = dtype or cfg.dtype
    return [
        PageLayout(fingerprint, rank, lo, hi, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        for rank, (lo, hi) in enumerate(split)
    ]


def _tier(config: EngineConfig) -> RedisTier:
    url = config.l3_url
    assert url is not None
    if url == "local":
        raise ValueError("hicache_url: 'local' must be started by the launcher (pipeserve up, LLM)")
    return RedisTier(url, timeout_s=config.hicache_timeout_s, ttl_s=config.hicache_ttl_s)


def build_stage_tiers(
    config: EngineConfig, layout: PageLayout, host_slots: int, device: torch.device, delay_s: float = 0.0
) -> StageTiers | None:
    """One stage's L2 pool and L3 loader/writer; None with neither. `delay_s`: a test fault
    (ring/faults.py l3_delay_ms) that makes this stage's loads slow."""
    if config.l3_url is None and host_slots == 0:
        return None
    tier = writer = None
    if config.l3_url is not None:
        tier = _tier(config)
        writer = PageWriter(
            tier,
            layout,
            buffer_bytes=int(config.hicache_write_buffer_mb * (1 << 20)),
            rate_bytes_s=config.hicache_write_mb_s * 1e6,
            pin_memory=device.type == "cuda",
        )
    return StageTiers(layout, host_slots, tier, writer, device, delay_s)


def build_directory(config: EngineConfig, layouts: list[PageLayout]) -> RedisDirectory | None:
    """Stage 0's presence queries to L3; None without L3 (or without prefix caching: L3 holds prefixes)."""
    if config.l3_url is None or not config.enable_prefix_caching:
        return None
    deadline = LoadDeadline(
        config.hicache_load_base_ms, config.hicache_load_per_block_ms, config.hicache_load_max_ms
    )
    return RedisDirectory(_tier(config), layouts, deadline)
