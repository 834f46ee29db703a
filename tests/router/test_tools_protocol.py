"""Tool-calling requests (router/features/tools.py): 400s naming the exact field, the template's inputs as
transformers gives them, and the JSON schemas that force `required` / a named function."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
from tools_support import QWEN_TOOLS_TEMPLATE, ROUND_TRIP, TIME, TOOLS, hf_messages
from transformers import AutoTokenizer

from pipeserve.config import TOOL_CALL_PARSERS, RouterConfig
from pipeserve.errors import ConfigError
from pipeserve.router.api.openapi import chat_request
from pipeserve.router.api.protocol import parse_chat
from pipeserve.router.errors import APIError
from pipeserve.router.features.tool_parsers import PARSERS
from pipeserve.router.features.tools import check_parser, forced_schema
from pipeserve.tokenizer import TokenizerAssets

USER = [{"role": "user", "content": "hi"}]


def _tool(name: object, **fn: object) -> dict:
    return {"type": "function", "function": {"name": name, **fn}}


BAD = [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [_tool("ok"), _tool("has space")]}, "tools[1].function.name"),
    ({"tools": [_tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [_tool("")]}, "tools[0].function.name"),
    ({"tools": [_tool(7)]}, "tools[0].function.name"),
    ({"tools": [_tool("f"), _tool("g"), _tool("f")]}, "tools[2].function.name"),
    ({"tools": [_tool("f", parameters=[1])]}, "tools[0].function.parameters"),
    ({"tools": [_tool("f", description=3)]}, "tools[0].function.description"),
    ({"tools": [_tool("f", strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [_tool("f", description="\ud800")]}, "tools[0]"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    (
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "guided_choice": ["a"],
        },
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
        "messages[0].tool_calls[0].function.name",
    ),
    ({"messages": [{"role": "assistant", "tool_calls": "f"}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_are_400_naming_the_field(extra: dict, param: str) -> None:
    with pytest.raises(APIError) as err:
        parse_chat({"messages": USER, **extra})
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_auto_needs_a_parser_and_none_does_not() -> None:
    spec = parse_chat({"messages": USER, "tools": TOOLS}).tools
    assert spec.choice == "auto" and spec.tools == TOOLS  # the default with tools
    with pytest.raises(APIError) as err:
        check_parser(spec, None)
    assert err.value.param == "tool_choice" and "--tool-call-parser" in err.value.message
    check_parser(spec, "hermes")
    none = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"}).tools
    check_parser(none, None)
    assert none.tools == TOOLS  # still rendered for the template, as vLLM
    assert parse_chat({"messages": USER, "tools": [], "tool_choice": "required"}).tools.choice == "none"
    assert parse_chat({"messages": USER}).tools.tools is None


def test_the_parser_names_are_the_flags() -> None:
    assert tuple(PARSERS) == TOOL_CALL_PARSERS


def test_tool_call_parser_config_is_validated(qwen2_dir: Path) -> None:
    assert RouterConfig(model=str(qwen2_dir), tool_call_parser="hermes").tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match="tool_call_parser"):
        RouterConfig(model=str(qwen2_dir), tool_call_parser="pythonic")


def _spec(**extra: object):
    return parse_chat({"messages": USER, "tools": TOOLS, **extra}).tools


def test_required_schema_accepts_calls_and_refuses_the_rest() -> None:
    schema = forced_schema(_spec(tool_choice="required"))
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = jsonschema.Draft202012Validator(schema)
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    time = {"name": "get_time", "parameters": {"tz": "UTC"}}
    assert ok.is_valid([weather]) and ok.is_valid([weather, time])
    for bad in (
        [],
        [{"name": "get_time", "parameters": {"city": "Paris"}}],
        [{"name": "other", "parameters": {}}],
    ):
        assert not ok.is_valid(bad), bad
    assert not ok.is_valid([{"name": "get_weather"}])
    single = jsonschema.Draft202012Validator(
        forced_schema(_spec(tool_choice="required", parallel_tool_calls=False))
    )
    assert single.is_valid([weather]) and not single.is_valid([weather, time])


def test_named_schema_is_the_functions_parameters() -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    assert forced_schema(_spec(tool_choice=choice)) == TIME["function"]["parameters"]
    bare = parse_chat(
        {
            "messages": USER,
            "tools": [_tool("ping")],
            "tool_choice": {"type": "function", "function": {"name": "ping"}},
        }
    )
    assert forced_schema(bare.tools) == {"type": "object", "properties": {}}
    assert forced_schema(_spec()) is None and forced_schema(_spec(tool_choice="none")) is None


def test_defs_move_to_the_required_schemas_root() -> None:
    params = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/place"}},
        "required": ["where"],
        "$defs": {"place": {"type": "string", "minLength": 2}},
    }
    spec = parse_chat(
        {"messages": USER, "tools": [_tool("go", parameters=params)], "tool_choice": "required"}
    ).tools
    v = jsonschema.Draft202012Validator(forced_schema(spec))
    assert v.is_valid([{"name": "go", "parameters": {"where": "Rome"}}])
    assert not v.is_valid([{"name": "go", "parameters": {"where": "R"}}])
    assert "$defs" in params  # the request's own tools are not changed


def test_forced_choice_sets_guided_json_before_sampling() -> None:
    """The structured-output path (guided_json) then enforces it; the body itself is not changed."""
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    parse_chat(body)
    assert "guided_json" not in body


def _hf(qwen2_dir: Path):
    return AutoTokenizer.from_pretrained(str(qwen2_dir))


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_render_equals_apply_chat_template(qwen2_dir: Path, tools: list | None) -> None:
    """Tools, assistant tool_calls (arguments decoded) and tool messages render as transformers does."""
    tok = TokenizerAssets.load(qwen2_dir, chat_template=QWEN_TOOLS_TEMPLATE)
    body: dict = {"messages": ROUND_TRIP}
    if tools is not None:
        body |= {"tools": tools, "tool_choice": "none"}
    req = parse_chat(body)
    got = tok.render_chat(req.messages, req.tools.tools)
    want = _hf(qwen2_dir).apply_chat_template(
        hf_messages(ROUND_TRIP),
        tools=tools,
        chat_template=QWEN_TOOLS_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert got == want
    assert '"description": "Current weather <b>in a city</b> & its \'feel\'"' in got or tools is None
    assert '{"city": "Zürich", "unit": "celsius"}' in got  # arguments as objects, tojson'd once


def test_openapi_documents_the_tool_fields() -> None:
    """A tool request valid by /openapi.json's chat schema parses; ill-formed names break the schema."""
    schema = chat_request()
    v = jsonschema.Draft202012Validator(schema)
    body = {
        "messages": ROUND_TRIP,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "parallel_tool_calls": False,
    }
    assert not list(v.iter_errors(body))
    assert parse_chat(body).tools.name == "get_time"
    assert not v.is_valid({**body, "tools": [_tool("two words")]})
    assert not v.is_valid({**body, "tool_choice": "sometimes"})
    assert not v.is_valid({"messages": [{"role": "tool", "content": "x"}]})  # no tool_call_id
