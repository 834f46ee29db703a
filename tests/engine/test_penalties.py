"""Penalties, logit_bias and min_tokens match transformers (float32) greedy decoding.

The oracle is HF `generate`: its own `repetition_penalty` for rows that only
use that, and `VllmProcessors` (written here from vLLM's definitions) for the
others. The workload mixes plain and penalized rows, chunks long prompts,
hits the prefix cache and preempts (small pool), for pipeline sizes 1-3: the
token histories the last stage rebuilds from plans must survive all of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import _hf_model, hf_greedy, random_prompts, record_plans
from pipeline_support import CongruenceWatch
from pipeserve import LLM, SamplingParams
from pipeserve.engine.executor import PlanMismatch
from pipeserve.engine.plan import NewRequest, SamplingSpec, ScheduledChunk, StepPlan, seal
from pipeserve.worker.penalties import apply_processors
from pipeserve.worker.sampler import Sampler

MAX_TOKENS = 14


class VllmProcessors(LogitsProcessor):
    """vLLM's order: min_tokens mask, logit_bias, repetition (prompt+output), frequency/presence (output)."""

    def __init__(self, prompt_len: int, p: SamplingParams, stop_ids: list[int]) -> None:
        self.prompt_len, self.p, self.stop_ids = prompt_len, p, stop_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        p, row = self.p, scores[0].clone()
        out = input_ids[0, self.prompt_len :]
        if len(out) < p.min_tokens:
            row[self.stop_ids] = float("-inf")
        for t, b in p.logit_bias.items():
            row[t] += b
        if p.repetition_penalty != 1:
            seen = input_ids[0].unique()
            v = row[seen]
            row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        counts = torch.bincount(out, minlength=row.shape[0]).float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return row[None]


def hf_reference(model_dir: Path, prompt: list[int], p: SamplingParams, eos: list[int]) -> list[int]:
    model = _hf_model(str(model_dir))
    ids = torch.tensor([prompt])
    kw: dict = {"eos_token_id": None if p.ignore_eos else eos}
    only_repetition = not (p.presence_penalty or p.frequency_penalty or p.logit_bias or p.min_tokens)
    if only_repetition:
        kw["repetition_penalty"] = p.repetition_penalty  # HF's own processor
    else:
        stop = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)))
        kw["logits_processor"] = LogitsProcessorList([VllmProcessors(len(prompt), p, stop)])
    if p.stop_token_ids:
        kw["eos_token_id"] = sorted(set(p.stop_token_ids) | set(kw["eos_token_id"] or []))
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=p.max_tokens,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def params_for(i: int, eos: int) -> SamplingParams:
    """Row i's params: plain rows among penalized ones, every processor, every extreme."""
    base = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    kinds = [
        {},
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 2.0, "presence_penalty": 0.5},
        {"presence_penalty": -2.0},
        {"logit_bias": {7: 100.0, 8: 5.0, 9: -100.0}},
        {"repetition_penalty": 0.01, "frequency_penalty": -1.0},  # extreme: logits x 100
        {"min_tokens": 5, "ignore_eos": False, "logit_bias": {eos: 100.0}},  # EOS right after min_tokens
        {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "logit_bias": {11: 3.0}},
        {"min_tokens": 3, "stop_token_ids": [12], "logit_bias": {12: 100.0}},
    ]
    return SamplingParams(**{**base, **kinds[i % len(kinds)]})


def workload() -> list[list[int]]:
    shared = random_prompts(1, 48, 48, 1024, seed=31)[0]
    prompts = random_prompts(9, 2, 50, 1024, seed=32) + random_prompts(2, 120, 160, 1024, seed=33)
    prompts += [shared + p for p in random_prompts(4, 3, 20, 1024, seed=34)]
    return prompts


def run_and_check(model_dir: Path, stages: int) -> None:
    prompts = workload()
    with LLM(
        str(model_dir),
        stages=stages,
        max_model_len=256,
        num_kv_blocks=28,  # too few for all at once: preemption
        max_num_batched_tokens=40,  # long prompts are chunked
        ring_timeout_s=20,
    ) as llm:
        watch = CongruenceWatch(llm)
        plans = record_plans(llm)
        eos = list(llm.engine.model_config.eos_token_ids)
        params = [params_for(i, eos[0]) for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
        eng = llm.engine
        wrong = []
        for i, (p, sp, o) in enumerate(zip(prompts, params, outs, strict=True)):
            want = hf_reference(model_dir, p, sp, eos)
            if o.outputs[0].token_ids != want:
                wrong.append((i, sp, o.outputs[0].token_ids, want))
        assert not wrong, f"{len(wrong)} rows differ from HF, first: {wrong[0]}"
        penalized = [i for i, sp in enumerate(params) if sp != params_for(0, eos[0])]
        moved = [
            i for i in penalized if outs[i].outputs[0].token_ids != hf_greedy(model_dir, prompts[i], 14, True)
        ]
        assert len(moved) == len(penalized), f"rows {sorted(set(penalized) - set(moved))} ran as plain greedy"
        min_rows = [o for i, o in enumerate(outs) if params[i].min_tokens == 5]
        assert all(len(o.outputs[0].token_ids) == 6 for o in min_rows), "EOS not right after min_tokens"
        assert eng.scheduler.num_preemptions > 0, "no preemption"
        assert eng.block_manager.stats.hit_tokens >= 48, "no prefix-cache hit"
        assert any(c.sample_index < 0 for p in plans for c in p.chunks), "no prompt was chunked"
        assert any(n.history for p in plans for n in p.new_requests), "no history sent with a cache hit"
        watch.check()
        assert eng.num_free_blocks == eng.num_total_blocks
        assert all(r.num_reqs == 0 and r.blocks_held == 0 for r in eng.stage_reports)


def test_penalties_match_hf_one_stage(llama_dir: Path) -> None:
    run_and_check(llama_dir, 1)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_penalties_match_hf_pipeline(llama_dir: Path, stages: int) -> None:
    run_and_check(llama_dir, stages)


def test_penalties_match_hf_qwen2(qwen2_dir: Path) -> None:
    run_and_check(qwen2_dir, 1)


def _spec(**kw) -> SamplingSpec:
    return SamplingSpec(0.0, -1, 1.0, 0.0, None, None, **kw)


def test_a_batch_without_processors_is_untouched() -> None:
    logits = torch.randn(3, 50)
    assert apply_processors(logits, [_spec(), _spec(), _spec()], [0, 1, 2], None) is logits
    biased = apply_processors(logits, [_spec(), _spec(logit_bias=[(3, 100.0)])], [0, 0], None)
    assert biased is not logits and torch.equal(biased[0], logits[0]) and biased[1].argmax() == 3


@pytest.mark.parametrize(
    "kw",
    [
        {"repetition_penalty": 1e-30},
        {"repetition_penalty": 1e300, "presence_penalty": 2.0},
        {"repetition_penalty": 2.0, "frequency_penalty": -2.0, "presence_penalty": -2.0},
        {"logit_bias": [(0, 100.0), (1, -100.0)], "min_tokens": 9, "min_tokens_stop_ids": [0, 2]},
    ],
)
def test_accepted_extremes_never_make_nan(kw: dict) -> None:
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[big, -big, 3.0, float("-inf"), 0.0, -5.0]] * 2)
    spec = _spec(**kw)
    random = SamplingSpec(1.0, -1, 1.0, 0.0, 7, 3, **kw)
    hist = [0, 1, 2, 3, 4, 5, 0, 0]
    tokens, failures = Sampler(torch.device("cpu"))(logits, ["a", "b"], [spec, random], [3, 3], [hist, hist])
    assert not failures and all(0 <= t.token_id < 6 for t in tokens)
    # Logprobs are the raw distribution's (vLLM's default raw_logprobs): the processors do not move them.
    raw = logits.nan_to_num(nan=float("-inf"), posinf=big).log_softmax(-1)[1]
    assert tokens[1].logprob == pytest.approx(raw[tokens[1].token_id].item())


def test_a_huge_repetition_penalty_leaves_a_distribution() -> None:
    """Every token seen, every logit negative, penalty 1e300: finite logits stay finite (not all -inf)."""
    logits = -torch.rand(2, 6) - 0.5
    spec = SamplingSpec(1.0, -1, 1.0, 0.0, 3, 0, repetition_penalty=1e300)
    greedy = _spec(repetition_penalty=1e300)
    tokens, failures = Sampler(torch.device("cpu"))(
        logits, ["a", "b"], [spec, greedy], [0, 0], [list(range(6)), list(range(6))]
    )
    assert not failures and len(tokens) == 2


def _plan(step_id: int, new: list, chunks: list, freed: tuple[str, ...] = ()) -> StepPlan:
    return seal(StepPlan(step_id=step_id, freed=list(freed), new_requests=new, chunks=chunks))


def test_the_last_stage_rebuilds_histories_from_plans_and_refuses_gaps(llama_dir: Path) -> None:
    """History = NewRequest.history + every chunk; a first chunk past it (a cache hit sent without its
    tokens), or one that does not begin with the token this stage sampled, is a PlanMismatch;
    freeing drops it, so a re-admission (preemption) starts afresh; plain rows keep none."""
    runner = LLM(str(llama_dir), max_model_len=128, num_kv_blocks=32).engine.executor.runner
    pen = _spec(frequency_penalty=1.0)
    out = runner.execute(
        _plan(1, [NewRequest("a", pen, history=[5, 6])], [ScheduledChunk("a", [7, 8], 2, [0], 0)])
    )
    assert runner.histories.get("a") == [5, 6, 7, 8]
    sampled = out.sampled[0].token_id
    with pytest.raises(PlanMismatch, match="sampled"):
        runner.execute(_plan(2, [], [ScheduledChunk("a", [(sampled + 1) % 50], 4, [], 1)]))
    with pytest.raises(PlanMismatch, match="token history holds 0"):
        runner.execute(_plan(3, [NewRequest("b", pen)], [ScheduledChunk("b", [3], 2, [1], 0)]))
    runner.execute(_plan(4, [NewRequest("c", _spec())], [ScheduledChunk("c", [1, 2], 0, [2], 0)], ("a", "b")))
    assert runner.histories.get("a") is None and runner.histories.get("c") is None
    runner.execute(_plan(5, [NewRequest("a", pen)], [ScheduledChunk("a", [1, 2, 3], 0, [3], 0)]))
    assert runner.histories.get("a") == [1, 2, 3]
