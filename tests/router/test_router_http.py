"""The router's HTTP API over real gRPC to scripted stages: response shapes, streaming, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness, ScriptedStage
from serving_support import wait_until

TEXT = "Hello 🙂 world! 你好 The quick brown fox END tail"


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> TokenizerAssets:
    return TokenizerAssets.load(llama_dir)


@pytest.fixture
def stage(tok: TokenizerAssets) -> ScriptedStage:
    return ScriptedStage(tok.encode(TEXT), vocab_size=tok.tokenizer.get_vocab_size(), max_model_len=64)


@pytest.fixture
def router(llama_dir: Path, stage: ScriptedStage) -> Iterator[RouterHarness]:
    with RouterHarness(llama_dir, {"g0": stage}, served_model_name="demo") as h:
        yield h


def post(h: RouterHarness, path: str, body: object, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    return httpx.post(h.url + path, content=content, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def sse_events(r: httpx.Response) -> list:
    events = [line[len("data: ") :] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and r.text.endswith("data: [DONE]\n\n")
    return [json.loads(e) for e in events[:-1]]


def test_completion_blocking_shape_and_usage(router: RouterHarness, stage: ScriptedStage) -> None:
    r = post(router, "/v1/completions", {"model": "demo", "prompt": "Hi there", "max_tokens": 40})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "demo"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {"index": 0, "text": TEXT, "logprobs": None, "finish_reason": "stop"}
    n_prompt = len(stage.requests[-1].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == n_prompt
    assert body["usage"]["completion_tokens"] == len(stage.reply)
    assert body["usage"]["total_tokens"] == n_prompt + len(stage.reply)
    r = post(router, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert (
        list(stage.requests[-1].prompt_token_ids) == [5, 6, 7] and stage.requests[-1].sampling.max_tokens == 3
    )


def test_several_prompts_give_indexed_choices(router: RouterHarness, stage: ScriptedStage) -> None:
    r = post(router, "/v1/completions", {"prompt": ["a", "b c", [9, 9]], "max_tokens": 2})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 6
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x") as client:
        stream = client.completions.create(model="demo", prompt=["a", "b"], max_tokens=3, stream=True)
        texts = {0: "", 1: ""}
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
    assert (
        texts[0]
        == texts[1]
        == post(router, "/v1/completions", {"prompt": "a", "max_tokens": 3}).json()["choices"][0]["text"]
    )


def test_streaming_completion_with_the_openai_client(router: RouterHarness) -> None:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x") as client:
        full = client.completions.create(model="demo", prompt="Hi", max_tokens=40).choices[0].text
        stream = client.completions.create(
            model="demo", prompt="Hi", max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full == TEXT
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)
    *body, last, usage = chunks
    assert last.choices[0].finish_reason == "stop" and all(c.choices[0].finish_reason is None for c in body)
    assert usage.choices == [] and usage.usage.completion_tokens > 0


def test_streaming_chat_with_the_openai_client(router: RouterHarness, stage: ScriptedStage, tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x") as client:
        blocking = client.chat.completions.create(model="demo", messages=messages, max_completion_tokens=30)
        chunks = list(
            client.chat.completions.create(
                model="demo", messages=messages, stream=True, stream_options={"include_usage": True}
            )
        )
    assert blocking.id.startswith("chatcmpl-") and blocking.object == "chat.completion"
    assert blocking.choices[0].message.role == "assistant" and blocking.choices[0].message.content == TEXT
    rendered = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # The template's text, without special tokens added (as apply_chat_template).
    assert list(stage.requests[0].prompt_token_ids) == tok.encode(rendered, add_special_tokens=False)
    # No max_tokens: up to the context length.
    assert stage.requests[1].sampling.max_tokens == 64 - len(tok.encode(rendered, add_special_tokens=False))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == blocking.usage.total_tokens


def test_stop_string_trims_and_cancels_upstream(router: RouterHarness, stage: ScriptedStage) -> None:
    stage.token_delay_s = 0.02
    r = post(router, "/v1/completions", {"prompt": "x", "max_tokens": 40, "stop": ["fox E", "zzz"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hello 🙂 world! 你好 The quick brown " and choice["finish_reason"] == "stop"
    wait_until(lambda: stage.active == 0, 5, "upstream call ended")
    assert stage.cancelled == 1
    r = post(router, "/v1/completions", {"prompt": "x", "max_tokens": 40, "stop": "fox E", "stream": True})
    events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    wait_until(lambda: stage.cancelled == 2 and stage.active == 0, 5, "streamed call cancelled")


def test_completion_logprobs_shape(router: RouterHarness, tok: TokenizerAssets) -> None:
    r = post(router, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    ids = tok.encode(TEXT)[:4]
    assert lp["tokens"] == [tok.token_text(i) for i in ids] and lp["token_logprobs"] == [-0.25] * 4
    assert all(len(d) == 2 and isinstance(v, float) for d in lp["top_logprobs"] for v in d.values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    r = post(router, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 0, "stream": True})
    streamed = [e["choices"][0]["logprobs"] for e in sse_events(r)]
    assert sum(len(x["tokens"]) for x in streamed) == 4
    assert all(len(d) == 1 for x in streamed for d in x["top_logprobs"])  # just the sampled token


def test_chat_logprobs_shape(router: RouterHarness, tok: TokenizerAssets) -> None:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x") as client:
        resp = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=3,
            logprobs=True,
            top_logprobs=3,
        )
    content = resp.choices[0].logprobs.content
    assert len(content) == 3 and content[0].logprob == -0.25
    first = tok.encode(TEXT)[0]
    assert content[0].token == tok.token_text(first) and bytes(content[0].bytes) == tok.token_bytes(first)
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -1.5, -2.5]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 5000]}, "prompt"),
        ({"prompt": list(range(64))}, "prompt"),
        ({"prompt": "x", "n": 200}, "n"),
        ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "top_k": 2**40}, "top_k"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
        (b"[" * 100000, None),
        (b"\xff\xfe\x00", None),
    ],
)
def test_bad_input_is_400_and_service_goes_on(router: RouterHarness, body: object, param: str | None) -> None:
    assert_error(post(router, "/v1/completions", body), 400, param)
    assert post(router, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_max_tokens_beyond_the_context_is_an_error_as_vllm(
    router: RouterHarness, stage: ScriptedStage
) -> None:
    err = assert_error(
        post(router, "/v1/completions", {"prompt": [5, 6], "max_tokens": 10**30}), 400, "max_tokens"
    )
    assert "maximum context length is 64 tokens" in err["message"] and "2 input tokens" in err["message"]
    assert not stage.requests
    r = post(router, "/v1/completions", {"prompt": [5, 6], "max_tokens": 62})  # exactly the room left
    assert r.status_code == 200 and stage.requests[-1].sampling.max_tokens == 62


def test_error_shapes_of_routing_and_framework_errors(router: RouterHarness, stage: ScriptedStage) -> None:
    assert_error(
        post(router, "/v1/completions", {"model": "other", "prompt": "x"}), 404, "model", "model_not_found"
    )
    assert_error(httpx.get(router.url + "/v1/nope"), 404, code="not_found")
    assert_error(httpx.get(router.url + "/v1/completions"), 405, code="method_not_allowed")
    bad_chat = post(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]})
    assert_error(bad_chat, 400, "messages[0].content")
    stage.mode = "invalid"  # stage 0's INVALID_ARGUMENT "param: message" keeps its param
    assert_error(post(router, "/v1/completions", {"prompt": "x"}), 400, "top_k")
    stage.mode = "internal"
    assert_error(post(router, "/v1/completions", {"prompt": "x"}), 500)
    assert len(stage.requests) == 2  # neither is retried
    stage.mode = "ok"
    assert post(router, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_models_health_and_metrics(router: RouterHarness) -> None:
    models = httpx.get(router.url + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["demo"]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 64
    assert httpx.get(router.url + "/health").status_code == 200
    post(router, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    post(router, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    text = httpx.get(router.url + "/metrics").text
    for name in (
        'pipeserve:router_requests_total{endpoint="/v1/completions",status="200"}',
        'pipeserve:router_requests_total{endpoint="/v1/completions",status="400"}',
        "pipeserve:router_time_to_first_token_seconds_bucket",
        "pipeserve:router_inter_token_latency_seconds_bucket",
        "pipeserve:router_e2e_request_latency_seconds_count",
        "pipeserve:router_generation_tokens_total 2.0",
        'pipeserve:router_group_ready{group="g0"} 1.0',
        'pipeserve:router_group_kv_pool_blocks{group="g0"} 64.0',
        "pipeserve:router_requests_in_flight 0.0",
    ):
        assert name in text, name


def test_api_key_guards_v1_only(llama_dir: Path, stage: ScriptedStage) -> None:
    with RouterHarness(llama_dir, {"g0": stage}, api_key="sekret") as h:
        assert_error(post(h, "/v1/completions", {"prompt": "x"}), 401, code="invalid_api_key")
        bad = {"Authorization": "Bearer nope"}
        assert_error(post(h, "/v1/completions", {"prompt": "x"}, headers=bad), 401)
        assert_error(httpx.get(h.url + "/v1/models"), 401)
        good = {"Authorization": "Bearer sekret"}
        assert post(h, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers=good).status_code == 200
        assert httpx.get(h.url + "/health").status_code == 200
        assert httpx.get(h.url + "/metrics").status_code == 200
        with openai.OpenAI(base_url=h.url + "/v1", api_key="sekret") as client:
            assert client.models.list().data[0].id == str(llama_dir)


def test_routes_added_by_the_caller_get_the_same_error_shape(llama_dir: Path) -> None:
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from pipeserve.config import RouterConfig
    from pipeserve.router.http.app import build_app
    from pipeserve.router.upstream.replicas import ReplicaSet

    registry = CollectorRegistry()
    config = RouterConfig(model=str(llama_dir))
    app = build_app(config, ReplicaSet(config, {"g0": "127.0.0.1:9"}, registry), registry)

    @app.get("/typed")
    def typed(n: int) -> dict:
        return {"n": n}

    @app.get("/boom")
    def boom() -> dict:
        raise RuntimeError("bug")

    with TestClient(app, raise_server_exceptions=False) as c:
        err = c.get("/typed", params={"n": "abc"})
        assert err.status_code == 400 and err.json()["error"]["param"] == "n"
        assert c.get("/typed", params={"n": 3}).json() == {"n": 3}
        assert c.get("/boom").json()["error"]["type"] == "server_error"
        assert c.get("/health").status_code == 503  # the replica set never polled: nothing is ready
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert 'pipeserve:router_requests_total{endpoint="/boom",status="500"} 1.0' in c.get("/metrics").text
