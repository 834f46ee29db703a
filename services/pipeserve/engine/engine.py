"""LLMEngine: stage 0's loop — schedule, execute, update.

`step()` runs one plan through the executor and returns the requests that
finished in it. With one stage the executor is the in-process ModelRunner;
a pipeline group swaps in an executor that sends the plan around the ring.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from pipeserve.config import EngineConfig
from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.kv_cache import allocate_pool, num_kv_blocks
from pipeserve.engine.model_runner import ModelRunner
from pipeserve.engine.request import FinishReason, Request
from pipeserve.engine.scheduler import Scheduler
from pipeserve.errors import ConfigError, InvalidRequestError
from pipeserve.model.config import ModelConfig
from pipeserve.model.loader import balanced_layer_split, load_stage_model
from pipeserve.model.stage_model import StageSpec
from pipeserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None and cfg.sliding_window < limit:
        # Attention here is full-context; capping at the window keeps it exact.
        log.warning("capping max_model_len at sliding_window=%d", cfg.sliding_window)
        limit = cfg.sliding_window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(f"max_model_len: {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.stages != 1:
            raise ConfigError("stages: this engine runs one stage; pipeline groups are not built yet")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model, config.dtype)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        device = torch.device(config.device)
        (lo, hi) = balanced_layer_split(self.model_config.num_layers, 1)[0]
        stage = StageSpec(0, 1, lo, hi)
        model = load_stage_model(config.model, self.model_config, stage, self.max_model_len, device)
        blocks = num_kv_blocks(config, self.model_config, stage.num_layers, self.max_model_len, device)
        pool = allocate_pool(self.model_config, stage.num_layers, blocks, config.block_size, device)
        self.runner = ModelRunner(model, pool, config.block_size, config.seed)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.model_config.eos_token_ids,
        )
        self._ids = itertools.count()
        log.info(
            "engine ready: %s, %d layers, %d KV blocks of %d tokens, max_model_len %d",
            self.model_config.model_type,
            stage.num_layers,
            blocks,
            config.block_size,
            self.max_model_len,
        )

    # --- requests -----------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the bad field; changes nothing."""
        params.validate()
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("prompt", f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(prompt_token_ids)} tokens leave no room to generate within "
                f"the model's context of {self.max_model_len}",
            )

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None
    ) -> Request:
        """Validate and queue a request."""
        self.validate(prompt_token_ids, params)
        req = Request(
            req_id if req_id is not None else f"req-{next(self._ids)}",
            list(prompt_token_ids),
            params,
            arrival=time.monotonic(),
        )
        self.scheduler.add(req)
        return req

    def abort(self, req_id: str) -> Request | None:
        return self.scheduler.abort(req_id)

    def finish(self, req_id: str, reason: FinishReason) -> Request | None:
        return self.scheduler.finish(req_id, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- loop ---------------------------------------------------------------
    def step(self) -> list[Request]:
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return []
        output = self.runner.execute(plan)
        diverged = [i for i, d in enumerate(output.digests) if d != plan.digest]
        if diverged:
            raise RuntimeError(f"step {plan.step_id}: stages {diverged} executed a different plan")
        return self.scheduler.update(plan, output)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks
