"""What a runner asks of a stage's HiCache tiers (hicache/stage_tiers.py implements it), and the
answer of a stage without them."""

from __future__ import annotations

from typing import Protocol

import torch

from pipeserve.engine.executor import refuse_l2_moves
from pipeserve.engine.plan import LoadAck, StepPlan


class CacheMoves(Protocol):
    """A stage's HiCache tiers: apply a plan's block moves to the pool, answer its L3 loads."""

    def execute(self, plan: StepPlan, pool: torch.Tensor) -> list[LoadAck]: ...

    @property
    def lost_pages(self) -> int:
        """Pages this stage could not write to L3 so far."""
        ...

    def close(self) -> None: ...


def no_tiers(plan: StepPlan) -> list[LoadAck]:
    """A stage without HiCache: L3 loads are answered "disabled"; an L2 move is a divergence."""
    refuse_l2_moves(plan)
    return [LoadAck(o.load_id, "disabled") for o in plan.l3_loads]
