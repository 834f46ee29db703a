"""Huge finite sampling values are valid and never NaN (issue 29 point 5: temperature 1e308).

Decision (as vLLM): temperature is any finite number >= 0, repetition_penalty any finite number
> 0; presence/frequency penalties stay in [-2, 2] and logit_bias in [-100, 100] (OpenAI's
ranges). NaN and infinities are refused at the edge (a 400 naming the field: test_api_fuzz.py).
What must hold for the accepted extremes: the sampler's distribution is finite (no NaN, no inf,
sums to 1), masked tokens (a grammar's -inf) keep probability 0, and a request completes — here
the largest float64 for temperature and repetition_penalty, with the penalties at their bounds,
under a JSON grammar, through the real engine.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from pipeserve.engine.plan import SamplingSpec
from pipeserve.entrypoints.llm import LLM
from pipeserve.sampling_params import SamplingParams
from pipeserve.worker.sampler import Sampler, _filter

HUGE = sys.float_info.max  # 1.7976931348623157e308
EXTREMES = {"repetition_penalty": HUGE, "presence_penalty": 2.0, "frequency_penalty": -2.0}


def test_the_distribution_stays_finite_under_a_mask() -> None:
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[big, -big, 3.0, -3.0, 0.0, 7.0]] * 3)
    allowed = [2, 3, 4]
    masked = torch.full_like(logits, float("-inf"))
    masked[:, allowed] = logits[:, allowed]  # what a grammar's bitmask leaves
    specs = [SamplingSpec(t, -1, 1.0, 0.0, 11, None, **EXTREMES) for t in (HUGE, 1e308, 1.0)]
    probs = _filter(masked, specs)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs[:, [0, 1, 5]] == 0).all()
    hist = [2, 3, 3, 4]  # every allowed token seen: the penalty hits each of them
    for seed in range(20):
        specs = [SamplingSpec(HUGE, -1, 1.0, 0.0, seed, 2, **EXTREMES)] * 3
        tokens, failures = Sampler(torch.device("cpu"))(masked, ["a", "b", "c"], specs, [4] * 3, [hist] * 3)
        assert not failures and {t.token_id for t in tokens} <= set(allowed)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)


def test_huge_values_complete_under_a_grammar(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(
        temperature=HUGE,
        max_tokens=24,
        seed=5,
        structured_kind="json",
        structured=json.dumps(schema),
        structured_compact=True,
        logprobs=1,
        **EXTREMES,
    )
    outs = llm.generate([[5, 6, 7, 8], [9, 10]], [params, SamplingParams(temperature=1e308, max_tokens=8)])
    for o in outs:
        out = o.outputs[0]
        assert out.finish_reason in ("stop", "length") and out.token_ids, out
    lps = [lp for lp, _ in outs[0].outputs[0].logprobs or []]
    assert lps and all(lp is not None and math.isfinite(lp) for lp in lps), lps
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[0].outputs[0].text)["n"], int)
