"""Sizing and allocation of a stage's paged KV pool.

Pool layout: [layers_local, 2 (K, V), num_blocks, block_size, kv_heads, head_dim],
in the KV dtype (`kv_cache_dtype`: the model's by default; float16/bfloat16 halve
a float32 pool, values are cast on store and upcast in attention).

Default size (neither num_kv_blocks nor kv_cache_gb given): what the engine can
use — max_num_seqs full-length requests, max_num_seqs x max_model_len tokens
rounded up to blocks, for this stage's layers — capped at
kv_cache_memory_fraction of the memory available now (CPU: MemAvailable; CUDA:
free device memory, measured after the weights are loaded); a binding cap is
logged once. A local group divides the fraction between its stages, and the
group takes the smallest proposal. The pool must hold one full-length request or
the scheduler could not make progress.

On the CPU the pool is an anonymous private mapping: the OS guarantees its pages
read as zero until written, and a page costs memory (RSS) only once written, so
neither start-up nor an unused part of the pool pays for zero-filling it.
Attention reads unwritten slots (a partial last block, block 0 behind padded
block tables) under a mask; 0 x NaN is NaN, so those slots must be finite, which
zero pages are.
"""

from __future__ import annotations

import logging
import mmap

import torch

from pipeserve.config import EngineConfig
from pipeserve.errors import ConfigError
from pipeserve.model.config import ModelConfig

log = logging.getLogger(__name__)


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_dtype(config: EngineConfig, cfg: ModelConfig) -> torch.dtype:
    """The pool's dtype: `kv_cache_dtype`, where "auto" is the model's dtype, except float16 under a
    quantized float32 model (as llama.cpp's default f16 cache): half the pool, L2 and L3 bytes, on
    a path that is not HF-exact anyway; docs/memory.md."""
    if config.kv_cache_dtype != "auto":
        return KV_DTYPES[config.kv_cache_dtype]
    if config.quantization != "none" and cfg.dtype == torch.float32:
        return torch.float16
    return cfg.dtype


def block_bytes(cfg: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one block over `num_layers` layers in `dtype` (default: the model's)."""
    elem = torch.empty((), dtype=dtype or cfg.dtype).element_size()
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
    """The block count this stage proposes (module doc: explicit sizes win, else the default)."""
    per_request = -(-max_model_len // config.block_size)
    wanted = per_request * config.max_num_seqs
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        per_block = block_bytes(cfg, num_layers, config.block_size, kv_dtype(config, cfg))
        if config.kv_cache_gb is not None:
            blocks = min(int(config.kv_cache_gb * (1 << 30)) // per_block, wanted)
        else:
            available = available_memory_bytes(device)
            blocks = min(int(available * config.kv_cache_memory_fraction) // per_block, wanted)
            if blocks < wanted:
                log.info(
                    "KV pool capped by memory: %d tokens fit in %.0f%% of %.2f GiB available "
                    "(wanted %d = max_num_seqs %d x max_model_len %d)",
                    blocks * config.block_size,
                    100 * config.kv_cache_memory_fraction,
                    available / (1 << 30),
                    wanted * config.block_size,
                    config.max_num_seqs,
                    max_model_len,
                )
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
    return max(0, budget // block_bytes(cfg, num_layers, config.block_size, kv_dtype(config, cfg)))


def allocate_pool(
    cfg: ModelConfig,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The pool, every slot zero, in `dtype` (default: the model's). On the CPU an anonymous mapping
    (module doc: zero pages from the OS, resident only once written); on CUDA torch.zeros (a memset)."""
    shape = (num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.dtype
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = max(1, block_bytes(cfg, num_layers, block_size, dtype) * num_blocks)
    # MAP_PRIVATE: memory of this process only (MAP_SHARED anonymous memory would be shmem).
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `region` alive as long as the tensor's storage lives.
    return torch.frombuffer(region, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
