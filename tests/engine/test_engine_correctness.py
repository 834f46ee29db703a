"""Greedy output of the engine == transformers generate, token for token (float32).

Every test also checks that all KV blocks are back in the free pool afterwards.
"""

from __future__ import annotations

from pathlib import Path

from conftest import assert_matches_hf, hf_greedy, random_prompts, record_plans
from pipeserve import LLM, SamplingParams
from pipeserve.engine.plan import StepPlan


def assert_pool_free(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.num_free_blocks == eng.num_total_blocks
    assert all(b.ref_count == 0 for b in eng.block_manager.blocks)
    assert eng.executor.runner.reqs == {}, "executor still holds request tables"


def test_mixed_batch_matches_hf(model_dir: Path) -> None:
    prompts = random_prompts(18, 1, 40, 1024, seed=1) + random_prompts(6, 150, 420, 1024, seed=2)
    prompts[0] = prompts[0][:1]  # a one-token prompt
    llm = LLM(str(model_dir), max_model_len=512, num_kv_blocks=1024)
    runner = llm.engine.executor.runner
    prepare = runner.prepare
    decode_groups: list[int] = []

    def recording(plan: StepPlan):
        step = prepare(plan)
        decode_groups.append(len(step.batch.decodes))
        return step

    runner.prepare = recording  # type: ignore[method-assign]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert_matches_hf(model_dir, prompts, outs, 24)
    assert max(decode_groups) >= 2, "decode rows were never split by context length"
    assert_pool_free(llm)


def test_tiny_chunk_budget_matches_hf(model_dir: Path) -> None:
    prompts = random_prompts(6, 20, 90, 1024, seed=3)
    llm = LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=7)
    plans = record_plans(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert_matches_hf(model_dir, prompts, outs, 12)
    assert max(p.num_tokens for p in plans) <= 7
    partial = [c for p in plans for c in p.chunks if c.sample_index < 0]
    assert len(partial) >= len(prompts), "prompts were not split into several chunks"
    assert_pool_free(llm)


def test_prefix_cache_hits_match_hf(model_dir: Path) -> None:
    base = random_prompts(1, 100, 100, 1024, seed=4)[0]
    others = random_prompts(3, 5, 40, 1024, seed=5)
    prompts = [base, base + others[0], base[:50] + others[1], base + others[2], base]
    llm = LLM(str(model_dir), max_model_len=512, num_kv_blocks=256)
    first = llm.generate([base], SamplingParams(temperature=0, max_tokens=16))
    stats = llm.engine.block_manager.stats
    hits_before = stats.hit_tokens
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    assert stats.hit_tokens - hits_before >= 4 * 48, "shared prefixes were recomputed"
    assert outs[0].num_cached_tokens == 96  # 6 full blocks; the last token is always computed
    assert first[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    assert_matches_hf(model_dir, prompts, outs, 16)
    assert_pool_free(llm)


def test_preemption_matches_hf(model_dir: Path) -> None:
    prompts = random_prompts(8, 40, 70, 1024, seed=6)
    # 20 blocks of 16 hold ~320 tokens; 8 requests need ~8 x 110.
    llm = LLM(str(model_dir), max_model_len=256, num_kv_blocks=20, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    assert llm.engine.scheduler.num_preemptions > 0, "pool was large enough: no preemption"
    assert_matches_hf(model_dir, prompts, outs, 40)
    assert_pool_free(llm)


def test_preemption_with_prefix_cache_matches_hf(llama_dir: Path) -> None:
    shared = random_prompts(1, 48, 48, 1024, seed=7)[0]
    prompts = [shared + p for p in random_prompts(6, 10, 30, 1024, seed=8)]
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=18)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.stats.hit_tokens > 0
    assert_matches_hf(llama_dir, prompts, outs, 40)
    assert_pool_free(llm)


def test_eos_and_max_tokens_finish(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    prompts = random_prompts(8, 5, 30, 1024, seed=9)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200))
    eos = set(llm.engine.model_config.eos_token_ids)
    for p, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        want = hf_greedy(llama_dir, p, 200)
        assert c.token_ids == want
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in eos
        else:
            assert c.finish_reason == "length" and len(c.token_ids) in (200, 256 - len(p))
    assert_pool_free(llm)


def test_ignore_eos_runs_to_max_tokens(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    prompts = random_prompts(4, 5, 30, 1024, seed=10)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(llama_dir, p, 60, ignore_eos=True)
        assert o.outputs[0].finish_reason == "length"


def test_context_limit_finishes_with_length(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=64, num_kv_blocks=16)
    prompt = random_prompts(1, 50, 50, 1024, seed=11)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 14 and out.outputs[0].finish_reason == "length"
    assert_pool_free(llm)


def test_text_prompt_and_stop(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    full = llm.generate("Hello! How are you today?", SamplingParams(temperature=0, max_tokens=20))[0]
    text = full.outputs[0].text
    assert text and full.outputs[0].token_ids == hf_greedy(llama_dir, full.prompt_token_ids, 20)
    stop = text[5:8]
    cut = llm.generate(
        ["Hello! How are you today?"], SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    )[0]
    assert cut.outputs[0].text == text[: text.find(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    tok = full.outputs[0].token_ids[3]
    by_id = llm.generate(
        ["Hello! How are you today?"],
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]),
    )[0]
    assert by_id.outputs[0].token_ids == full.outputs[0].token_ids[:4]
    assert_pool_free(llm)


def test_abort_mid_decode_frees_blocks_and_others_continue(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    eng = llm.engine
    prompts = random_prompts(3, 20, 40, 1024, seed=12)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    while len(reqs[1].output_token_ids) < 5:
        eng.step()
    held = len(reqs[1].block_ids)
    free_before = eng.num_free_blocks
    assert eng.abort(reqs[1].req_id) is reqs[1]
    assert reqs[1].finish_reason == "abort" and reqs[1].block_ids == []
    assert eng.num_free_blocks == free_before + held
    assert eng.abort(reqs[1].req_id) is None  # second abort is a no-op
    while eng.has_unfinished():
        eng.step()
    for i in (0, 2):
        assert reqs[i].output_token_ids == hf_greedy(llama_dir, prompts[i], 30, ignore_eos=True)
    assert_pool_free(llm)


def test_abort_waiting_request(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64, max_num_seqs=1)
    eng = llm.engine
    a = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4))
    b = eng.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    assert eng.abort(b.req_id) is b and b.num_computed == 0
    while eng.has_unfinished():
        eng.step()
    assert a.output_token_ids == hf_greedy(llama_dir, [1, 2, 3], 4)
    assert_pool_free(llm)
