"""Bad input raises a ValueError naming the field; the engine keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import hf_greedy
from pipeserve import LLM, SamplingParams
from pipeserve.errors import ConfigError, InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=128, num_kv_blocks=64)


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda llm: llm.generate([""], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([[]], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([[1, 2, 5000]], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([[1, -1]], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([[7] * 128], SamplingParams(max_tokens=4)), "prompt"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(max_tokens=-3)), "max_tokens"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(temperature=-0.1)), "temperature"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(top_p=0.0)), "top_p"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(top_k=-2)), "top_k"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(min_p=2.0)), "min_p"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(seed=-1)), "seed"),
        (lambda llm: llm.generate([[1, 2]], SamplingParams(logprobs=99)), "logprobs"),
        (lambda llm: llm.generate([[1, 2.5]], SamplingParams()), "prompt"),
    ],
)
def test_bad_input_names_field_and_engine_keeps_serving(llama_dir: Path, llm: LLM, make, param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        make(llm)
    assert exc.value.param == param
    assert isinstance(exc.value, ValueError)
    assert not llm.engine.has_unfinished(), "a rejected request was queued"
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, [3, 4, 5], 5)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_one_bad_prompt_rejects_the_batch_before_queueing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], [9999]], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished()


def test_bad_engine_config(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        LLM(str(llama_dir), block_size=3)
    with pytest.raises(ConfigError, match=r"cannot hold one request"):
        LLM(str(llama_dir), max_model_len=512, num_kv_blocks=4)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(llama_dir), max_model_len=100000)
    with pytest.raises(ConfigError, match="model"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLM(str(tmp_path))
    with pytest.raises(TypeError, match="no_such_flag"):
        LLM(str(llama_dir), no_such_flag=1)
