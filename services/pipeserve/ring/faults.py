"""Fault injection for tests: break one rule on purpose and watch the group react.

Read once per stage from PIPESERVE_FAULTS (JSON for the Faults struct below);
unset means no faults. Each fault names the rule it breaks so a test can show
the check it pins going red:

  corrupt            plans with tokens that stage `corrupt_rank` sends from step
                     `corrupt_step` on are altered: "digest" (a token changed, digest kept),
                     "block_range" (a block id past the pool, resealed),
                     "unknown_request" (a chunk for an id nobody knows, resealed),
                     "rows" (one activation row dropped), "report_digest"
                     (the plan is intact but the stage reports another digest)
  blocking_io        the naive transport: a stage receives only when its loop
                     asks and waits for each send to complete before going on
                     (breaks rules 1 and 2 of transport.py)
  return_first       stage 0 waits on the return link before sending the plan it
                     owes (breaks rule 3)
  no_deadline        waits use an hour instead of ring_timeout_s (breaks rule 4)
  no_heartbeat       an idle stage 0 sends no heartbeats (breaks rule 4's idle clause:
                     an idle group then stops on its own deadlines)
  fail_token         stage `fail_rank` fails every request whose chunk holds this token id
                     (a request's own failure: the group must keep serving, DESIGN §2.5)
  crash_token        stage `crash_rank` raises an unexpected error when a chunk holds this
                     token id (a poison request that kills its group: the router must not
                     carry it to another group)
  l3_delay_ms        stage `l3_delay_rank` fetches every L3 load this much later (a slow Redis
                     for one stage: its answer must be "late" and the group must recompute)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec
import torch

from pipeserve import env as pipeserve_env
from pipeserve.engine.plan import ScheduledChunk, StageReport, StepPlan, seal
from pipeserve.errors import ConfigError

ENV = pipeserve_env.FAULTS
Corruption = Literal["digest", "block_range", "unknown_request", "rows", "report_digest"]


class Faults(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    corrupt: Corruption | None = None
    corrupt_rank: int = 0
    corrupt_step: int = 3
    blocking_io: bool = False
    return_first: bool = False
    no_deadline: bool = False
    no_heartbeat: bool = False
    fail_token: int | None = None
    fail_rank: int = 0
    crash_token: int | None = None
    crash_rank: int = 0
    l3_delay_ms: int = 0
    l3_delay_rank: int = 0

    @classmethod
    def from_env(cls) -> Faults:
        text = pipeserve_env.get(ENV)
        if not text:
            return cls()
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{ENV}: {e}") from None

    def request_check(self, rank: int) -> Callable[[ScheduledChunk], str | None] | None:
        """The ModelRunner's per-chunk hook for stage `rank`, or None when no request fault applies."""
        fail = self.fail_token if self.fail_rank == rank else None
        crash = self.crash_token if self.crash_rank == rank else None
        if fail is None and crash is None:
            return None

        def check(chunk: ScheduledChunk) -> str | None:
            if crash is not None and crash in chunk.token_ids:
                raise RuntimeError(f"injected crash on token {crash}")
            if fail is not None and fail in chunk.token_ids:
                return f"injected failure on token {fail}"
            return None

        return check

    def l3_delay_s(self, rank: int) -> float:
        return self.l3_delay_ms / 1000 if rank == self.l3_delay_rank else 0.0

    def corrupts(self, rank: int, plan: StepPlan) -> bool:
        return (
            self.corrupt is not None
            and rank == self.corrupt_rank
            and plan.step_id >= self.corrupt_step
            and bool(plan.chunks)
        )

    def outgoing(
        self, rank: int, plan: StepPlan, acts: torch.Tensor | None, num_blocks: int
    ) -> tuple[StepPlan, torch.Tensor | None]:
        """What stage `rank` sends on for `plan`: unchanged unless this stage corrupts it."""
        if not self.corrupts(rank, plan):
            return plan, acts
        return self.corrupt_plan(plan, num_blocks), None if acts is None else self.corrupt_rows(acts)

    def corrupt_plan(self, plan: StepPlan, num_blocks: int) -> StepPlan:
        """The plan as the corrupting stage sends it (activations: see corrupt_rows)."""
        if not plan.chunks or self.corrupt in ("rows", "report_digest"):
            return plan
        first = plan.chunks[0]
        if self.corrupt == "digest":
            changed = msgspec.structs.replace(first, token_ids=[t + 1 for t in first.token_ids])
            return msgspec.structs.replace(plan, chunks=[changed, *plan.chunks[1:]])
        if self.corrupt == "block_range":
            changed = msgspec.structs.replace(first, new_block_ids=[*first.new_block_ids, num_blocks + 7])
        else:
            changed = msgspec.structs.replace(first, req_id=first.req_id + "-corrupt")
        return seal(msgspec.structs.replace(plan, chunks=[changed, *plan.chunks[1:]]))

    def corrupt_rows(self, acts: torch.Tensor) -> torch.Tensor:
        return acts[:-1] if self.corrupt == "rows" else acts

    def corrupt_report(self, report: StageReport) -> StageReport:
        if self.corrupt != "report_digest":
            return report
        return msgspec.structs.replace(report, digest=report.digest ^ 1)
