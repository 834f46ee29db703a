"""The engine's greedy output is unchanged with the Triton kernels selected (interpreter mode).

A tiny demo model (2 layers, hidden 64, 4 query heads over 1 kv head: GQA 4) runs in a subprocess
(tests/kernels/engine_run.py) with PIPESERVE_KERNELS=triton and TRITON_INTERPRET=1, so every layer op
of the engine — store_kv, rotary, RMSNorm, SiLU-mul, decode and chunked prefill attention over
cached prefixes, block size 4 — is a Triton kernel. Its ids must equal the torch path's (this
process: auto on a CPU machine) and transformers' greedy ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy, random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.model.demo import DemoSpec, write_demo_model

RUN = Path(__file__).with_name("engine_run.py")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = DemoSpec(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=1)
    return write_demo_model(tmp_path_factory.mktemp("tiny"), spec)


def prompts() -> list[list[int]]:
    # One token, a block's worth plus one, and prompts chunked over a cached prefix (budget 12).
    return [[5], [1, 2, 3, 4, 5], *random_prompts(1, 26, 26, 1024, seed=11)]


def triton_ids(model: Path, stages: int) -> list[list[int]]:
    env = {**os.environ, "PIPESERVE_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    args = [sys.executable, str(RUN), str(model), str(stages), json.dumps(prompts()), str(MAX_TOKENS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "triton"
    return out["ids"]


def check(model: Path, got: list[list[int]]) -> None:
    settings = dict(max_model_len=128, num_kv_blocks=96, block_size=4, max_num_batched_tokens=12)
    with LLM(str(model), **settings) as llm:
        outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    torch_ids = [o.outputs[0].token_ids for o in outs]
    assert got == torch_ids, "Triton path differs from the torch path"
    assert got == [hf_greedy(model, p, MAX_TOKENS, ignore_eos=True) for p in prompts()]


def test_triton_path_greedy_equals_torch_and_hf(tiny_dir: Path) -> None:
    check(tiny_dir, triton_ids(tiny_dir, 1))


@pytest.mark.slow
def test_triton_path_two_stages_equals_torch_and_hf(tiny_dir: Path) -> None:
    check(tiny_dir, triton_ids(tiny_dir, 2))
