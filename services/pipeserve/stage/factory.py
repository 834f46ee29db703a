"""build_engine: stage 0's engine with its executor — in-process for one stage, the ring for several.

The engine (engine/) knows only the Executor protocol; this is where stage 0's
stage is built (weights, pool, group joined: ring/build.py) and the executor
chosen: LocalExecutor (worker/local.py) when the group has one stage, else a
PipelineExecutor whose ring is formed and warmed before the engine is returned.
`stage_tiers` finds stage 0's HiCache tiers behind either, for its metrics.
"""

from __future__ import annotations

from pipeserve.config import EngineConfig
from pipeserve.engine.engine import LLMEngine
from pipeserve.engine.executor import Executor
from pipeserve.errors import ConfigError
from pipeserve.hicache.assemble import build_directory
from pipeserve.hicache.stage_tiers import StageTiers
from pipeserve.ring.build import build_stage
from pipeserve.ring.group import Rendezvous
from pipeserve.ring.leader import PipelineExecutor
from pipeserve.worker.local import LocalExecutor


def build_engine(config: EngineConfig, rendezvous: Rendezvous | None = None) -> LLMEngine:
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
    return LLMEngine(
        config,
        stage.model_config,
        stage.max_model_len,
        executor,
        grammar_book=stage.grammar_book,
        host_slots=stage.host_slots,
        l3=build_directory(config, stage.layouts),
    )


def stage_tiers(executor: Executor) -> StageTiers | None:
    """Stage 0's HiCache tiers behind an executor build_engine made (None: no HiCache)."""
    tiers = executor.runner.tiers if isinstance(executor, LocalExecutor | PipelineExecutor) else None
    return tiers if isinstance(tiers, StageTiers) else None
