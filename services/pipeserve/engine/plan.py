"""StepPlan and StepOutput: the only messages between the deciding scheduler
(stage 0) and the executors (its own model runner, and later the follower
stages).

A plan is complete: an executor needs nothing but the plan and its own KV pool
to run the step. Serialized with msgspec (MessagePack) — never pickle. The
digest is computed over the encoded plan with `digest` zeroed, so every stage
can recompute it from what it executed.

Order an executor applies a plan in: `freed` (drop per-request state), then
`new_requests`, then `chunks` (append `new_block_ids` to the request's block
table, write the chunk's KV, sample if `sample_index >= 0`).
"""

from __future__ import annotations

import msgspec
import xxhash


class SamplingSpec(msgspec.Struct, array_like=True, frozen=True):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    logprobs: int | None


class NewRequest(msgspec.Struct, array_like=True, frozen=True):
    """A request entering the executors' tables (first schedule, or resume after preemption)."""

    req_id: str
    sampling: SamplingSpec


class ScheduledChunk(msgspec.Struct, array_like=True, frozen=True):
    """One request's share of a step: tokens at positions [start_pos, start_pos+len(token_ids))."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    # Index of the output token this step produces (its count so far), or -1 when
    # the chunk ends mid-prompt and nothing is sampled. Seeds are derived from it,
    # so sampling does not depend on batch mix or preemption.
    sample_index: int


class StepPlan(msgspec.Struct, frozen=True):
    step_id: int
    freed: list[str]
    new_requests: list[NewRequest]
    chunks: list[ScheduledChunk]
    digest: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    def is_empty(self) -> bool:
        return not (self.chunks or self.freed)


class SampledToken(msgspec.Struct, array_like=True, frozen=True):
    req_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class RequestFailure(msgspec.Struct, array_like=True, frozen=True):
    """One request failed on one stage (sampling, logprobs, ...): the request's failure, not the group's.

    The stage still computes the request's rows of the plan (a batch in flight is never
    amended); stage 0 finishes the request with this reason and frees it with the next plan.
    """

    req_id: str
    reason: str


class StageReport(msgspec.Struct, array_like=True, frozen=True):
    """What one stage says about a step it executed; travels along the ring to stage 0."""

    rank: int
    digest: int  # of the plan this stage executed
    num_reqs: int  # requests in its tables after the step
    blocks_held: int  # distinct KV blocks those tables reference
    busy_s: float  # cumulative seconds spent executing plans
    wall_s: float  # seconds since the stage executed its first plan
    failed: list[RequestFailure] = []  # requests of this plan that failed on this stage


class StepOutput(msgspec.Struct, frozen=True):
    step_id: int
    sampled: list[SampledToken]
    reports: list[StageReport]  # one per stage, in rank order


_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)


def plan_digest(plan: StepPlan) -> int:
    return xxhash.xxh3_64_intdigest(_encoder.encode(msgspec.structs.replace(plan, digest=0)))


def seal(plan: StepPlan) -> StepPlan:
    """Return the plan with its digest filled in."""
    return msgspec.structs.replace(plan, digest=plan_digest(plan))


def encode_plan(plan: StepPlan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)
