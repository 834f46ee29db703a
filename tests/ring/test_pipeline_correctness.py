"""Pipeline groups of S stage processes (gloo) produce transformers' greedy tokens.

One group per (checkpoint, S) runs a workload that mixes prompt lengths from 1
to ~190 tokens, splits prompts into chunks (small token budget), hits the
prefix cache, and preempts (small KV pool) — with up to S microbatches in the
ring, long prompts having consecutive chunks in several of them. Every step,
every stage must hold exactly the request tables and blocks stage 0 holds
after the same plan (CongruenceWatch), and at the end every stage's pool is
empty.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_matches_hf, hf_greedy, random_prompts, record_plans
from pipeline_support import CongruenceWatch
from pipeserve import LLM, SamplingParams


def workload() -> list[list[int]]:
    shared = random_prompts(1, 48, 48, 1024, seed=21)[0]
    prompts = random_prompts(8, 2, 60, 1024, seed=22) + random_prompts(2, 150, 190, 1024, seed=23)
    prompts[0] = prompts[0][:1]
    prompts += [shared + p for p in random_prompts(4, 3, 20, 1024, seed=24)]
    return prompts


def run_and_check(model_dir: Path, stages: int) -> None:
    prompts = workload()
    with LLM(
        str(model_dir),
        stages=stages,
        max_model_len=256,
        num_kv_blocks=32,  # 512 tokens for ~14 requests of up to ~210: preemption
        max_num_batched_tokens=40,  # long prompts are chunked
        ring_timeout_s=20,
    ) as llm:
        watch = CongruenceWatch(llm)
        plans = record_plans(llm)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20))
        eng = llm.engine
        assert_matches_hf(model_dir, prompts, outs, 20)
        assert eng.scheduler.num_preemptions > 0, "the pool was large enough: no preemption"
        assert eng.block_manager.stats.hit_tokens >= 48, "shared prefixes were never reused"
        assert any(c.sample_index < 0 for p in plans for c in p.chunks), "no prompt was chunked"
        if stages > 1:
            assert watch.max_inflight_seen >= 2, "microbatches never overlapped in the ring"
            assert watch.shared_chunks > 0, "no prompt had chunks in two plans of the ring at once"
        watch.check()
        assert eng.num_free_blocks == eng.num_total_blocks
        assert len(eng.stage_reports) == stages
        assert all(r.num_reqs == 0 and r.blocks_held == 0 for r in eng.stage_reports)


# (architecture, S): the demo checkpoints (llama, qwen2) up to 4 stages; those transformers creates
# for the other registered architectures (conftest.py) for 1 to 3.
CASES = [
    *[(arch, s) for arch in ("llama", "qwen2") for s in (2, 3, 4)],
    ("llama", 1),
    *[
        (arch, s)
        for arch in ("qwen3", "phi3", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text")
        for s in (1, 2, 3)
    ],
]


@pytest.mark.parametrize(("arch", "stages"), CASES)
def test_pipeline_matches_hf(request: pytest.FixtureRequest, arch: str, stages: int) -> None:
    run_and_check(request.getfixturevalue(f"{arch}_dir"), stages)


def test_seeded_sampling_is_the_same_for_every_pipeline_size(llama_dir: Path) -> None:
    prompts = random_prompts(6, 3, 40, 1024, seed=25)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16) for i in range(6)]
    results = {}
    for stages in (1, 2):
        with LLM(str(llama_dir), stages=stages, max_model_len=128, num_kv_blocks=64) as llm:
            results[stages] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results[1] == results[2]
    assert len({tuple(t) for t in results[1]}) > 1


def test_abort_mid_decode_frees_blocks_on_every_stage(llama_dir: Path) -> None:
    with LLM(str(llama_dir), stages=3, max_model_len=256, num_kv_blocks=64) as llm:
        eng = llm.engine
        watch = CongruenceWatch(llm)
        prompts = random_prompts(3, 20, 40, 1024, seed=26)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        reqs = [eng.add_request(p, params) for p in prompts]
        while len(reqs[1].output_token_ids) < 5:
            eng.step()
        held = len(reqs[1].block_ids)
        free_before = eng.num_free_blocks
        assert eng.abort(reqs[1].req_id) is reqs[1]
        assert eng.num_free_blocks == free_before + held  # stage 0's pool at once
        # The free travels in the next plan; once its result is back, no stage holds
        # the request, and each holds exactly the blocks stage 0's tables hold.
        free_step = eng.scheduler._step_id + 1
        while watch.last_step < free_step:
            eng.step()
        assert reqs[1].req_id not in watch.held_reqs[free_step]
        assert [n for n, _ in watch.reported[free_step]] == [2, 2, 2]
        assert len({b for _, b in watch.reported[free_step]}) == 1
        while eng.has_unfinished():
            eng.step()
        watch.check()
        for i in (0, 2):
            assert reqs[i].output_token_ids == hf_greedy(llama_dir, prompts[i], 30, ignore_eos=True)
        assert all(r.blocks_held == 0 and r.num_reqs == 0 for r in eng.stage_reports)
        assert eng.num_free_blocks == eng.num_total_blocks
