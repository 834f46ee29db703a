"""What one request may cost (router/features/cost.py): prompt tokens x prompt_logprobs, and prompts x
best_of x max_tokens, each bounded by a RouterConfig limit; above it a 400 in OpenAI's shape that
names the field the client sent, nothing reaches a group, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router_support import RouterHarness, ScriptedStage

LIMITS = {"max_prompt_scoring": 100, "max_generated_tokens": 1000}


@pytest.fixture(scope="module")
def stage() -> ScriptedStage:
    return ScriptedStage([5, 6, 7, 8], vocab_size=1024, max_model_len=2048)


@pytest.fixture(scope="module")
def router(llama_dir: Path, stage: ScriptedStage) -> Iterator[RouterHarness]:
    with RouterHarness(llama_dir, {"g0": stage}, served_model_name="demo", **LIMITS) as h:
        yield h


def post(router: RouterHarness, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "demo", **body}, timeout=30)


def refused(router: RouterHarness, stage: ScriptedStage, path: str, body: dict, param: str) -> str:
    before = len(stage.requests)
    r = post(router, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param), err
    assert len(stage.requests) == before, "a refused request reached the group"
    return err["message"]


PROMPT = list(range(10, 70))  # 60 tokens


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "prompt_logprobs": 2}, "prompt_logprobs"),  # 120 scores
        ({"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1}, "logprobs"),  # echo's scores
        ({"prompt": [PROMPT, PROMPT], "prompt_logprobs": 1}, "prompt_logprobs"),  # summed over prompts
        ({"prompt": [1, 2], "n": 4, "best_of": 8, "max_tokens": 200}, "best_of"),  # 1600 tokens
        ({"prompt": [1, 2], "n": 8, "max_tokens": 200}, "n"),
        ({"prompt": [[1, 2], [3, 4]], "max_tokens": 600}, "max_tokens"),
    ],
)
def test_completions_over_a_limit_name_the_field(
    router: RouterHarness, stage: ScriptedStage, body: dict, param: str
) -> None:
    message = refused(router, stage, "/v1/completions", body, param)
    assert "--max-" in message, message  # says which flag sets the limit


def test_chat_over_a_limit_names_the_field(router: RouterHarness, stage: ScriptedStage) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    path, mct = "/v1/chat/completions", "max_completion_tokens"
    refused(router, stage, path, {**chat, "n": 4, mct: 300}, "n")
    refused(router, stage, path, {**chat, mct: 1200}, mct)


def test_at_the_limits_requests_are_served(router: RouterHarness) -> None:
    ok = [
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 4}),  # 60 scores
        ("/v1/completions", {"prompt": [1, 2], "n": 2, "best_of": 4, "max_tokens": 250}),  # 1000 tokens
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ]
    for path, body in ok:
        r = post(router, path, body)
        assert r.status_code == 200, r.text


def test_a_fanout_leaves_a_quarter_of_the_slots_to_single_requests(llama_dir: Path) -> None:
    stage = ScriptedStage([5, 6, 7, 8], vocab_size=1024, max_model_len=2048)
    stage.token_delay_s = 0.2
    with RouterHarness(llama_dir, {"g0": stage}, served_model_name="demo", max_concurrency=8) as h:
        body = {"model": "demo", "prompt": [1, 2], "n": 4, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", h.url + "/v1/completions", json=body, timeout=30) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the response (a disconnect)
            next(lines)  # 4 of 8 slots in flight: a fan-out of 3 would leave 1, under the quarter (2)
            r = post(h, "/v1/completions", {"prompt": [1, 2], "n": 3, "max_tokens": 1})
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            r = post(h, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
            assert r.status_code == 200, r.text
