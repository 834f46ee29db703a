"""Stage 0's scheduler with several plans in a pipeline's ring (no model: plans only).

The ring runs at the pace of its largest microbatch, so a plan's token budget
is an equal share of the round's work, counting the plans already in flight;
a prompt's chunks may be in several plans at once, but a request whose chunk
samples is not scheduled again before its token is back.
"""

from __future__ import annotations

from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.plan import SampledToken, StepOutput, StepPlan
from pipeserve.engine.request import Request
from pipeserve.engine.scheduler import Scheduler
from pipeserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)


def scheduler(max_inflight: int) -> Scheduler:
    return Scheduler(BlockManager(512, 16), 64, 512, 1024, (), max_inflight)


def complete(s: Scheduler, plan: StepPlan) -> None:
    sampled = [SampledToken(c.req_id, 7) for c in plan.chunks if c.sample_index >= 0]
    s.update(plan, StepOutput(plan.step_id, sampled, []))


def decoding(s: Scheduler, n: int) -> list[Request]:
    """n requests past their prompt, none in flight."""
    reqs = [Request(f"d{i}", [1, 2, 3, 4], PARAMS) for i in range(n)]
    for r in reqs:
        s.add(r)
    while any(not r.output_token_ids for r in reqs):
        plans = [s.schedule() for _ in range(s.max_inflight)]
        for p in plans:
            complete(s, p)
    return reqs


def test_plans_in_the_ring_share_the_round_evenly() -> None:
    s = scheduler(max_inflight=2)
    decoding(s, 8)
    s.add(Request("long", list(range(300)), PARAMS))
    first = s.schedule()  # 8 decodes + the first part of the prompt
    second = s.schedule()  # while `first` is in the ring: the rest of the prompt
    assert {c.req_id for c in first.chunks} >= {f"d{i}" for i in range(8)}
    assert [c.req_id for c in second.chunks] == ["long"]
    assert abs(first.num_tokens - second.num_tokens) <= 1, (first.num_tokens, second.num_tokens)
    assert first.num_tokens + second.num_tokens == 308


def test_prompt_chunks_pipeline_but_a_sampling_chunk_waits_for_its_token() -> None:
    s = scheduler(max_inflight=3)
    s.add(Request("p", list(range(90)), PARAMS))
    plans = [s.schedule() for _ in range(3)]
    chunks = [c for p in plans for c in p.chunks]
    assert [c.start_pos for c in chunks] == [0, 30, 60]  # one prompt over three plans in the ring
    assert [c.sample_index for c in chunks] == [-1, -1, 0]  # only the last chunk samples
    assert s.schedule().is_empty()  # its token is not back yet: nothing to schedule
    for p in plans:
        complete(s, p)
    nxt = s.schedule()
    assert [(c.req_id, c.start_pos, c.sample_index) for c in nxt.chunks] == [("p", 90, 1)]


def test_one_stage_takes_the_whole_budget() -> None:
    s = scheduler(max_inflight=1)
    decoding(s, 8)
    s.add(Request("long", list(range(300)), PARAMS))
    assert s.schedule().num_tokens == 308
