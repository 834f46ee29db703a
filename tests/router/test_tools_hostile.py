"""Tool calls under hostile or careless requests (issue 29 point 5), through the live router.

A scripted stage (real gRPC, the real demo tokenizer's ids, cut at max_tokens with finish_reason
"length" as a stage cuts it) stands behind a router serving Qwen's tools template, or the demo
model's own template, which never reads `tools`:
* a forced call cut by max_tokens is `finish_reason: "length"`, and the blocking message does not
  present the cut arguments as a call (the calls completed before it stay);
* a forced call compiles without free whitespace (structured_compact), so its budget is not spent
  on spaces;
* 500 tools under `required` exceed the structured-output cap with a schema the router built: the
  400 names `tools`, never `structured` (a field the client never sent); a forced schema stage 0
  cannot compile names `tools` too;
* tools sent to a template that ignores them are served with a `Warning` header.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer
from tools_support import QWEN_TOOLS_TEMPLATE, TOOLS

from pipeserve.router import errors
from pipeserve.router.api.protocol import parse_chat
from pipeserve.router.features import structured
from pipeserve.router.features.tools import TOOLS_IGNORED
from router_support import RouterHarness, ScriptedStage

USER = [{"role": "user", "content": "Time in Paris?"}]
REQUIRED = '[{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]'
TWO = (
    '[{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}, '
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
)


@pytest.fixture(scope="module")
def tok(qwen2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def router(
    qwen2_dir: Path, tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterHarness]:
    tmp = tmp_path_factory.mktemp("hostile-tools")
    (tmp / "tools.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    stage = ScriptedStage([], vocab_size=tok.get_vocab_size(), max_model_len=4096)
    with RouterHarness(qwen2_dir, {"g0": stage}, chat_template=str(tmp / "tools.jinja")) as h:
        yield h


def _reply(h: RouterHarness, tok: Tokenizer, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False).ids
    stage = h.stages["g0"]
    assert isinstance(stage, ScriptedStage)
    h.call(lambda: setattr(stage, "reply", ids))
    return len(ids)


def _tokens_to(tok: Tokenizer, text: str, prefix: str) -> int:
    """How many of `text`'s tokens it takes to hold `prefix`."""
    ids = tok.encode(text, add_special_tokens=False).ids
    for n in range(1, len(ids) + 1):
        if tok.decode(ids[:n]).startswith(prefix):
            return n
    raise AssertionError(prefix)


def _stream_finish(h: RouterHarness, body: dict) -> tuple[str | None, dict[int, str]]:
    finish, args = None, {}
    with httpx.stream("POST", h.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[6:])["choices"]
            for tc in choice["delta"].get("tool_calls") or []:
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return finish, args


def test_a_forced_call_cut_by_max_tokens_is_length_and_not_a_call(
    router: RouterHarness, tok: Tokenizer
) -> None:
    _reply(router, tok, REQUIRED)
    cut = _tokens_to(tok, REQUIRED, '[{"name": "get_time", "parameters": {"tz": "Eur')
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": cut}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    choice = ChatCompletion.model_validate(r.json()).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls, choice.message  # '{"tz": "Eur' is no call to make
    finish, args = _stream_finish(router, body)
    assert finish == "length" and list(args) == [0]  # pieces sent before the cut was known
    assert args[0].startswith('{"tz": "Eur') and not args[0].endswith("}")
    # Named: the whole output is the arguments.
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    _reply(router, tok, '{"tz": "Europe/Paris"}')
    named["max_tokens"] = _tokens_to(tok, '{"tz": "Europe/Paris"}', '{"tz": "Eur')
    r = httpx.post(router.url + "/v1/chat/completions", json=named, timeout=30)
    choice = ChatCompletion.model_validate(r.json()).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls


def test_calls_completed_before_the_cut_stay(router: RouterHarness, tok: Tokenizer) -> None:
    _reply(router, tok, TWO)
    cut = _tokens_to(tok, TWO, TWO[: TWO.index('"city"') + 4])
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": cut}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    choice = ChatCompletion.model_validate(r.json()).choices[0]
    assert choice.finish_reason == "length"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert calls == [("get_time", '{"tz": "Europe/Paris"}')]
    whole = httpx.post(router.url + "/v1/chat/completions", json={**body, "max_tokens": 500}, timeout=30)
    assert whole.json()["choices"][0]["finish_reason"] == "tool_calls"  # not cut: as before


def test_forced_calls_compile_without_free_whitespace() -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    assert parse_chat(body).params.structured_compact is True
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    assert parse_chat(named).params.structured_compact is True
    # A forced schema stage 0 refuses ("structured: ...") names the field the client sent: tools.
    assert structured.rename(errors.invalid("structured", "x"), parse_chat(named).structured).param == "tools"
    # response_format follows the client's choice (vLLM's structured_outputs.disable_any_whitespace).
    fmt = {"messages": USER, "response_format": {"type": "json_object"}}
    assert parse_chat(fmt).params.structured_compact is False
    fmt["structured_outputs"] = {"disable_any_whitespace": True}
    assert parse_chat(fmt).params.structured_compact is True


def _many_tools(n: int) -> list[dict]:
    params = {
        "type": "object",
        "properties": {f"field_{k}": {"type": "string", "description": "x" * 40} for k in range(8)},
    }
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": params}} for i in range(n)]


def test_500_tools_under_required_name_tools_not_an_internal_field(router: RouterHarness) -> None:
    body = {"messages": USER, "tools": _many_tools(500), "tool_choice": "required", "max_tokens": 5}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "forcing a tool call" in err["message"], err


def test_a_response_format_over_the_cap_names_its_own_field(router: RouterHarness) -> None:
    schema = {"type": "object", "properties": {"x": {"enum": [f"v{i:06d}" for i in range(30000)]}}}
    body = {"messages": USER, "max_tokens": 5, "response_format": {"type": "json_schema"}}
    body["response_format"]["json_schema"] = {"name": "big", "schema": schema}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_tools_a_template_ignores_are_served_with_a_warning(
    llama_dir: Path, router: RouterHarness, tok: Tokenizer
) -> None:
    _reply(router, tok, "ok")
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    rendered = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert rendered.status_code == 200 and "warning" not in rendered.headers  # Qwen's renders them
    stage = ScriptedStage(
        [5, 6, 7], vocab_size=Tokenizer.from_file(str(llama_dir / "tokenizer.json")).get_vocab_size()
    )
    with RouterHarness(llama_dir, {"g0": stage}) as h:  # the demo model's template reads no `tools`
        r = httpx.post(h.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["warning"] == f'299 pipeserve "{TOOLS_IGNORED}"'
        with_tools = r.json()["usage"]["prompt_tokens"]
        plain = httpx.post(h.url + "/v1/chat/completions", json={**body, "tools": None}, timeout=30)
        assert "warning" not in plain.headers
        assert plain.json()["usage"]["prompt_tokens"] == with_tools  # what the warning is about
        with httpx.stream(
            "POST", h.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
        ) as s:
            assert s.status_code == 200 and s.headers["warning"].startswith("299 pipeserve")
