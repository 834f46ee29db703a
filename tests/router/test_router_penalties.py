"""Penalties, logit_bias and min_tokens through the router to a live group, both endpoints, stream or not.

The expected tokens are the offline LLM's for the same SamplingParams (the
engine is checked against transformers in tests/engine/test_penalties.py):
the fields must travel JSON -> SamplingParams -> protobuf -> plan intact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pipeserve import LLM, SamplingParams
from pipeserve.config import EngineConfig
from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness
from serving_support import live_slots

pytestmark = pytest.mark.slow
KEY = "pen-key"
PROMPT = "The lighthouse keeper"
PENALTIES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 1.5,
    "repetition_penalty": 1.4,
    "logit_bias": {"7": 3.0, "9": -100},
}


@pytest.fixture(scope="module")
def router(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    config = EngineConfig(
        model=str(llama_dir), num_threads=1, num_kv_blocks=128, log_dir=str(tmp_path_factory.mktemp("pen"))
    )
    with live_slots(config, ("g0",)) as slots:
        targets = {name: s.grpc_target for name, s in slots.items()}
        with RouterHarness(
            llama_dir, targets, wait_ready=0, api_key=KEY, served_model_name="demo", health_interval_s=3600
        ) as h:
            h.poll()
            yield h


@pytest.fixture(scope="module")
def client(router: RouterHarness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=256, num_kv_blocks=64)


def _expected(offline: LLM, ids: list[int], **kw) -> list[int]:
    kw = {**kw, "logit_bias": {int(k): float(v) for k, v in kw.get("logit_bias", {}).items()}}
    return offline.generate([ids], SamplingParams(temperature=0, **kw))[0].outputs[0].token_ids


def test_completions_apply_the_penalties(client: openai.OpenAI, offline: LLM, llama_dir: Path) -> None:
    tok = TokenizerAssets.load(llama_dir)
    ids = tok.encode(PROMPT)
    want = _expected(offline, ids, max_tokens=20, ignore_eos=True, **PENALTIES)
    plain = _expected(offline, ids, max_tokens=20, ignore_eos=True)
    assert want != plain
    extra = {"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.4}
    kw = {"model": "demo", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "extra_body": extra}
    kw |= {k: v for k, v in PENALTIES.items() if k != "repetition_penalty"}
    blocking = client.completions.create(**kw)
    assert blocking.choices[0].model_extra["token_ids"] == want
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == blocking.choices[0].text


def test_chat_applies_min_tokens_and_logit_bias(client: openai.OpenAI) -> None:
    eos_biased = {"logit_bias": {"2": 100}}  # the demo tokenizer's EOS (</s>) is id 2
    messages = [{"role": "user", "content": "hi"}]
    kw = {"model": "demo", "messages": messages, "temperature": 0, "max_tokens": 12}
    early = client.chat.completions.create(**kw, **eos_biased)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    for stream in (False, True):
        extra = {"min_tokens": 6}
        if stream:
            chunks = list(
                client.chat.completions.create(
                    **kw, **eos_biased, extra_body=extra, stream=True, stream_options={"include_usage": True}
                )
            )
            assert chunks[-1].usage.completion_tokens == 7
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        else:
            r = client.chat.completions.create(**kw, **eos_biased, extra_body=extra)
            assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "stop"


def test_no_stop_string_before_min_tokens(client: openai.OpenAI) -> None:
    kw = {"model": "demo", "prompt": PROMPT, "temperature": 0, "max_tokens": 30}
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})
    first = full.choices[0].text[:1]
    assert first.strip()
    stopped = client.completions.create(**kw, stop=[first], extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == "" and stopped.usage.completion_tokens == 1
    later = client.completions.create(**kw, stop=[first], extra_body={"ignore_eos": True, "min_tokens": 4})
    assert later.usage.completion_tokens >= 4
    assert later.choices[0].text == full.choices[0].text[: len(later.choices[0].text)]


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"5": None}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
]


@pytest.mark.parametrize(("endpoint", "base"), [("completions", {"prompt": "x"}), ("chat/completions", {})])
def test_bad_fields_are_400s_naming_them(router: RouterHarness, endpoint: str, base: dict) -> None:
    if endpoint.startswith("chat"):
        base = {"messages": [{"role": "user", "content": "x"}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    for stream in (False, True):
        for body, param in BAD:
            full = {"model": "demo", "max_tokens": 8, **base, **body, "stream": stream}
            r = httpx.post(f"{router.url}/v1/{endpoint}", json=full, headers=headers, timeout=30)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
    ok = httpx.post(
        f"{router.url}/v1/{endpoint}",
        json={"model": "demo", "max_tokens": 2, **base, **PENALTIES, "min_tokens": 2},
        headers=headers,
        timeout=30,
    )
    assert ok.status_code == 200, ok.text
