"""prompt_logprobs against transformers (float32 log_softmax over the prompt), S=1 and S=2.

Small chunks (16 tokens) put a chunk boundary inside every prompt: the last row of each chunk
scores the next chunk's first token (ScheduledChunk.score_next). A request with prompt_logprobs
takes no prefix-cache hit (a plain one does); a preemption recomputes positions, which stage 0
keeps once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import _hf_model, random_prompts
from pipeserve import LLM
from pipeserve.engine.plan import PromptScores, ScheduledChunk
from pipeserve.engine.prompt_logprobs import chunk_scoring, keep
from pipeserve.sampling_params import SamplingParams

K = 5


def hf_prompt_scores(model_dir: Path, prompt: list[int], k: int) -> list:
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].float()
    logp = logits.log_softmax(-1)
    out: list = [None]
    for p in range(1, len(prompt)):
        row = logp[p - 1]
        lp = row[prompt[p]]
        v, i = row.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out.append((lp.item(), int((row > lp).sum()) + 1, list(zip(i.tolist(), v.tolist(), strict=True))))
    return out


def assert_close(got: list, want: list) -> None:
    assert len(got) == len(want) and got[0] is None
    for pos, (g, w) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        assert g[0] == pytest.approx(w[0], abs=1e-4), pos
        assert g[1] == w[1], pos
        assert [t for t, _ in g[2]] == [t for t, _ in w[2]], pos
        assert [v for _, v in g[2]] == pytest.approx([v for _, v in w[2]], abs=1e-4), pos


PARAMS = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
def test_prompt_logprobs_match_hf_and_take_no_prefix_hit(llama_dir: Path, stages: int) -> None:
    prompts = random_prompts(3, 40, 70, 1024, seed=21)
    kw = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_batched_tokens": 16, "num_threads": 1}
    with LLM(str(llama_dir), stages=stages, **kw) as llm:
        outs = llm.generate(prompts, PARAMS)
        for p, o in zip(prompts, outs, strict=True):
            assert_close(o.prompt_logprobs, hf_prompt_scores(llama_dir, p, K))
        plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
        assert plain[0].num_cached_tokens > 0, "a plain request hits the blocks they cached"
        again = llm.generate(prompts, PARAMS)
        for a, o in zip(again, outs, strict=True):
            assert a.num_cached_tokens == 0
            assert a.prompt_logprobs == o.prompt_logprobs


@pytest.mark.slow
def test_prompt_logprobs_survive_preemption(llama_dir: Path) -> None:
    prompts = random_prompts(6, 40, 70, 1024, seed=22)
    kw = {"max_model_len": 256, "num_kv_blocks": 20, "max_num_batched_tokens": 16, "num_threads": 1}
    with LLM(str(llama_dir), **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=2))
        assert llm.engine.scheduler.num_preemptions > 0, "pool was large enough: no preemption"
    for p, o in zip(prompts, outs, strict=True):
        assert_close(o.prompt_logprobs, hf_prompt_scores(llama_dir, p, 2))


def test_k0_and_a_one_token_prompt(llama_dir: Path) -> None:
    with LLM(str(llama_dir), max_model_len=128, num_kv_blocks=32, num_threads=1) as llm:
        one, short = llm.generate(
            [[7], [7, 8, 9]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        )
    assert one.prompt_logprobs == [None]
    assert_close(short.prompt_logprobs, hf_prompt_scores(llama_dir, [7, 8, 9], 0))


def test_stage0_keeps_each_position_once_and_refuses_a_gap() -> None:
    assert chunk_scoring([1, 2, 3, 4, 5], 0, 2) == (2, 3)  # rows score positions 1, 2; 2 is next chunk's
    assert chunk_scoring([1, 2, 3, 4, 5], 2, 3) == (2, -1)  # the last row is the sampling one
    assert chunk_scoring([1, 2, 3, 4, 5], 3, 3) == (1, -1)  # a recompute reaching into the output
    chunk = ScheduledChunk("r", [1, 2], 0, [], -1, 2, 3)
    held: list = []
    keep(held, chunk, PromptScores("r", 1, [-1.0, -2.0], [1, 2], [[], []]))
    keep(held, chunk, PromptScores("r", 1, [-9.0, -9.0], [9, 9], [[], []]))  # recomputed: first stays
    assert held == [(-1.0, 1, []), (-2.0, 2, [])]
    later = ScheduledChunk("r", [4, 5], 3, [], -1, 2, 6)
    with pytest.raises(ValueError, match="position 4 before 3"):
        keep(held, later, PromptScores("r", 4, [-1.0, -1.0], [1, 1], [[], []]))
    with pytest.raises(ValueError, match="missing"):
        keep(held, chunk, None)
