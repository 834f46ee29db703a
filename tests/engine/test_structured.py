"""Structured outputs (engine/grammar.py): greedy ids equal transformers `generate` with xgrammar's
own HF logits processor, in mixed batches with unconstrained rows, through preemption, with one
stage and with a pipeline; finished JSON validates; a spec that does not compile is refused
before admission; a terminated grammar finishes the request even with ignore_eos."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from conftest import hf_constrained_greedy, hf_greedy, random_prompts
from pipeserve import LLM
from pipeserve.errors import InvalidRequestError
from pipeserve.model.config import ModelConfig
from pipeserve.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
ENUM = {"type": "string", "enum": ["red", "green", "blue"]}
# (kind, text, compact): JSON without free whitespace, so a random-weight model ends its object.
SPECS = [
    ("json", json.dumps(SCHEMA), True),
    ("json", json.dumps(ENUM), True),
    ("regex", "[a-e]{2,4}-[0-9]{1,3}", False),
    ("choice", json.dumps(["yes", "no", "maybe not"]), False),
    ("json_object", "", True),
]
MAX_TOKENS = 24


def _oracle(path: Path, prompt: list[int], kind: str, text: str, compact: bool) -> list[int]:
    return hf_constrained_greedy(path, prompt, kind, text, compact, MAX_TOKENS)


def _params(kind: str, text: str, compact: bool, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        structured_kind=kind,
        structured=text,
        structured_compact=compact,
        **kw,
    )


def _check_batch(llm: LLM, path: Path, seed: int, copies: int = 1) -> None:
    specs = SPECS * copies
    prompts = random_prompts(2 * len(specs), 5, 40, 1024, seed=seed)
    params = []
    for i in range(len(prompts)):  # constrained and unconstrained rows interleaved
        params.append(
            _params(*specs[i // 2]) if i % 2 == 0 else SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
    outs = llm.generate(prompts, params)
    for i, (p, sp, o) in enumerate(zip(prompts, params, outs, strict=True)):
        got = o.outputs[0].token_ids
        if sp.structured_kind:
            want = _oracle(path, p, sp.structured_kind, sp.structured, sp.structured_compact)
            assert got == want, (i, sp.structured_kind, got, want)
            text = o.outputs[0].text
            if o.outputs[0].finish_reason == "stop" and sp.structured_kind == "json":
                jsonschema.validate(json.loads(text), json.loads(sp.structured))
            if sp.structured_kind == "choice" and o.outputs[0].finish_reason == "stop":
                assert text in json.loads(sp.structured)
        else:
            assert got == hf_greedy(path, p, MAX_TOKENS), i


def test_structured_rows_match_hf_with_xgrammar_one_stage(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=128)
    _check_batch(llm, llama_dir, seed=31)
    assert not llm.engine.executor.runner.grammar.rows, "matchers outlive their requests"
    long = SamplingParams(
        temperature=0, max_tokens=100, structured_kind="json", structured=SPECS[0][1], structured_compact=True
    )
    outs = [o.outputs[0] for o in llm.generate(random_prompts(4, 3, 20, 1024, seed=34), long)]
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done, [o.text for o in outs]
    for o in done:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_structured_survives_preemption(llama_dir: Path) -> None:
    """A tight pool preempts constrained requests: their matchers are replayed from the outputs."""
    llm = LLM(str(llama_dir), max_model_len=96, num_kv_blocks=8, enable_prefix_caching=False)
    _check_batch(llm, llama_dir, seed=32, copies=2)
    assert llm.engine.scheduler.num_preemptions > 0, "pool was large enough: no preemption"


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_structured_rows_match_hf_with_xgrammar_in_a_pipeline(llama_dir: Path, stages: int) -> None:
    """The last stage (another process) holds the matchers; stage 0 only compiles."""
    with LLM(str(llama_dir), stages=stages, max_model_len=256, num_kv_blocks=128) as llm:
        _check_batch(llm, llama_dir, seed=33)


@pytest.mark.slow
def test_structured_survives_preemption_in_a_pipeline(llama_dir: Path) -> None:
    with LLM(str(llama_dir), stages=2, max_model_len=96, num_kv_blocks=8, enable_prefix_caching=False) as llm:
        _check_batch(llm, llama_dir, seed=35, copies=2)
        assert llm.engine.scheduler.num_preemptions > 0, "pool was large enough: no preemption"


def test_ended_grammar_finishes_even_with_ignore_eos(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    out = llm.generate([[3, 4, 5]], _params("choice", json.dumps(["ok"]), False, ignore_eos=True))[0].outputs[
        0
    ]
    assert out.finish_reason == "stop" and out.text == "ok", out


@pytest.mark.parametrize(
    ("kind", "text"),
    [("json", '{"type": "nonsense"}'), ("regex", "(unclosed"), ("grammar", "root ::= ")],
)
def test_spec_that_does_not_compile_is_refused_before_admission(
    llama_dir: Path, kind: str, text: str
) -> None:
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)
    free = llm.engine.num_free_blocks
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[1, 2, 3]], _params(kind, text, False))
    assert err.value.param == "structured"
    assert not llm.engine.has_unfinished() and llm.engine.num_free_blocks == free


def test_matcher_masks_its_row_only_and_a_rejected_token_fails_its_request(llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    from pipeserve.engine.grammar import GrammarBook
    from pipeserve.worker.grammar import GrammarRows

    cfg = ModelConfig.from_dir(str(llama_dir), torch.float32)
    digit = AutoTokenizer.from_pretrained(str(llama_dir)).encode("7", add_special_tokens=False)[0]
    rows = GrammarRows(GrammarBook(llama_dir, cfg.vocab_size, cfg.eos_token_ids))
    rows.admit("a", "choice", json.dumps(["ab"]), False, [])
    rows.admit("b", "regex", "[a-z]+", False, [digit])  # a replay the grammar refuses
    logits = torch.zeros(3, cfg.vocab_size)
    failures = rows.mask(logits, ["free", "a", "b"], [0, 0, 1])
    assert set(failures) == {"b"} and "replayed" in failures["b"]
    assert torch.equal(logits[0], torch.zeros(cfg.vocab_size)), "an unconstrained row was masked"
    assert 0 < int(torch.isfinite(logits[1]).sum()) < cfg.vocab_size
    assert not bool(torch.isfinite(logits[1, digit]))
    ended, why = rows.advance("a", digit)
    assert not ended and why is not None and "not accepted" in why
    rows.drop("a")
    rows.drop("b")
    assert not rows.rows
