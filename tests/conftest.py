"""Shared fixtures: demo checkpoints written per session (llama, qwen2), checkpoints transformers
creates for the other architectures (arch_support.py), and the HF oracle."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from arch_support import write_hf_checkpoint
from kmock_support import ApiServer

from metrics_support import live_scrape  # noqa: F401  (a session fixture: one live scrape for tests/obs)
from pipeserve import LLM
from pipeserve.engine.plan import StepPlan
from pipeserve.model.demo import DemoSpec, write_demo_model


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test's fixtures that offer `failure_report()` (tests/faults' cluster: every process's
    log) add it to the failure's report."""
    rep = yield
    if rep.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            if callable(report := getattr(value, "failure_report", None)):
                rep.sections.append((f"{name}: failure_report()", report()))
    return rep


@pytest.fixture(scope="session", autouse=True)
def _flight_dumps_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory):
    """Group stops in tests write flight dumps (obs/flight.py): into this session's temp dir, not
    ~/.cache/pipeserve/flight. Stage processes inherit it; a test may still name its own dir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PIPESERVE_FLIGHT_DIR", str(tmp_path_factory.mktemp("flight")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("llama"), DemoSpec(arch="llama"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("qwen2"), DemoSpec(arch="qwen2"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral")


@pytest.fixture(scope="session")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("gemma"), "gemma")


@pytest.fixture(scope="session")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="session")
def gemma3_text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("gemma3_text"), "gemma3_text")


# Every architecture of the registry with a checkpoint fixture above: the engine's correctness tests
# run on each (tests/engine/test_engine_correctness.py).
ARCH_FIXTURES = ["llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text"]


@pytest.fixture(scope="session", params=ARCH_FIXTURES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@cache
def _hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _generate(path: str, prompt: Sequence[int], max_new_tokens: int, **kwargs: Any) -> list[int]:
    """transformers' greedy generate of one prompt (no padding): the new token ids."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = _hf_model(path).generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


@cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    return tuple(_generate(path, prompt, max_new_tokens, **kwargs))


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy continuation by transformers, one prompt at a time (no padding)."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, ignore_eos))


@cache
def _grammar_compiler(path: str):
    """xgrammar's compiler over the checkpoint's tokenizer, as a stage builds it (engine/grammar.py)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pipeserve.model.config import ModelConfig

    cfg = ModelConfig.from_dir(path, torch.float32)
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(path), vocab_size=cfg.vocab_size, stop_token_ids=list(cfg.eos_token_ids)
    )
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def hf_constrained_greedy(
    path: Path, prompt: list[int], kind: str, text: str, compact: bool, max_new_tokens: int
) -> list[int]:
    """transformers' greedy generate under a structured-output constraint, with xgrammar's own HF
    logits processor over the grammar a stage compiles for it: JSON compact (no free whitespace) or
    with at most JSON_MAX_WHITESPACE in a row, a regex, or a choice."""
    import xgrammar as xgr

    from pipeserve.engine.grammar import JSON_MAX_WHITESPACE, choice_grammar

    c = _grammar_compiler(str(path))
    ws = {"any_whitespace": False} if compact else {"max_whitespace_cnt": JSON_MAX_WHITESPACE}
    if kind == "json":
        g = c.compile_json_schema(text, **ws)
    elif kind == "json_object":
        g = c.compile_json_schema('{"type": "object"}', **ws)
    elif kind == "regex":
        g = c.compile_regex(text)
    elif kind == "choice":
        g = c.compile_grammar(choice_grammar(json.loads(text)))
    else:
        raise ValueError(f"unknown structured kind {kind!r}")
    processor = xgr.contrib.hf.LogitsProcessor(g)
    return _generate(str(path), prompt, max_new_tokens, logits_processor=[processor])


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    """Next-token logits [vocab] after prompt, float32."""
    with torch.no_grad():
        return _hf_model(str(path))(torch.tensor([prompt])).logits[0, -1].float()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_matches_hf(model_dir: Path, prompts: list[list[int]], outs, max_tokens: int) -> None:
    mismatches = []
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        want = hf_greedy(model_dir, p, max_tokens)
        if o.outputs[0].token_ids != want:
            mismatches.append((i, len(p), o.outputs[0].token_ids, want))
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, first: {mismatches[0]}"


def record_plans(llm: LLM) -> list[StepPlan]:
    plans: list[StepPlan] = []
    schedule = llm.engine.scheduler.schedule

    def recording() -> StepPlan:
        plan = schedule()
        plans.append(plan)
        return plan

    llm.engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


@pytest.fixture()
def kmock_options(kmock_options: dict) -> dict:
    """Every `kmock` fixture is kmock_support.ApiServer: resource versions, PUT, preconditions (one
    conftest for the tree: a second one in tests/k8s would be imported as `conftest` too and shadow
    this module for the tests that import its helpers)."""
    return {**kmock_options, "cls": ApiServer}
