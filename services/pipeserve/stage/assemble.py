"""A stage assembled in one place from its EngineConfig: model slice, KV pool, HiCache tiers,
runner, ring link (`build_stage`), and on stage 0 the engine with its executor (`build_leader`).

Order matters for congruence: a stage loads its weights and sizes its pool
*before* it joins the group, so the identities compared at start-up describe
what each stage really holds; the pool is then allocated with the group's
agreed block count, never with a stage's own proposal. The runner itself is
built whole by worker/build.py (nothing is set on it afterwards).

The engine (engine/) knows only the Executor protocol: `build_leader` chooses it —
LocalExecutor (worker/local.py) when the group has one stage, else a PipelineExecutor
(ring/leader.py) whose ring is formed and warmed before the engine is returned — and
hands back stage 0's HiCache tiers beside the engine, for its metrics (nobody reaches
through an executor for them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.engine import LLMEngine
from pipeserve.engine.executor import Executor
from pipeserve.engine.grammar import GrammarBook
from pipeserve.errors import ConfigError
from pipeserve.hicache.assemble import build_directory, build_stage_tiers, l3_fingerprint, page_layouts
from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.stage_tiers import StageTiers
from pipeserve.model.arch import get_arch
from pipeserve.model.config import ModelConfig
from pipeserve.model.loader import load_stage_model, model_fingerprint
from pipeserve.model.rope import exact_context
from pipeserve.model.stage_model import StageSpec
from pipeserve.ring.faults import Faults
from pipeserve.ring.group import Rendezvous, StageIdentity, group_blocks, group_host_slots
from pipeserve.ring.leader import PipelineExecutor
from pipeserve.ring.member import join_ring
from pipeserve.ring.transport import RingLink
from pipeserve.worker.build import build_runner
from pipeserve.worker.kv_cache import kv_dtype, num_host_slots, num_kv_blocks
from pipeserve.worker.local import LocalExecutor
from pipeserve.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    # A sliding window caps nothing: the paged kernels apply it per layer (layers.AttentionSpec).
    limit = cfg.max_position_embeddings
    exact = exact_context(cfg)
    if exact is not None and exact < limit:
        # longrope: past it transformers rotates the whole sequence anew (model/rope.py).
        log.warning("capping max_model_len at original_max_position_embeddings=%d (longrope)", exact)
        limit = exact
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(f"max_model_len: {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len


def layer_split(config: EngineConfig, cfg: ModelConfig) -> list[tuple[int, int]]:
    """Each stage's layer range: `layer_split` as configured, else the architecture's split."""
    num_layers = cfg.num_layers
    split = config.split_ranges()
    if split is None:
        return get_arch(cfg.model_type).split(num_layers, config.stages)
    if split[-1][1] != num_layers:
        raise ConfigError(
            f"layer_split: {config.layer_split!r} does not cover the model's {num_layers} layers"
        )
    return split


def stage_device(config: EngineConfig, rank: int) -> torch.device:
    """The stage's device, made current when a GPU: `cuda` is the rank's GPU among those visible (a pod
    sees its own one)."""
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        # A configuration error (exit status 2: the operator marks the group Failed), not a crash loop.
        raise ConfigError(f"device: {config.device} but this process sees no CUDA device")
    device = torch.device(config.device)
    if config.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        # Triton launches on the current device and NCCL binds to it: make it this stage's GPU before
        # any weight, kernel or communicator is created (cuda:0 is not this stage's GPU in a local group).
        torch.cuda.set_device(device)
    return device


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Stage:
    """What one stage process holds once its group has formed (ring/member.py's RingStage)."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    spec: StageSpec
    split: list[tuple[int, int]]  # every stage's layer range, rank order
    runner: ModelRunner
    link: RingLink | None  # None when the group has one stage
    faults: Faults
    layouts: list[PageLayout]  # every stage's L3 page layout, rank order
    tiers: StageTiers | None  # this stage's L2 pool and L3 loader/writer (HiCache)
    grammar_book: GrammarBook | None  # stage 0's structured-output checks (None on followers)

    @property
    def host_slots(self) -> int:
        return 0 if self.tiers is None else self.tiers.host_slots

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks


def build_stage(config: EngineConfig, rdzv: Rendezvous | None, faults: Faults | None = None) -> Stage:
    rank = rdzv.rank if rdzv else 0
    if (rdzv.world_size if rdzv else 1) != config.stages:
        raise ConfigError(f"stages: {config.stages} but the rendezvous has {rdzv and rdzv.world_size}")
    faults = faults if faults is not None else Faults.from_env()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    cfg = ModelConfig.from_dir(config.model, config.dtype)
    max_len = resolve_max_model_len(config, cfg)
    split = layer_split(config, cfg)
    spec = StageSpec(rank, config.stages, *split[rank])
    device = stage_device(config, rank)
    model = load_stage_model(
        config.model, cfg, spec, max_len, device, config.quantization, config.quantization_group_size
    )
    blocks = num_kv_blocks(config, cfg, spec.num_layers, max_len, device)
    pool_dtype = kv_dtype(config, cfg)
    host_slots = num_host_slots(config, cfg, spec.num_layers)
    fingerprint = model_fingerprint(
        config.model, cfg.dtype, config.quantization, config.quantization_group_size
    )
    link = None
    if rdzv is not None and config.stages > 1:
        identity = StageIdentity(
            rank,
            fingerprint,
            ",".join(f"{lo}:{hi}" for lo, hi in split),
            config.block_size,
            max_len,
            _dtype_name(cfg.dtype),
            _dtype_name(pool_dtype),
            blocks,
            str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else "",
            host_slots,
            config.l3_url is not None,
        )
        link, ids = join_ring(rdzv, config, identity, cfg.dtype, device, faults)
        blocks, host_slots = group_blocks(ids), group_host_slots(ids)
    layouts = page_layouts(
        l3_fingerprint(fingerprint, split, config.block_size), split, cfg, config.block_size, pool_dtype
    )
    tiers = build_stage_tiers(config, layouts[rank], host_slots, device, faults.l3_delay_s(rank))
    # Structured outputs: stage 0 compiles before admission, the last stage holds the matchers.
    book = GrammarBook(config.model, cfg.vocab_size, cfg.eos_token_ids)
    runner = build_runner(
        model,
        blocks,
        config.block_size,
        config.seed,
        device,
        kv_dtype=pool_dtype,
        grammar_book=book,
        tiers=tiers,
        request_check=faults.request_check(rank),
    )
    _log_ready(config, cfg, spec, blocks, host_slots)
    return Stage(
        config, cfg, max_len, spec, split, runner, link, faults, layouts, tiers, book if rank == 0 else None
    )


def _log_ready(config: EngineConfig, cfg: ModelConfig, spec: StageSpec, blocks: int, host_slots: int) -> None:
    log.info(
        "stage %d/%d ready to join the ring: layers [%d, %d) of %d, %d KV blocks of %d tokens, "
        "L2 %d slots, L3 %s",
        spec.rank,
        config.stages,
        spec.layer_lo,
        spec.layer_hi,
        cfg.num_layers,
        blocks,
        config.block_size,
        host_slots,
        "on" if config.l3_url else "off",
    )


@dataclass
class Leader:
    """Stage 0 assembled: its engine (with the executor inside) and its HiCache tiers (None: none)."""

    engine: LLMEngine
    tiers: StageTiers | None


def build_leader(config: EngineConfig, rendezvous: Rendezvous | None = None) -> Leader:
    if config.stages > 1 and rendezvous is None:
        raise ConfigError("stages: a group of several stages needs a rendezvous (LLM starts one)")
    stage = build_stage(config, rendezvous)
    executor: Executor
    if stage.link is None:
        executor = LocalExecutor(stage.runner)
    else:
        ring = PipelineExecutor(stage)
        ring.form_ring()
        executor = ring
    engine = LLMEngine(
        config,
        stage.model_config,
        stage.max_model_len,
        executor,
        grammar_book=stage.grammar_book,
        host_slots=stage.host_slots,
        l3=build_directory(config, stage.layouts),
    )
    return Leader(engine, stage.tiers)


def build_engine(config: EngineConfig, rendezvous: Rendezvous | None = None) -> LLMEngine:
    """Stage 0's engine alone (the offline LLM): see build_leader."""
    return build_leader(config, rendezvous).engine
