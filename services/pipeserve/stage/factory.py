"""build_engine: stage 0's engine with its executor — in-process for one stage, the ring for several.

The engine (engine/) knows only the Executor protocol; this is where stage 0's
stage is built (weights, pool, group joined: ring/worker.py) and the executor
chosen: LocalExecutor when the group has one stage, else a PipelineExecutor
whose ring is formed and warmed before the engine is returned.
"""

from __future__ import annotations

from pipeserve.config import EngineConfig
from pipeserve.engine.engine import LLMEngine
from pipeserve.engine.executor import Executor, LocalExecutor
from pipeserve.errors import ConfigError
from pipeserve.hicache.assemble import build_directory
from pipeserve.ring.group import Rendezvous
from pipeserve.ring.leader import PipelineExecutor
from pipeserve.ring.worker import build_stage


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
        stage.runner,
        executor,
        host_slots=stage.host_slots,
        l3=build_directory(config, stage.layouts),
    )
