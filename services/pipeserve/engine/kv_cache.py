"""Sizing and allocation of a stage's paged KV pool.

Pool layout: [layers_local, 2 (K, V), num_blocks, block_size, kv_heads, head_dim].
The pool never needs more blocks than max_num_seqs full-length requests, so
sizing from memory is capped there; it must hold at least one full-length
request or the scheduler could not make progress.
"""

from __future__ import annotations

import logging

import torch

from pipeserve.config import EngineConfig
from pipeserve.errors import ConfigError
from pipeserve.model.config import ModelConfig
from pipeserve.obs.progress import Progress

log = logging.getLogger(__name__)


def block_bytes(cfg: ModelConfig, num_layers: int, block_size: int) -> int:
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    return num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def num_kv_blocks(
    config: EngineConfig,
    cfg: ModelConfig,
    num_layers: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    per_request = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        per_block = block_bytes(cfg, num_layers, config.block_size)
        if config.kv_cache_gb is not None:
            budget = int(config.kv_cache_gb * (1 << 30))
        else:
            budget = int(available_memory_bytes(device) * config.kv_cache_memory_fraction)
        blocks = min(budget // per_block, per_request * config.max_num_seqs)
    if blocks < per_request:
        raise ConfigError(
            f"KV pool of {blocks} blocks cannot hold one request of max_model_len={max_model_len} "
            f"({per_request} blocks of {config.block_size}); raise the pool size or lower max_model_len"
        )
    return blocks


def num_host_slots(config: EngineConfig, cfg: ModelConfig, num_layers: int) -> int:
    """L2 slots of one stage: host_cache_gb, or host_cache_memory_fraction of available RAM split
    among the group's stages (under `pipeserve up` they share one machine); 0 disables L2, as does
    turning prefix caching off (L2 holds prefixes). The group agrees on the minimum."""
    if not config.enable_prefix_caching or config.host_cache_gb == 0:
        return 0
    if config.host_cache_gb is not None:
        budget = int(config.host_cache_gb * (1 << 30))
    else:
        ram = available_memory_bytes(torch.device("cpu"))
        budget = int(ram * config.host_cache_memory_fraction / config.stages)
    return max(0, budget // block_bytes(cfg, num_layers, config.block_size))


def allocate_pool(
    cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """The zeroed pool. Zeroed one (layer, K/V) slab at a time, the same work as torch.zeros (which
    fills too: no lazily zeroed pages), so progress can be shown for a pool of many GiB."""
    shape = (num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    pool = torch.empty(shape, dtype=cfg.dtype, device=device)
    slab = pool.nbytes // max(1, num_layers * 2)
    with Progress(f"zeroing the KV pool ({num_blocks} blocks)", pool.nbytes, log) as progress:
        for layer in pool:
            for kv in layer:
                kv.zero_()
                progress.update(slab)
    return pool
