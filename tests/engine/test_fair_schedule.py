"""Fair shares of a step (engine/fairness.py), on stage 0's scheduler alone (no model: plans only).

A long prompt — scored or not — never holds the batch: its chunks fit the step pace, scored rows
count against the budget, and a request arriving meanwhile gets its prompt and its decodes in
the very next plans. A fan-out (n=128 siblings of one response) cannot keep an unrelated request
from a seat: admission is round-robin by family, and a family short of seats takes one from the
largest by preemption.
"""

from __future__ import annotations

import time
from itertools import pairwise

from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.executor import BusyMeter
from pipeserve.engine.fairness import (
    MIN_DECODE_ROWS,
    MIN_PREFILL_TOKENS,
    MIN_PROMPT_CHUNK,
    MIN_SCORE_ROWS,
    StepPace,
    family,
    family_caps,
    share_decodes,
    water_fill,
)
from pipeserve.engine.plan import PromptScores, SampledToken, StageReport, StepOutput, StepPlan
from pipeserve.engine.request import FinishReason, Request
from pipeserve.engine.scheduler import Scheduler
from pipeserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)


def complete(s: Scheduler, plan: StepPlan, busy_s: float = 0.0) -> None:
    """Apply the plan's result; `busy_s` is stage 0's cumulative busy time it reports."""
    sampled = [SampledToken(c.req_id, 7) for c in plan.chunks if c.sample_index >= 0]
    scores = [
        PromptScores(c.req_id, c.start_pos + 1, [0.0] * c.score_rows, [1] * c.score_rows, [[]] * c.score_rows)
        for c in plan.chunks
        if c.score_rows
    ]
    report = StageReport(0, plan.digest, 0, 0, busy_s, busy_s)
    s.update(plan, StepOutput(plan.step_id, sampled, [report], scores))


def paced(target_s: float, s_per_token: float, max_num_seqs: int = 64, blocks: int = 4096) -> Scheduler:
    s = Scheduler(BlockManager(blocks, 16), max_num_seqs, 2048, 8192, (), step_target_s=target_s)
    s.pace.s_per_token = s_per_token
    return s


def test_water_fill_gives_short_prompts_all_they_need_and_splits_the_rest() -> None:
    assert water_fill([4, 1000, 1000], 104) == 50
    assert water_fill([4, 10], 100) == 100
    assert water_fill([500] * 8, 16) == 2
    assert water_fill([500] * 40, 16) == 1  # at least a token each


def test_pace_measures_busy_seconds_per_cost() -> None:
    pace = StepPace(0.25)
    assert pace.prompt_share(0) is not None  # the boot share before any measurement
    R = StageReport
    pace.observe(100, [R(0, 0, 0, 0, 1.0, 1.0), R(1, 0, 0, 0, 2.0, 2.0)])  # first reports: no delta
    pace.observe(100, [R(0, 0, 0, 0, 1.5, 2.0), R(1, 0, 0, 0, 2.5, 3.0)])  # 1 s for 100 across stages
    assert pace.s_per_token == 0.01
    assert pace.prompt_share(5) == 20  # 0.25 s / 0.01 s - 5 decodes
    assert pace.prompt_share(1000) == MIN_PREFILL_TOKENS
    assert StepPace(None).prompt_share(0) is None


def test_a_report_taken_inside_a_step_counts_that_step() -> None:
    """Stage 0's runner reports its busy seconds from inside the engine's own measurement of the
    step: the report must count the plan it reports on, or the pace divides the previous plan's
    seconds by this plan's cost (a 2,048-token plan once followed a measured poll plan)."""
    meter = BusyMeter()
    with meter.measure():  # the engine: scheduling, then the runner
        with meter.measure():  # the runner, whose report is taken in here
            time.sleep(0.05)
            reported = meter.busy_s
    assert reported >= 0.05
    assert meter.busy_s >= reported


def test_many_long_prompts_take_turns_in_chunks_of_at_least_the_floor() -> None:
    """16 long prompts of 16 clients and a 250-unit plan: a max-min split would give each 15 tokens
    a plan, all reaching their first token together at the end. They pool: each chunk cut by the share
    holds at least MIN_PROMPT_CHUNK, the oldest go first, and a short prompt arriving meanwhile
    still gets all it needs in its first plan."""
    s = paced(0.25, 0.001, max_num_seqs=256)  # 250 cost units a plan
    for k in range(16):  # no shared prefix
        s.add(Request(f"cmpl-long{k}-0", list(range(1000 * k + 1, 1000 * k + 1001)), PARAMS))
    firsts: list[str] = []
    for n in range(40):
        if n == 5:
            s.add(Request("cmpl-short-0", list(range(100, 110)), PARAMS))
        plan = s.schedule()
        prompt = [c for c in plan.chunks if c.sample_index < 0]  # cut mid-prompt: nothing sampled
        assert all(len(c.token_ids) >= MIN_PROMPT_CHUNK for c in prompt), [len(c.token_ids) for c in prompt]
        assert len(prompt) <= 250 // MIN_PROMPT_CHUNK
        if n == 5:
            [mine] = [c for c in plan.chunks if c.req_id == "cmpl-short-0"]
            assert len(mine.token_ids) == 10 and mine.sample_index >= 0
        firsts += [c.req_id for c in plan.chunks if c.start_pos == 0 and c.req_id.startswith("cmpl-long")]
        complete(s, plan)
    assert firsts[:3] == ["cmpl-long0-0", "cmpl-long1-0", "cmpl-long2-0"], "the oldest first"
    assert len(firsts) >= 6, "prompts finish and the next ones start"


def test_short_prompts_go_first_when_the_share_is_small() -> None:
    """Scoring at 3k positions made plans dear (the pace at 5 ms a unit: 50 units a plan). Three
    long prompts run; four 10-token prompts arrive: each is computed whole in the next plan,
    before any long prompt's chunk, instead of waiting behind the running ones."""
    s = paced(0.25, 0.005, max_num_seqs=256)
    for k in range(3):
        s.add(Request(f"cmpl-long{k}-0", list(range(1000 * k + 1, 1000 * k + 1001)), PARAMS))
    complete(s, s.schedule())
    for k in range(4):
        s.add(Request(f"cmpl-short{k}-0", list(range(5000 + 10 * k, 5010 + 10 * k)), PARAMS))
    plan = s.schedule()
    short = {c.req_id: c for c in plan.chunks if c.req_id.startswith("cmpl-short")}
    assert len(short) == 4, [c.req_id for c in plan.chunks]
    assert all(len(c.token_ids) == 10 and c.sample_index >= 0 for c in short.values())


def test_a_scored_prompt_is_chunked_within_the_budget_and_others_interleave() -> None:
    s = paced(0.25, 0.001)  # 250 cost units a plan
    s.add(Request("cmpl-long-0", list(range(1, 4001)), SCORED))
    first = s.schedule()
    [c] = first.chunks
    assert len(c.token_ids) + c.score_rows <= 250, "a scored row counts against the step"
    complete(s, first)
    s.add(Request("cmpl-small-0", [1, 2, 3, 4], PARAMS))
    for _ in range(PARAMS.max_tokens or 0):  # the small request's prompt then a decode every plan
        plan = s.schedule()
        ids = [c.req_id for c in plan.chunks]
        assert "cmpl-small-0" in ids and "cmpl-long-0" in ids, ids
        assert plan.num_tokens + sum(c.score_rows for c in plan.chunks) <= 250 + 1
        complete(s, plan)
    assert "cmpl-small-0" not in s.requests, "the small request finished while the scoring ran"
    assert "cmpl-long-0" in s.requests


def test_scoring_rows_start_slow_after_a_pace_measured_on_plain_tokens() -> None:
    # 0.25 s / 0.0002 s: 1,250 units a plan, measured without scoring. A scored row may cost several
    # tokens (lm_head, log_softmax, top-k): the rows start at MIN_SCORE_ROWS and at most double.
    s = paced(0.25, 0.0002)
    for k in range(4):
        s.add(Request(f"cmpl-score{k}-0", list(range(1, 4001)), SCORED))
    rows = []
    for _ in range(8):
        plan = s.schedule()
        rows.append(sum(c.score_rows for c in plan.chunks))
        complete(s, plan)
    assert rows[0] <= MIN_SCORE_ROWS, rows
    assert all(0 < b <= 2 * a for a, b in pairwise(rows)), rows
    assert rows[-1] > 500, f"the rows grow to the pace's share: {rows}"
    s.add(Request("cmpl-plain-0", list(range(1, 1001)), PARAMS))
    for r in list(s.running):
        s.finish(r.req_id, FinishReason.ABORT)
    complete(s, s.schedule())  # a plan without scoring: the next scorer starts slow again
    s.add(Request("cmpl-score9-0", list(range(1, 4001)), SCORED))
    assert sum(c.score_rows for c in s.schedule().chunks) <= MIN_SCORE_ROWS


def test_without_a_pace_the_token_budget_alone_applies() -> None:
    s = Scheduler(BlockManager(4096, 16), 64, 2048, 8192, ())
    s.add(Request("a", list(range(1, 3001)), PARAMS))
    assert s.schedule().num_tokens == 2048


def test_a_fanout_cannot_hold_every_seat() -> None:
    s = paced(10.0, 0.0001, max_num_seqs=32)
    siblings = [Request(f"cmpl-fan-0-{j}", [1, 2, 3, 4], PARAMS) for j in range(128)]
    for r in siblings:
        s.add(r)
    complete(s, s.schedule())
    assert len(s.running) == 32
    s.add(Request("cmpl-other-0", [9, 9, 9], PARAMS))
    plan = s.schedule()
    assert "cmpl-other-0" in [c.req_id for c in plan.chunks], "admitted at once, a sibling preempted"
    assert family("cmpl-fan-0-17") == family("cmpl-fan-1") == "cmpl-fan"


def test_waiting_families_are_admitted_round_robin() -> None:
    s = paced(10.0, 0.0001, max_num_seqs=4)
    for j in range(6):
        s.add(Request(f"cmpl-a-0-{j}", [1, 2, 3], PARAMS))
    s.add(Request("cmpl-b-0", [4, 5, 6], PARAMS))
    plan = s.schedule()
    ids = [c.req_id for c in plan.chunks]
    assert "cmpl-b-0" in ids and len(ids) == 4, ids


def test_a_fanout_decodes_in_turns_and_others_decode_every_plan() -> None:
    # 0.25 s / 0.01 s a row: 25 rows, raised to MIN_DECODE_ROWS (32) a plan.
    s = paced(0.25, 0.01, max_num_seqs=256)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for k in range(100):
        s.add(Request(f"cmpl-fan-0-{k}", [1, 2, 3], params))
    s.add(Request("cmpl-small-0", [4, 5, 6], params))
    for _ in range(50):  # prompts: the pace admits them over the first plans
        if all(r.output_token_ids for r in s.requests.values()):
            break
        complete(s, s.schedule())
    assert all(r.output_token_ids for r in s.requests.values()), "every prompt admitted and computed"
    seen = []
    for _ in range(20):
        plan = s.schedule()
        ids = [c.req_id for c in plan.chunks]
        assert len(ids) <= MIN_DECODE_ROWS, len(ids)
        assert "cmpl-small-0" in ids, "the unrelated request waited a plan behind the fan-out"
        seen.append(ids)
        complete(s, plan)
    made = [len(s.requests[f"cmpl-fan-0-{k}"].output_token_ids) for k in range(100)]
    assert max(made) - min(made) <= 1, "siblings decode in turns, none left behind"
    assert min(made) >= 5, made


def test_share_decodes_splits_rows_max_min_by_family() -> None:
    reqs = [Request(f"cmpl-a-0-{k}", [1] * (5 + k % 3), PARAMS) for k in range(50)]
    reqs += [Request(f"cmpl-b-{k}", [1], PARAMS) for k in range(3)]
    got = share_decodes(reqs, 32)
    assert [r.req_id for r in got if r.req_id.startswith("cmpl-b")] == ["cmpl-b-0", "cmpl-b-1", "cmpl-b-2"]
    fan = [r for r in got if r.req_id.startswith("cmpl-a")]
    assert len(fan) == 29 and all(r.num_tokens == 5 or r.num_tokens == 6 for r in fan), (
        "furthest behind first"
    )
    assert got == [r for r in reqs if r in got], "order kept"
    assert share_decodes(reqs, None) == reqs and share_decodes(reqs, 60) == reqs


def test_family_caps_split_between_families_first() -> None:
    needs = [(f"cmpl-fan-0-{k}", 13) for k in range(128)] + [("cmpl-other-0", 9)]
    caps = family_caps(needs, 140)
    assert caps["cmpl-other-0"] == 9, "the unrelated prompt gets all it needs"
    assert caps["cmpl-fan-0-0"] == 1 and sum(min(caps[r], n) for r, n in needs) <= 140 + 1
    assert family_caps([("a-1", 100), ("b-1", 100)], 50) == {"a-1": 25, "b-1": 25}


def test_an_unrelated_prompt_is_computed_whole_beside_128_sibling_prompts() -> None:
    """128 siblings' prompts (one family, 13 tokens each) and an unrelated 9-token prompt: the
    unrelated one is computed in its first plan (its first token one plan away), not a token a
    plan as one claimant among 129."""
    s = paced(0.25, 0.0017, max_num_seqs=256)
    for k in range(128):
        s.add(Request(f"cmpl-fan-0-{k}", list(range(1, 14)), PARAMS))
    complete(s, s.schedule())
    s.add(Request("cmpl-other-0", list(range(100, 109)), PARAMS))
    plan = s.schedule()
    [mine] = [c for c in plan.chunks if c.req_id == "cmpl-other-0"]
    assert len(mine.token_ids) == 9 and mine.sample_index >= 0
    assert any(c.req_id.startswith("cmpl-fan") for c in plan.chunks), "the siblings go on too"


def test_waiting_prompts_keep_their_reserve_beside_a_fanouts_decodes() -> None:
    """200 siblings decoding at 2 ms a row would take a whole plan (125 rows): an unrelated
    60-token prompt keeps its part of the plan and is computed in its first plan."""
    s = paced(0.25, 0.002, max_num_seqs=256)
    fan = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for k in range(200):
        s.add(Request(f"cmpl-fan-0-{k}", [1, 2, 3], fan))
    while any(not r.output_token_ids for r in s.requests.values()):
        complete(s, s.schedule())
    s.add(Request("cmpl-other-0", list(range(100, 160)), PARAMS))
    plan = s.schedule()
    [mine] = [c for c in plan.chunks if c.req_id == "cmpl-other-0"]
    assert len(mine.token_ids) == 60 and mine.sample_index >= 0
    decodes = [c for c in plan.chunks if c.req_id.startswith("cmpl-fan")]
    assert len(decodes) == 125 - 60, len(decodes)  # the decodes keep the rest (at least half the plan)
    assert s.pace.decode_rows(10_000) == 63, "the reserve is at most half the plan"
