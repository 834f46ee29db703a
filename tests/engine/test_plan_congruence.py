"""StepPlan: schema'd round trip, digest, and executors refusing inconsistent plans.

The executor (ModelRunner) must change its tables only as the plan says and
raise PlanMismatch for anything that does not fit, naming it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from conftest import random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.engine.executor import PlanMismatch
from pipeserve.engine.plan import (
    NewRequest,
    SamplingSpec,
    ScheduledChunk,
    StepPlan,
    plan_digest,
    seal,
)
from pipeserve.ring.messages import Forward, decode_frame, encode_frame

SPEC = SamplingSpec(0.0, -1, 1.0, 0.0, None, None)


def _plan(**kw) -> StepPlan:
    base = dict(
        step_id=1,
        freed=[],
        new_requests=[NewRequest("a", SPEC)],
        chunks=[ScheduledChunk("a", [5, 6, 7], 0, [0], 0)],
    )
    base.update(kw)
    return seal(StepPlan(**base))


def test_plan_round_trips_without_pickle() -> None:
    """As the ring carries it: in a Forward frame (ring/messages.py), msgpack, no pickle."""
    plan = _plan()
    data = encode_frame(Forward(plan, []))
    assert isinstance(data, bytes) and b"pickle" not in data
    back = decode_frame(data)
    assert isinstance(back, Forward) and back.plan == plan and plan_digest(back.plan) == plan.digest != 0


def test_digest_covers_every_field() -> None:
    plan = _plan()
    variants = [
        msgspec.structs.replace(plan, step_id=2),
        msgspec.structs.replace(plan, freed=["x"]),
        msgspec.structs.replace(plan, chunks=[ScheduledChunk("a", [5, 6, 8], 0, [0], 0)]),
        msgspec.structs.replace(plan, chunks=[ScheduledChunk("a", [5, 6, 7], 0, [1], 0)]),
        msgspec.structs.replace(plan, chunks=[ScheduledChunk("a", [5, 6, 7], 0, [0], -1)]),
    ]
    assert len({plan_digest(v) for v in variants} | {plan.digest}) == len(variants) + 1


def test_decoder_rejects_malformed_bytes() -> None:
    with pytest.raises(msgspec.ValidationError):
        bad_plan = {"step_id": "one", "freed": [], "new_requests": [], "chunks": []}
        decode_frame(msgspec.msgpack.encode({"type": "forward", "plan": bad_plan, "reports": []}))


@pytest.fixture
def runner(llama_dir: Path):
    return LLM(str(llama_dir), max_model_len=128, num_kv_blocks=32).engine.executor.runner


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_plan(chunks=[ScheduledChunk("zz", [5], 0, [0], 0)]), "unknown request 'zz'"),
        (_plan(chunks=[ScheduledChunk("a", [5, 6, 7], 0, [32], 0)]), "outside pool of 32"),
        (_plan(freed=["ghost"]), "freed unknown request 'ghost'"),
        (_plan(chunks=[ScheduledChunk("a", list(range(20)), 0, [0], 0)]), "1 blocks for 20 tokens"),
        (msgspec.structs.replace(_plan(), step_id=9), "digest"),
    ],
)
def test_runner_refuses_inconsistent_plan(runner, plan: StepPlan, message: str) -> None:
    with pytest.raises(PlanMismatch, match=message):
        runner.execute(plan)


def test_runner_refuses_duplicate_new_and_skipped_positions(runner) -> None:
    runner.execute(_plan())
    with pytest.raises(PlanMismatch, match="already known"):
        runner.execute(_plan(step_id=2))
    with pytest.raises(PlanMismatch, match="starts at 5, stage holds 3"):
        runner.execute(_plan(step_id=3, new_requests=[], chunks=[ScheduledChunk("a", [1], 5, [], 0)]))


def test_runner_refuses_wrong_activation_rows(runner) -> None:
    plan = _plan()
    runner.apply(plan)
    step = runner.prepare(plan)
    hidden = torch.zeros(4, runner.model.cfg.hidden_size)
    with pytest.raises(PlanMismatch, match="4 activation rows for a 3-token plan"):
        runner.forward(step, hidden)


def test_engine_plans_keep_executor_tables_in_step(llama_dir: Path) -> None:
    """Through a run with preemption and prefix hits, the executor's tables mirror stage 0's."""
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=20)
    eng = llm.engine
    step = eng.step

    def checked_step():
        finished = step()
        sched, runner = eng.scheduler, eng.executor.runner
        live = {r.req_id: r for r in sched.requests.values() if r.in_executors}
        assert set(runner.reqs) == set(live) | set(sched._freed)  # freed by the next plan
        for rid, req in live.items():
            assert runner.reqs[rid].block_ids == req.block_ids
            assert runner.reqs[rid].num_tokens == req.num_computed
        return finished

    eng.step = checked_step  # type: ignore[method-assign]
    shared = random_prompts(1, 40, 40, 1024, seed=30)[0]
    prompts = [shared + p for p in random_prompts(8, 10, 40, 1024, seed=31)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30))
    assert eng.scheduler.num_preemptions > 0
    assert eng.executor.runner.reqs == {}
