"""Request parsing and validation: each bad body is a 400 naming its field."""

from __future__ import annotations

import pytest

from pipeserve.errors import InvalidRequestError
from pipeserve.router.api.protocol import parse_chat, parse_completion
from pipeserve.router.errors import APIError
from pipeserve.rpc.convert import sampling_to_proto
from pipeserve.sampling_params import check_prompt, resolve_max_tokens

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
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 129}, "best_of"),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"max_tokens": 0, "echo": False}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": 7}, "model"),
        # An integer literal too large for a float is a 400, not an OverflowError.
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": -(10**400)}, "top_p"),
        ({"min_p": 10**309}, "min_p"),
        ({"frequency_penalty": 10**400}, "frequency_penalty"),
        ({"max_tokens": 10**400, "temperature": 1e400}, "temperature"),
        # Lone surrogates cannot be tokenized nor echoed.
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": ["ok", "\udfff"]}, "prompt"),
        ({"model": "m\ud800"}, "model"),
        ({"stop": ["\ud800"]}, "stop"),
        # Fields we do not implement are refused, not ignored.
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"add_special_tokens": 1}, "add_special_tokens"),
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
    # An integral float is an integer, as pydantic's lax mode (vLLM) and JSON Schema take it.
    assert parse_completion({"prompt": [1.0, 2]}).prompts == [[1, 2]]
    req = parse_completion({"prompt": [[1.0], "a"], "max_tokens": 4.0, "seed": 7.0, "top_k": 3.0})
    assert req.prompts == [[1], "a"] and (req.params.max_tokens, req.params.seed, req.params.top_k) == (
        4,
        7,
        3,
    )
    assert all(type(v) is int for v in (*req.prompts[0], req.params.max_tokens, req.params.seed))


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
    assert req.stream and req.include_usage and req.params.stop == ["END"] and req.add_special_tokens
    p = sampling_to_proto(req.params)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, list(p.stop_token_ids), p.logprobs) == (
        5,
        0,
        0,
        9,
        [2],
        3,
    )
    with pytest.raises(InvalidRequestError) as err:
        check_prompt([1], req.params, 64, vocab_size=2)
    assert err.value.param == "stop_token_ids"
    assert not sampling_to_proto(parse_completion(OK).params).HasField("logprobs")
    assert parse_completion({**OK, "add_special_tokens": False}).add_special_tokens is False


def test_max_tokens_beyond_the_context_names_the_field_sent() -> None:
    params = parse_completion({**OK, "max_tokens": 61}).params
    assert resolve_max_tokens(params, 3, 64, strict=True) == 61
    with pytest.raises(InvalidRequestError) as err:
        resolve_max_tokens(params, 4, 64, strict=True)
    assert err.value.param == "max_tokens"
    assert (
        "maximum context length is 64 tokens" in err.value.message and "4 input tokens" in err.value.message
    )
    assert resolve_max_tokens(params, 4, 64, strict=False) == 61  # the offline LLM stops at the context
    chat = parse_chat({**CHAT, "max_completion_tokens": 10**30})
    assert chat.max_tokens_param == "max_completion_tokens"
    with pytest.raises(InvalidRequestError) as err:
        resolve_max_tokens(chat.params, 4, 64, strict=True, param=chat.max_tokens_param)
    assert err.value.param == "max_completion_tokens"


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
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": "8"}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user\ud800", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages[0].name"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"n": 129}, "n"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
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
    assert not plain.add_special_tokens and plain.max_tokens_param == "max_tokens"
    assert resolve_max_tokens(plain.params, prompt_len=10, max_model_len=64, strict=True) == 54
    assert parse_chat({**CHAT, "logprobs": True}).params.logprobs == 0
    assert parse_chat({**CHAT, "tools": None, "tool_choice": "none"}).params.max_tokens is None
    assert parse_chat({**CHAT, "add_special_tokens": True}).add_special_tokens


def test_check_prompt() -> None:
    params = parse_completion(OK).params
    check_prompt([1, 2], params, max_model_len=3, vocab_size=10)
    for ids, fragment in (
        ([], "empty"),
        ([1, 10], "vocabulary"),
        ([-1], "vocabulary"),
        ([1, 2, 3], "context"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            check_prompt(ids, params, max_model_len=3, vocab_size=10, param="messages")
        assert err.value.param == "messages" and fragment in err.value.message


def test_error_messages_render_when_they_quote_a_bad_value() -> None:
    import json

    for body in ({**OK, "temperature": "\ud800" * 3}, {**OK, "seed": 10**500}):
        with pytest.raises(APIError) as err:
            parse_completion(body)
        json.dumps(err.value.body(), ensure_ascii=False).encode("utf-8")  # what the response encodes
        assert len(err.value.message) < 200
