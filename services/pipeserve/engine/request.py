"""Request: the one object that tracks a generation on stage 0.

Token layout: all_token_ids = prompt + output. `num_computed` tokens have KV in
`block_ids` (prefix-cache hits included); `num_scheduled` >= num_computed
tokens are in plans (computed or in flight), and the scheduler's next chunk
starts there. Prompt chunks can be in flight together in a pipeline (each
stage runs plans in order, so chunk k's KV is written before chunk k+1 reads
it); a chunk that samples is the last one in flight until its token returns.
After preemption the request goes back to WAITING with no blocks and
recomputes prompt + output so far (the output is kept).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, get_args

from pipeserve.engine.plan import ON_PLAN, SamplingSpec
from pipeserve.sampling_fields import FIELDS, STAGE_FIELDS
from pipeserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Fetch(enum.Enum):
    """Where a waiting request stands with L3 (engine/prefix_loads.py)."""

    NONE = "none"  # not asked yet
    PROBING = "probing"  # stage 0 asked L3 which blocks it holds; not admitted meanwhile
    PROBED = "probed"  # L3 holds blocks up to `l3_end`: the next admission orders the load
    LOADING = "loading"  # the stages are loading; not admitted meanwhile
    DONE = "done"  # nothing (more) to get from L3: admitted as usual (what it loaded is in L1 now)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"  # the request failed (on any stage); `Request.error` says why


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_scheduled: int = 0
    num_inflight: int = 0  # unfinished plans holding a chunk of this request
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at the last admission
    # Leading full blocks the L3 write policy has seen of this request: kept across a preemption, so
    # its own recomputation (or hit on its own freed blocks) is not a second sighting.
    l3_sighted_blocks: int = 0
    # ... of which from each tier: {"l1": tokens, "l2": tokens, "l3": tokens}
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    fetch: Fetch = Fetch.NONE
    l3_end: int = 0  # PROBED: L3 holds this request's blocks up to (not including) this index
    # Block index -> "l2" / "l3": where the blocks an L3 load brought into L1 (with the L2 copies
    # that came with it) came from, so the admission after the load credits the right tier.
    fetched: dict[int, str] = field(default_factory=dict)
    num_preemptions: int = 0
    # Executors hold this request in their tables (it was sent as a NewRequest
    # and not freed since). Preemption and finish clear it via plan.freed.
    in_executors: bool = False
    error: str | None = None  # why the request failed (finish_reason ERROR)
    traceparent: str | None = None  # W3C context of a sampled request's span: sent in its NewRequest
    # prompt_logprobs: (logprob, rank, top k) of prompt positions 1.. (engine/prompt_logprobs.py)
    prompt_scores: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (decode reads one token)."""
        np_ = len(self.prompt_token_ids)
        if start >= np_:
            return self.output_token_ids[start - np_ : end - np_]
        if end <= np_:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - np_]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def sampling_spec(req: Request, eos_token_ids: frozenset[int] = frozenset()) -> SamplingSpec:
    """What the stages' samplers get of a request (its NewRequest in a plan): every stage field of
    the field list by name, then what stage 0 derives."""
    p = req.params
    stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))
    values = {name: on_plan(name, getattr(p, name)) for name in STAGE_FIELDS}
    return SamplingSpec(**values, min_tokens_stop_ids=stop_ids if p.min_tokens > 0 else [])


def on_plan(name: str, value: Any) -> Any:
    """A field's value with its exact type on the plan: the digest covers the encoding, and followers
    re-encode what they decoded (an int 0 for a float field would hash differently on the next stage)."""
    typ = FIELDS[name].type
    if value is None:
        return None
    if typ in ON_PLAN:  # logit_bias: (token id, bias) pairs sorted by token id
        return [(int(t), float(b)) for t, b in sorted(value.items())]
    exact = next(a for a in get_args(typ) or (typ,) if a is not type(None))
    return exact(value)
