"""A stage as the ring sees it, and its link into the ring.

The stage process is assembled above the ring (stage/assemble.py: model, pool, runner, tiers);
the ring's executors (leader.py, follower.py) and the flight recorder (replay.py) read only what
`RingStage` names, so ring/ imports nothing of the stage process (tests/test_import_graph.py).

`join_ring` is the ring's share of a stage's start: join the group's process groups, exchange
identities (the congruence check, group.py) and open the link to the neighbours. It runs after
the stage loaded its weights and sized its pool, so the identities describe what it holds.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pipeserve.config import EngineConfig
from pipeserve.hicache.stage_tiers import StageTiers
from pipeserve.model.config import ModelConfig
from pipeserve.model.stage_model import StageSpec
from pipeserve.ring.faults import Faults
from pipeserve.ring.group import Rendezvous, StageIdentity, activation_group, agree, join
from pipeserve.ring.transport import RingLink
from pipeserve.worker.model_runner import ModelRunner


class RingStage(Protocol):
    """What one stage of a group holds once the group has formed (read-only here)."""

    @property
    def config(self) -> EngineConfig: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def spec(self) -> StageSpec: ...
    @property
    def split(self) -> list[tuple[int, int]]: ...  # every stage's layer range, rank order
    @property
    def runner(self) -> ModelRunner: ...
    @property
    def link(self) -> RingLink | None: ...  # None when the group has one stage
    @property
    def faults(self) -> Faults: ...
    @property
    def tiers(self) -> StageTiers | None: ...  # this stage's HiCache tiers (closed last)
    @property
    def host_slots(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...


def join_ring(
    rdzv: Rendezvous,
    config: EngineConfig,
    identity: StageIdentity,
    dtype: torch.dtype,
    device: torch.device,
    faults: Faults,
) -> tuple[RingLink, list[StageIdentity]]:
    """Join the group, agree on its identities (every stage's, rank order) and open the ring link.
    Every wait is under config.connect_timeout_s; the link's own under config.ring_timeout_s."""
    meta_pg, store = join(rdzv, config.connect_timeout_s)
    ids = agree(meta_pg, identity, config.stages, config.connect_timeout_s)
    gpus = [i.gpu for i in ids]
    data_pg = activation_group(rdzv, store, meta_pg, gpus, config.connect_timeout_s)
    link = RingLink(rdzv.rank, config.stages, meta_pg, data_pg, dtype, device, config.ring_timeout_s, faults)
    return link, ids
