"""The real `openai` client against `pipeserve up` (a 2-stage group): completions and chat,
blocking and streaming, greedy output equal to HF transformers, 32 concurrent requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import hf_greedy, random_prompts
from serving_support import UpProcess, running_up

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def up(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    args = ("--model", str(llama_dir), "--stages", "2", "--num-kv-blocks", "1024")
    with running_up(*args, log_dir=tmp_path_factory.mktemp("up")) as server:
        assert server.ready_line == f"pipeserve: serving {llama_dir} at {server.url}/v1"
        yield server


@pytest.fixture(scope="module")
def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_blocking_vs_streaming_completions(client: openai.OpenAI, llama_dir: Path) -> None:
    model = client.models.list().data[0].id
    assert model == str(llama_dir)
    prompt = "The lighthouse keeper"
    blocking = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == blocking.choices[0].text
    assert blocking.usage.completion_tokens == chunks[-1].usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [blocking.choices[0].finish_reason]


def test_greedy_completion_equals_hf(client: openai.OpenAI, llama_dir: Path) -> None:
    """Token ids (vLLM's `return_token_ids`) and text, for text and token-id prompts."""
    model = str(llama_dir)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    for text in ("Hello! How are you today?", "Tell me a story about a ship."):
        prompt_ids = tok(text)["input_ids"]
        want = hf_greedy(llama_dir, prompt_ids, MAX_TOKENS)
        for prompt in (text, prompt_ids):
            got = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            choice = got.choices[0]
            assert choice.prompt_token_ids == prompt_ids
            assert choice.token_ids == want
            assert choice.text == tok.decode(want, skip_special_tokens=True)
            assert got.usage.prompt_tokens == len(prompt_ids) and got.usage.completion_tokens == len(want)
        streamed = client.completions.create(
            model=model,
            prompt=prompt_ids,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        assert [t for c in streamed if c.choices for t in c.choices[0].token_ids] == want


def test_chat_blocking_streaming_and_hf(client: openai.OpenAI, llama_dir: Path) -> None:
    model = str(llama_dir)
    messages = [{"role": "user", "content": "Say something about the sea."}]
    blocking = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = blocking.choices[0].message.content
    assert streamed == text and blocking.choices[0].message.role == "assistant"
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 may return a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    want = hf_greedy(llama_dir, list(prompt_ids), MAX_TOKENS)
    assert blocking.choices[0].token_ids == want and blocking.choices[0].prompt_token_ids == list(prompt_ids)
    assert text == tok.decode(want, skip_special_tokens=True)
    assert blocking.usage.prompt_tokens == len(prompt_ids)


def test_32_concurrent_requests_each_equal_their_solo_hf(client: openai.OpenAI, llama_dir: Path) -> None:
    model = str(llama_dir)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    prompts = random_prompts(32, 3, 60, tok.vocab_size, seed=44)

    def one(prompt: list[int]) -> list[int]:
        body = {"ignore_eos": True, "return_token_ids": True}
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=body
        )
        return r.choices[0].token_ids

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, prompts))
    for prompt, ids in zip(prompts, got, strict=True):
        assert ids == hf_greedy(llama_dir, prompt, MAX_TOKENS, ignore_eos=True), prompt


def test_bench_against_the_live_server(up: UpProcess, llama_dir: Path, tmp_path: Path) -> None:
    """`pipeserve bench` drives the real router (streaming) and the real stage 0 (gRPC)."""
    from pipeserve.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--url", up.url, "--workload", "shared-prefix", "--num-requests", "8"]
    argv += ["--concurrency", "4", "--input-len", "24", "--output-len", "6", "--shared-prefix-len", "16"]
    assert main([*argv, "--tokenizer", str(llama_dir), "--warmup", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]
    assert result["completed"] == 8 and result["failed"] == 0, result
    grpc_target = up.groups()[0]["grpc"]
    argv = ["bench", "--router-overhead", "--url", up.url, "--grpc", grpc_target, "--num-requests", "5"]
    assert main([*argv, "--warmup", "1", "--json", str(out)]) == 0
    overhead = json.loads(out.read_text())["router_overhead"]
    assert overhead["router"]["ok"] == 5 and overhead["direct"]["ok"] == 5


BAD_INPUT = [
    # (body or raw text, status, param)
    ('{"model": "M", "prompt": "hi", ', 400, None),  # malformed JSON
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": [5, 6, 10**7]}, 400, "prompt"),  # token id outside the vocabulary
    ({"prompt": [5] * 5000}, 400, "prompt"),  # longer than the context
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "n": 129}, 400, "n"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_INPUT)
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(
    up: UpProcess, llama_dir: Path, body: object, status: int, param: str | None
) -> None:
    model = str(llama_dir)
    url = up.url + "/v1/completions"
    if isinstance(body, str):
        r = httpx.post(url, content=body.replace('"M"', json.dumps(model)), timeout=30)
    else:
        r = httpx.post(url, json={"model": model, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    ok = httpx.post(url, json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_huge_body_is_413_and_the_server_goes_on(up: UpProcess, llama_dir: Path) -> None:
    url = up.url + "/v1/completions"
    body = b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}'
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(url, json={"model": str(llama_dir), "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
