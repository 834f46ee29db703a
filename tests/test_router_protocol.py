"""Request parsing and validation: each bad body is a 400 naming its field."""

from __future__ import annotations

import pytest

from pipeserve.router.errors import APIError
from pipeserve.router.protocol import check_prompt, parse_chat, parse_completion

OK = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": None}, "prompt"),
        ({"return_token_ids": "yes"}, "return_token_ids"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1, 2], "a", 3]}, "prompt"),
        ({"prompt": [[1, True]]}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": "x"}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stream": "true"}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": 1}}, "include_usage"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"model": 7}, "model"),
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(extra: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_completion({**OK, **extra})
    e = err.value
    assert e.status == 400 and e.param == param and e.type == "invalid_request_error"
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_body_must_be_an_object(body: object) -> None:
    with pytest.raises(APIError) as err:
        parse_completion(body)
    assert err.value.status == 400


def test_completion_defaults_nulls_and_unknown_fields() -> None:
    req = parse_completion({**OK, "temperature": None, "user": "u", "unknown_field": {"x": 1}, "n": 1})
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.logprobs, p.stop) == (16, 1.0, 1.0, -1, None, [])
    assert req.prompts == ["hi"] and not req.stream and not req.include_usage and req.model == "m"


def test_completion_prompt_shapes() -> None:
    assert parse_completion({"prompt": "a"}).prompts == ["a"]
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]


def test_completion_sampling_to_proto() -> None:
    req = parse_completion(
        {
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0,
            "top_k": 0,
            "seed": 9,
            "stop": "END",
            "stop_token_ids": [2],
            "logprobs": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.stream and req.include_usage and req.params.stop == ["END"]
    p = req.params.to_proto(prompt_len=4, max_model_len=64, vocab_size=100)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, list(p.stop_token_ids), p.logprobs) == (
        5,
        0,
        -1,
        9,
        [2],
        3,
    )
    with pytest.raises(APIError) as err:
        req.params.to_proto(4, 64, vocab_size=2)
    assert err.value.param == "stop_token_ids"
    assert not parse_completion(OK).params.to_proto(4, 64, 100).HasField("logprobs")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"max_completion_tokens": 0}, "max_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 3}, "n"),
        ({"presence_penalty": 1}, "presence_penalty"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(extra: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_chat({**CHAT, **extra})
    assert err.value.status == 400 and err.value.param == param


def test_chat_fields() -> None:
    req = parse_chat(
        {
            **CHAT,
            "messages": [
                {"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_tokens": 3,
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [],
        }
    )
    assert [m["content"] for m in req.messages] == ["", "ab"]
    assert req.params.max_tokens == 7 and req.params.logprobs == 2
    plain = parse_chat(CHAT)
    assert plain.params.max_tokens is None and plain.params.logprobs is None
    assert plain.params.to_proto(prompt_len=10, max_model_len=64, vocab_size=100).max_tokens == 54
    assert parse_chat({**CHAT, "logprobs": True}).params.logprobs == 0


def test_check_prompt() -> None:
    check_prompt([1, 2], "prompt", max_model_len=3, vocab_size=10)
    for ids, fragment in (
        ([], "empty"),
        ([1, 10], "vocabulary"),
        ([-1], "vocabulary"),
        ([1, 2, 3], "context"),
    ):
        with pytest.raises(APIError) as err:
            check_prompt(ids, "prompt", max_model_len=3, vocab_size=10)
        assert err.value.status == 400 and err.value.param == "prompt" and fragment in err.value.message
