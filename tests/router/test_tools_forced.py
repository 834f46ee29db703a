"""`tool_choice: required` and a named function, enforced end to end (needs guided_json on chat).

router/features/tools.py forces these choices by setting the request's `guided_json` to vLLM's schema;
the structured-output path enforces it on the live model. Whatever the (random) demo model
would write, the output then parses into calls whose arguments satisfy the tool's schema.
Enum-only parameters keep the forced outputs short.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from tools_support import QWEN_TOOLS_TEMPLATE

from serving_support import UpProcess, running_up

PARAMS = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "now": {"type": "boolean"}},
    "required": ["unit", "now"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_mood", "parameters": {**PARAMS, "required": ["now"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def client(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    tmp = tmp_path_factory.mktemp("forced")
    (tmp / "tools.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    args = ("--model", str(qwen2_dir), "--stages", "1", "--num-kv-blocks", "512")
    args += ("--chat-template", str(tmp / "tools.jinja"), "--tool-call-parser", "hermes")
    with running_up(*args, log_dir=tmp / "up") as server:
        yield _client(server)


def _client(server: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _create(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        # xgrammar's JSON allows any whitespace (as vLLM's): a frequency penalty keeps the random
        # demo model from writing it forever, the schema still decides every other token.
        frequency_penalty=2.0,
        **kw,
    )


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    got = _create(client, tool_choice="required", parallel_tool_calls=parallel)
    c = got.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = c.message.tool_calls or []
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not c.message.content
    streamed: dict[int, list[str]] = {}
    for chunk in _create(client, tool_choice="required", parallel_tool_calls=parallel, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (x.function.name, x.function.arguments) for x in calls
    ]


def test_named_function_gives_its_arguments(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_mood"}}
    c = _create(client, tool_choice=choice).choices[0]
    assert c.finish_reason == "stop"  # as vLLM: a named function keeps the engine's reason
    (call,) = c.message.tool_calls or []
    assert call.function.name == "get_mood"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_mood"])
