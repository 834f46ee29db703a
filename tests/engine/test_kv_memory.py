"""The KV pool's memory: default size from the engine's limits capped by available memory, explicit
sizes winning, --kv-cache-dtype (pool bytes halve, pages carry the dtype, greedy drift bounded), and
a CPU pool that reads zero without being resident until written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.config import EngineConfig
from pipeserve.errors import ConfigError
from pipeserve.hicache.assemble import page_layouts
from pipeserve.hicache.page import PageError, decode_page, encode_page
from pipeserve.model.config import ModelConfig
from pipeserve.worker import kv_cache

CPU = torch.device("cpu")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_kv_cache_dtype_is_validated(llama_dir: Path):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(model=str(llama_dir), kv_cache_dtype="int8")
    assert EngineConfig(model=str(llama_dir), kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"


def test_default_pool_is_what_the_engine_can_use(llama_dir: Path, caplog):
    caplog.set_level(logging.INFO, logger="pipeserve.worker.kv_cache")
    cfg = ModelConfig.from_dir(str(llama_dir), None)
    config = EngineConfig(model=str(llama_dir), max_num_seqs=3, block_size=16)
    # 3 requests of 100 tokens: 7 blocks each, far under any memory cap.
    assert kv_cache.num_kv_blocks(config, cfg, 2, 100, CPU) == 3 * 7
    assert "capped" not in caplog.text
    explicit = EngineConfig(model=str(llama_dir), max_num_seqs=3, num_kv_blocks=50)
    assert kv_cache.num_kv_blocks(explicit, cfg, 2, 100, CPU) == 50


def test_memory_cap_binds_and_says_so(llama_dir: Path, caplog):
    caplog.set_level(logging.INFO, logger="pipeserve.worker.kv_cache")
    cfg = ModelConfig.from_dir(str(llama_dir), None)
    fraction = 0.01
    config = EngineConfig(model=str(llama_dir), max_num_seqs=10**7, kv_cache_memory_fraction=fraction)
    per_block = kv_cache.block_bytes(cfg, 2, config.block_size)
    available = kv_cache.available_memory_bytes(CPU)
    blocks = kv_cache.num_kv_blocks(config, cfg, 2, 512, CPU)
    wanted = 10**7 * 512 // config.block_size
    assert blocks < wanted
    # MemAvailable moves between the two reads: within 10 % of the cap.
    assert 0.9 * fraction * available <= blocks * per_block <= 1.1 * fraction * available
    (line,) = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert f"{blocks * config.block_size} tokens" in line and f"wanted {wanted * config.block_size}" in line


def test_16bit_kv_halves_the_pool_and_sizing_counts_it(llama_dir: Path):
    cfg = ModelConfig.from_dir(str(llama_dir), None)
    assert cfg.dtype == torch.float32
    gb = 300 * kv_cache.block_bytes(cfg, 2, 16) / (1 << 30)  # 300 float32 blocks
    fp32 = EngineConfig(model=str(llama_dir), kv_cache_gb=gb)
    fp16 = EngineConfig(model=str(llama_dir), kv_cache_gb=gb, kv_cache_dtype="float16")
    assert kv_cache.kv_dtype(fp32, cfg) == torch.float32 and kv_cache.kv_dtype(fp16, cfg) == torch.float16
    # auto under a quantized float32 model: float16 (llama.cpp's default cache); explicit wins
    for q in ("int8", "int4"):
        auto = EngineConfig(model=str(llama_dir), quantization=q)
        assert kv_cache.kv_dtype(auto, cfg) == torch.float16
        explicit = EngineConfig(model=str(llama_dir), quantization=q, kv_cache_dtype="float32")
        assert kv_cache.kv_dtype(explicit, cfg) == torch.float32
    # The same budget holds twice the blocks in 16 bits.
    assert kv_cache.num_kv_blocks(fp32, cfg, 2, 64, CPU) == 300
    assert kv_cache.num_kv_blocks(fp16, cfg, 2, 64, CPU) == 600


def test_cpu_pool_reads_zero_and_is_resident_only_once_written(llama_dir: Path):
    cfg = ModelConfig.from_dir(str(llama_dir), None)
    per_block = kv_cache.block_bytes(cfg, 4, 16)
    blocks = (512 << 20) // per_block
    before = _rss_bytes()
    pool = kv_cache.allocate_pool(cfg, 4, blocks, 16, CPU)
    assert pool.nbytes >= 500 << 20 and pool.shape[2] == blocks
    assert _rss_bytes() - before < 64 << 20  # not zero-filled by us: the OS's zero pages
    assert not pool[:, :, :: max(1, blocks // 64)].any() and not pool[:, :, -1].any()
    pool[:, :, 3].fill_(1.5)
    assert pool[:, :, 3].eq(1.5).all() and not pool[:, :, 2].any()


def test_a_16bit_page_is_never_read_into_a_32bit_pool(llama_dir: Path):
    cfg = ModelConfig.from_dir(str(llama_dir), None)
    split = [(0, cfg.num_layers)]
    (l32,) = page_layouts("fp", split, cfg, 16)
    (l16,) = page_layouts("fp", split, cfg, 16, torch.float16)
    assert l32.dtype == torch.float32 and l16.dtype == torch.float16
    assert l32.key(7) != l16.key(7)  # another key: a 32-bit pool never even asks for it
    page = torch.randn(l16.shape).to(torch.float16)
    value = encode_page(l16, page, 16)
    assert torch.equal(decode_page(l16, value)[0], page)
    with pytest.raises(PageError) as e:
        decode_page(l32, value)
    assert e.value.kind == "layout"


# Measured on the demo llama (random weights, so near-ties are common; 12 prompts x 24 greedy tokens,
# docs/memory.md): float16 KV identical on 10/12 prompts, |dlogprob| <= 0.004 before the first differing
# token; bfloat16 6/12, <= 0.034. Every divergence is at a near-tie: the 16-bit pick is float32's second
# choice within that margin. Bounds: (share of prompts identical, max |dlogprob| and tie margin).
TOLERANCE = {"float16": (2 / 3, 0.02), "bfloat16": (1 / 3, 0.1)}


@pytest.mark.slow
def test_16bit_kv_greedy_stays_within_tolerance(llama_dir: Path):
    g = torch.Generator().manual_seed(0)
    vocab = ModelConfig.from_dir(str(llama_dir), None).vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in range(5, 65, 5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    outs, pool_bytes = {}, {}
    for dtype in ("float32", "float16", "bfloat16"):
        with LLM(str(llama_dir), kv_cache_dtype=dtype, num_kv_blocks=64, max_model_len=256) as llm:
            pool_bytes[dtype] = llm.engine.executor.runner.kv_pool.nbytes
            assert llm.engine.executor.runner.kv_pool.dtype == getattr(torch, dtype)
            outs[dtype] = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert pool_bytes["float16"] * 2 == pool_bytes["bfloat16"] * 2 == pool_bytes["float32"]
    for dtype, (share, margin) in TOLERANCE.items():
        same, worst = 0, 0.0
        for ref, got in zip(outs["float32"], outs[dtype], strict=True):
            a, b = ref.token_ids, got.token_ids
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            assert ref.logprobs and got.logprobs
            worst = max([worst] + [abs(ref.logprobs[i][0] - got.logprobs[i][0]) for i in range(n)])
            if n == len(a):
                same += 1
                continue
            top = dict(ref.logprobs[n][1] or [])  # float32's two best at the first differing step
            assert b[n] in top and top[a[n]] - top[b[n]] <= margin, (dtype, n, top, b[n])
        assert same >= share * len(prompts), (dtype, same)
        assert worst <= margin, (dtype, worst)
