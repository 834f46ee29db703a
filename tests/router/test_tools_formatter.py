"""Tool calls in responses, through the live router: a scripted stage replies with the real demo
tokenizer's ids for a model's tool-call text, so the text crosses the router's detokenizer one
token per message. Streamed deltas add up to the blocking message; every body and chunk is
validated by the `openai` package's own types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import AddedToken, Tokenizer
from tools_support import QWEN_TOOLS_TEMPLATE, TOOLS

from router_support import RouterHarness, ScriptedStage

USER = [{"role": "user", "content": "Weather and time in Paris?"}]
W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
HERMES_TEXT = f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"
WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", '{"tz": "Europe/Paris"}')


@pytest.fixture(scope="module")
def tok(qwen2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen2_dir / "tokenizer.json"))


def _router(qwen2_dir: Path, tok: Tokenizer, tmp: Path, parser: str | None) -> RouterHarness:
    (tmp / "tools.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    stage = ScriptedStage([], vocab_size=tok.get_vocab_size(), max_model_len=4096)
    extra = {"tool_call_parser": parser} if parser else {}
    return RouterHarness(qwen2_dir, {"g0": stage}, chat_template=str(tmp / "tools.jinja"), **extra)


@pytest.fixture(scope="module")
def hermes(
    qwen2_dir: Path, tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterHarness]:
    with _router(qwen2_dir, tok, tmp_path_factory.mktemp("hermes"), "hermes") as h:
        yield h


def _reply(h: RouterHarness, tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    stage = h.stages["g0"]
    assert isinstance(stage, ScriptedStage)
    h.call(lambda: setattr(stage, "reply", ids))
    return ids


def _post(h: RouterHarness, body: dict) -> httpx.Response:
    return httpx.post(h.url + "/v1/chat/completions", json=body, timeout=30)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(h: RouterHarness, body: dict) -> tuple[list[ChatCompletionChunk], str | None, list, str | None]:
    """The chunks (validated) and what they add up to: content, [(id, name, arguments)], finish_reason."""
    with httpx.stream("POST", h.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    content: str | None = None
    calls: dict[int, list] = {}
    finish = None
    for c in chunks:
        (choice,) = c.choices
        d = choice.delta
        if d.content:
            content = (content or "") + d.content
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # a call's first entry carries its id, type and whole name
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and not (tc.function and tc.function.name)
                calls[tc.index][2] += tc.function.arguments or ""
        if choice.finish_reason:
            assert finish is None
            finish = choice.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    return chunks, content, [calls[i] for i in sorted(calls)], finish


def _blocking(h: RouterHarness, body: dict) -> ChatCompletion:
    r = _post(h, body)
    assert r.status_code == 200, r.text
    return ChatCompletion.model_validate(r.json())


def test_auto_parallel_calls_blocking_and_streamed(hermes: RouterHarness, tok: Tokenizer) -> None:
    _reply(hermes, tok, HERMES_TEXT)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 500}
    done = _blocking(hermes, body)
    (choice,) = done.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert _calls(choice.message) == [WEATHER, TIME]
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert [json.loads(a) for _, a in _calls(choice.message)] == [
        json.loads(W)["arguments"],
        json.loads(T)["arguments"],
    ]
    chunks, content, calls, finish = _streamed(hermes, body)
    assert (content, [(n, a) for _, n, a in calls], finish) == (
        "Let me check.",
        [WEATHER, TIME],
        "tool_calls",
    )
    assert len(chunks) > 10  # arguments arrive in pieces, as the tokens do
    for c in chunks:  # the held-back tag never leaks into content
        assert "<" not in (c.choices[0].delta.content or "")


def test_only_calls_give_null_content(hermes: RouterHarness, tok: Tokenizer) -> None:
    _reply(hermes, tok, f"<tool_call>\n{W}\n</tool_call>")
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 500}
    choice = _blocking(hermes, body).choices[0]
    assert choice.message.content is None and _calls(choice.message) == [WEATHER]
    _, content, calls, finish = _streamed(hermes, body)
    assert content is None and [(n, a) for _, n, a in calls] == [WEATHER] and finish == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first(hermes: RouterHarness, tok: Tokenizer) -> None:
    _reply(hermes, tok, HERMES_TEXT)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 500, "parallel_tool_calls": False}
    assert _calls(_blocking(hermes, body).choices[0].message) == [WEATHER]
    assert [(n, a) for _, n, a in _streamed(hermes, body)[2]] == [WEATHER]


def test_plain_text_and_tool_choice_none(hermes: RouterHarness, tok: Tokenizer) -> None:
    text = "No tools needed: 1 < 2."
    _reply(hermes, tok, text)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 500}
    choice = _blocking(hermes, body).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    assert _streamed(hermes, body)[1:] == (text, [], "stop")
    _reply(hermes, tok, HERMES_TEXT)  # none: the model's text is content, untouched
    none = {**body, "tool_choice": "none"}
    choice = _blocking(hermes, none).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        HERMES_TEXT,
        None,
        "stop",
    )
    assert _streamed(hermes, none)[1:] == (HERMES_TEXT, [], "stop")


def test_named_choice_output_is_the_arguments(hermes: RouterHarness, tok: Tokenizer) -> None:
    args = '{"tz": "Europe/Paris"}'
    _reply(hermes, tok, args)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 500}
    body["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    choice = _blocking(hermes, body).choices[0]
    assert _calls(choice.message) == [("get_time", args)] and choice.message.content is None
    assert choice.finish_reason == "stop"  # as vLLM: a named function keeps the engine's reason
    _, content, calls, finish = _streamed(hermes, body)
    assert (content, [(n, a) for _, n, a in calls], finish) == (None, [("get_time", args)], "stop")


def test_required_output_is_parsed_as_an_array(hermes: RouterHarness, tok: Tokenizer) -> None:
    _reply(hermes, tok, '[{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]')
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 500, "tool_choice": "required"}
    choice = _blocking(hermes, body).choices[0]
    assert _calls(choice.message) == [TIME] and choice.finish_reason == "tool_calls"
    assert _streamed(hermes, body)[3] == "tool_calls"


def test_prompt_renders_the_tools(hermes: RouterHarness, tok: Tokenizer) -> None:
    _reply(hermes, tok, "ok")
    _blocking(hermes, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 5})
    stage = hermes.stages["g0"]
    assert isinstance(stage, ScriptedStage)
    prompt = tok.decode(list(stage.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert (
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather <b>'
        in prompt
    )


def test_llama3_json_parser(qwen2_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; ' + T.replace(
        "arguments", "parameters"
    )
    with _router(qwen2_dir, tok, tmp_path, "llama3_json") as h:
        _reply(h, tok, text)
        body = {"messages": USER, "tools": TOOLS, "max_tokens": 500}
        choice = _blocking(h, body).choices[0]
        assert _calls(choice.message) == [WEATHER, TIME] and choice.finish_reason == "tool_calls"
        _, content, calls, finish = _streamed(h, body)
        assert (content, [(n, a) for _, n, a in calls], finish) == (None, [WEATHER, TIME], "tool_calls")


def test_auto_without_a_parser_is_400(qwen2_dir: Path, tok: Tokenizer, tmp_path: Path) -> None:
    with _router(qwen2_dir, tok, tmp_path, None) as h:
        _reply(h, tok, "hi")
        for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            r = _post(h, {"messages": USER, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        r = _post(h, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"


def test_tool_call_tags_as_added_tokens(qwen2_dir: Path, tmp_path: Path) -> None:
    """As in Qwen2.5's tokenizer, `<tool_call>` and `</tool_call>` are single added (non-special)
    tokens: the detokenizer gives them back whole and the parser reads them."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in ("tokenizer_config.json", "config.json"):
        (d / name).write_text((qwen2_dir / name).read_text())
    tok = Tokenizer.from_file(str(qwen2_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tok.save(str(d / "tokenizer.json"))
    text = f"<tool_call>\n{W}\n</tool_call>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<tool_call>") in ids and tok.token_to_id("</tool_call>") in ids
    with _router(d, tok, tmp_path, "hermes") as h:
        _reply(h, tok, text)
        body = {"messages": USER, "tools": TOOLS, "max_tokens": 500}
        choice = _blocking(h, body).choices[0]
        assert (choice.message.content, _calls(choice.message)) == (None, [WEATHER])
        _, content, calls, finish = _streamed(h, body)
        assert (content, [(n, a) for _, n, a in calls], finish) == (None, [WEATHER], "tool_calls")
