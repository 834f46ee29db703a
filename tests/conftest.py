"""Shared fixtures: demo checkpoints written per session, and the HF oracle."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch

from pipeserve.model.demo import DemoSpec, write_demo_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("llama"), DemoSpec(arch="llama"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("qwen2"), DemoSpec(arch="qwen2"))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@cache
def _hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@cache
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy continuation by transformers, one prompt at a time (no padding)."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, ignore_eos))


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    """Next-token logits [vocab] after prompt, float32."""
    with torch.no_grad():
        return _hf_model(str(path))(torch.tensor([prompt])).logits[0, -1].float()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
