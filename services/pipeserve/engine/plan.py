"""StepPlan and StepOutput: the only messages between the deciding side (engine/: stage 0's
scheduler) and the executing side (worker/: every stage's model runner, in-process or round the
ring).

A plan is complete: an executor needs nothing but the plan and its own KV pool
to run the step. Serialized with msgspec (MessagePack) — never pickle. The
digest is computed over the encoded plan with `digest` zeroed, so every stage
can recompute it from what it executed.

Order an executor applies a plan in: `freed` (drop per-request state), then
`new_requests`, then the cache moves (HiCache, DESIGN.md section 5) — read
`l3_stores` and `l2_saves` out of L1, write the saves into L2, copy
`l2_loads` into L1, start the `l3_loads` and finish the ones that arrived —
then `chunks` (append `new_block_ids` to the request's block table, write the
chunk's KV, sample if `sample_index >= 0`). Reading every block out before
writing any lets one plan evict a block and reuse it, or save into an L2 slot
another request is loaded from.
"""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash
from msgspec import UNSET, UnsetType

from pipeserve.sampling_fields import FIELDS, PENALTIES, STAGE_DERIVED, STAGE_FIELDS

# A sampling field's type on a plan where it differs from SamplingParams': logit_bias as pairs sorted by
# token id (one encoding, so one digest, on every stage).
ON_PLAN = {dict[int, float]: list[tuple[int, float]]}


def _plan_field(name: str) -> tuple[str, Any, Any]:
    f = FIELDS[name]
    return name, ON_PLAN.get(f.type, f.type), [] if isinstance(f.default, tuple | dict) else f.default


# The stage fields of the one declaration (sampling_fields.py), in its order (array_like: the order is
# the encoding), then what stage 0 derives: EOS (unless ignore_eos) + stop_token_ids, masked until
# min_tokens. Made here, never written out: a field added to the declaration travels without an edit.
_SpecFields = msgspec.defstruct(
    "SamplingSpecFields",
    [*map(_plan_field, STAGE_FIELDS), ("min_tokens_stop_ids", list[int], [])],
    array_like=True,
    frozen=True,
    module=__name__,
)
assert _SpecFields.__struct_fields__[len(STAGE_FIELDS) :] == STAGE_DERIVED


class SamplingSpec(_SpecFields):  # type: ignore[misc,valid-type]
    """What a stage's sampler needs of a request; built by name (engine/request.py `sampling_spec`)."""


class NewRequest(msgspec.Struct, array_like=True, frozen=True):
    """A request entering the executors' tables (first schedule, or resume after preemption)."""

    req_id: str
    sampling: SamplingSpec
    # A constrained request's output tokens so far: the last stage replays them into a fresh
    # grammar matcher at every admission (empty for unconstrained requests).
    replay: list[int] = []
    # The tokens before its first chunk (a prefix-cache hit), only when its penalties need the
    # token history (penalties.needs_history): the last stage rebuilds that history from them.
    history: list[int] = []


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
    # prompt_logprobs (engine/prompt_logprobs.py): the chunk's first `score_rows` rows score the
    # prompt token after them (token_ids[1:], then `score_next`, the next chunk's first token:
    # stage 0 names it, the last stage has only this chunk). The scored positions start at start_pos + 1.
    score_rows: int = 0
    score_next: int = -1


class BlockCopy(msgspec.Struct, array_like=True, frozen=True):
    """An L1 block and an L2 slot (host memory): a save copies block -> slot, a load slot -> block."""

    block_id: int
    slot: int


class PageStore(msgspec.Struct, array_like=True, frozen=True):
    """Write this stage's page of a full, hashed L1 block to L3 (asynchronously, may be dropped)."""

    block_id: int
    block_hash: int


class LoadOrder(msgspec.Struct, array_like=True, frozen=True):
    """Load this stage's pages of `block_hashes` from L3 into the L1 blocks `block_ids` (stage 0
    holds them for the load), within `deadline_ms` of receiving the order; answer with a LoadAck."""

    load_id: int
    block_ids: list[int]
    block_hashes: list[int]
    deadline_ms: int


class StepPlan(msgspec.Struct, frozen=True):
    step_id: int
    freed: list[str]
    new_requests: list[NewRequest]
    chunks: list[ScheduledChunk]
    l2_saves: list[BlockCopy] = []
    l2_loads: list[BlockCopy] = []
    l3_stores: list[PageStore] = []
    l3_loads: list[LoadOrder] = []
    # Nothing to compute, but L3 loads await acks: the plan carries the stages' answers back.
    poll: bool = False
    digest: int = 0
    # Tracing (ring/plan_trace.py): req id -> W3C traceparent of stage 0's span, for each request of
    # `new_requests` that is sampled; followers parent their plan spans to it. UNSET (never encoded)
    # when none is: plans without tracing keep their bytes and digests.
    traces: dict[str, str] | UnsetType = UNSET

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    def is_empty(self) -> bool:
        return not (
            self.chunks
            or self.freed
            or self.l2_saves
            or self.l2_loads
            or self.l3_stores
            or self.l3_loads
            or self.poll
        )


class SampledToken(msgspec.Struct, array_like=True, frozen=True):
    req_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    grammar_end: bool = False  # the request's grammar terminated with this token: it finishes (stop)


class RequestFailure(msgspec.Struct, array_like=True, frozen=True):
    """One request failed on one stage (sampling, logprobs, ...): the request's failure, not the group's.

    The stage still computes the request's rows of the plan (a batch in flight is never
    amended); stage 0 finishes the request with this reason and frees it with the next plan.
    """

    req_id: str
    reason: str


class LoadAck(msgspec.Struct, array_like=True, frozen=True):
    """One stage's answer to a LoadOrder: "ok" (its pages are in the L1 blocks, in time) or why not:
    "late", "missing", "checksum", "layout", "format", "unavailable" (Redis), "disabled" (no L3)."""

    load_id: int
    status: str


class StageReport(msgspec.Struct, array_like=True, frozen=True):
    """What one stage says about a step it executed; travels along the ring to stage 0."""

    rank: int
    digest: int  # of the plan this stage executed
    num_reqs: int  # requests in its tables after the step
    blocks_held: int  # distinct KV blocks those tables reference
    busy_s: float  # cumulative seconds spent executing plans
    wall_s: float  # seconds since the stage executed its first plan
    failed: list[RequestFailure] = []  # requests of this plan that failed on this stage
    loads: list[LoadAck] = []  # L3 loads this stage finished (or gave up) since its last report
    l3_lost: int = 0  # pages this stage could not write to L3 so far (queue full, Redis failed)


class PromptScores(msgspec.Struct, array_like=True, frozen=True):
    """The last stage's scores of one chunk's `score_rows` prompt positions, from `first_pos` on."""

    req_id: str
    first_pos: int
    logprobs: list[float]  # of the prompt token at each position
    ranks: list[int]  # 1 + tokens more probable there
    top: list[list[tuple[int, float]]]  # the top k (token id, logprob), k = prompt_logprobs


class StepOutput(msgspec.Struct, frozen=True):
    step_id: int
    sampled: list[SampledToken]
    reports: list[StageReport]  # one per stage, in rank order
    prompt_scores: list[PromptScores] = []  # the chunks that asked (ScheduledChunk.score_rows)


_encoder = msgspec.msgpack.Encoder()


def plan_digest(plan: StepPlan) -> int:
    return xxhash.xxh3_64_intdigest(_encoder.encode(msgspec.structs.replace(plan, digest=0)))


def seal(plan: StepPlan) -> StepPlan:
    """Return the plan with its digest filled in."""
    return msgspec.structs.replace(plan, digest=plan_digest(plan))


def needs_history(spec: SamplingSpec) -> bool:
    """Whether the spec's penalties read the request's tokens: stage 0 then sends the tokens before
    a request's first chunk (NewRequest.history) and the last stage keeps its token history
    (worker/penalties.py)."""
    return any(getattr(spec, name) != FIELDS[name].default for name in PENALTIES)
