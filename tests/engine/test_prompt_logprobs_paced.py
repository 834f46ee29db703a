"""prompt_logprobs against transformers under the step pace and other chunk sizes (issue 29).

Scoring is chunked like prefill, and fairly: odd token budgets (a scored row counts against the
budget, so a 7-token budget scores 3 positions a step) and the step pace's floor (a 1 us target:
16 cost units a step) cut the prompts at other places, several requests share each step, and
the scores stay transformers' (float32), with greedy tokens the same as an unpaced run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_prompt_logprobs import assert_close, hf_prompt_scores

from conftest import random_prompts
from pipeserve import LLM
from pipeserve.sampling_params import SamplingParams

K = 3
PARAMS = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "target_ms"),
    [(7, 0.0), (33, 0.0), (2048, 0.001)],
    ids=["budget7", "budget33", "paced"],
)
def test_scores_match_hf_for_any_chunking(llama_dir: Path, budget: int, target_ms: float) -> None:
    prompts = random_prompts(3, 120, 240, 1024, seed=29)
    kw = {"max_model_len": 256, "num_kv_blocks": 128, "num_threads": 1}
    with LLM(str(llama_dir), max_num_batched_tokens=budget, step_target_ms=target_ms, **kw) as llm:
        outs = llm.generate(prompts, PARAMS)
    with LLM(str(llama_dir), step_target_ms=0.0, **kw) as llm:
        whole = llm.generate(prompts, PARAMS)
    for p, o, w in zip(prompts, outs, whole, strict=True):
        assert_close(o.prompt_logprobs, hf_prompt_scores(llama_dir, p, K))
        assert o.outputs[0].token_ids == w.outputs[0].token_ids
