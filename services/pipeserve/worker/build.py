"""build_runner: one stage's ModelRunner, assembled in one place with everything it uses.

The caller has loaded the stage's model slice and agreed the pool's block count with the group
(stage/assemble.py `build_stage`; ring/replay.py for a flight dump's replay). Here the KV pool is
allocated (kv_cache.py) and the runner built with its last-stage matchers, HiCache tiers and
fault hook as constructor arguments: nothing is set on a runner after it is built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeserve.engine.grammar import GrammarBook
from pipeserve.engine.plan import ScheduledChunk
from pipeserve.model.stage_model import StageModel
from pipeserve.worker.cache_moves import CacheMoves
from pipeserve.worker.grammar import GrammarRows
from pipeserve.worker.kv_cache import allocate_pool
from pipeserve.worker.model_runner import ModelRunner


def build_runner(
    model: StageModel,
    num_blocks: int,
    block_size: int,
    seed: int,
    device: torch.device,
    *,
    kv_dtype: torch.dtype | None = None,
    grammar_book: GrammarBook | None = None,
    tiers: CacheMoves | None = None,
    request_check: Callable[[ScheduledChunk], str | None] | None = None,
) -> ModelRunner:
    """The stage's runner over a fresh pool of `num_blocks` blocks in `kv_dtype` (default: the
    model's). The last stage masks structured outputs with matchers compiled by `grammar_book`
    (None: no matchers); `tiers` and `request_check` as ModelRunner takes them."""
    spec = model.stage
    pool = allocate_pool(model.cfg, spec.num_layers, num_blocks, block_size, device, kv_dtype)
    grammar = GrammarRows(grammar_book) if spec.is_last and grammar_book is not None else None
    return ModelRunner(
        model,
        pool,
        block_size,
        seed,
        spec.rank,
        grammar=grammar,
        tiers=tiers,
        request_check=request_check,
    )
