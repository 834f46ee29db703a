"""Tool calling on /v1/chat/completions, as vLLM's OpenAI server does it (the router alone).

Request (`parse_tools(body)`, a 400 naming the exact field on anything ill-formed):
* `tools`: `[{"type": "function", "function": {name, description?, parameters?, strict?}}]`;
  names match OpenAI's `^[a-zA-Z0-9_-]{1,64}$` and are unique; `parameters` is a JSON-schema
  object. The chat template gets the list exactly as the client sent it (what
  `apply_chat_template(tools=...)` passes), also under `tool_choice: "none"` (as vLLM).
* `tool_choice`: `none` | `auto` | `required` | `{"type": "function", "function": {"name"}}`;
  default `auto` with tools, else `none`. Any but `none` needs tools (`required` with `tools: []`
  is `none`, as vLLM); a named function must be in `tools`; `auto` needs `--tool-call-parser`
  (a 400 naming `tool_choice`, checked by the handler: `check_parser`).
* `parallel_tool_calls` (default true): false keeps only a choice's first call.
* `required` and a named function are forced by a JSON-schema grammar, as vLLM builds it
  (`forced_schema`): the body's `guided_json` is set to it before sampling is read, so they
  cannot be combined with another structured output (response_format json_*, guided_*).
  Legacy `functions` / `function_call` are refused.
Messages (`message_fields`): an assistant's `tool_calls` reach the template with each
`function.arguments` JSON string decoded to an object (vLLM, and transformers' convention); a
`tool` message needs its `tool_call_id`.
Tools the template drops (`note_ignored_tools`): a chat template that never reads `tools` (the
default model's, SmolLM2's) renders the same prompt with and without them, so the model never
sees them. The request is served (as vLLM serves it), with a `Warning: 299 pipeserve "..."`
response header (router/http/app.py adds what a handler noted in `request.state.warnings`) and one log
line per template. docs/structured.md lists which templates render tools.
Responses: router/features/tool_output.py (`ToolCallOutput`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from pipeserve.chat_template import reads_tools
from pipeserve.router import errors

log = logging.getLogger("pipeserve.router")

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
# Fields that ask for another structured output (vLLM's guided_* and structured_outputs).
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolsSpec:
    tools: list[dict] | None  # as sent, for the template; None when the request has none
    choice: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the function a named choice forces
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")


NO_TOOLS = ToolsSpec(None, "none")


def _given(body: dict, key: str) -> Any:
    return body.get(key)  # JSON null means not given


def check_strings(value: Any, param: str) -> None:
    """Every text the template may write must be valid Unicode (a lone surrogate cannot be encoded)."""
    if isinstance(value, str):
        errors_at = _surrogate(value)
        if errors_at is not None:
            raise errors.invalid(param, f"contains a lone surrogate at character {errors_at}")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(k, param)
            check_strings(v, param)
    elif isinstance(value, list):
        for v in value:
            check_strings(v, param)


def _surrogate(text: str) -> int | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _tool(i: int, tool: Any, seen: set[str]) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise errors.invalid(param, "must be an object")
    if tool.get("type", "function") != "function":
        raise errors.invalid(f"{param}.type", "must be 'function'")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise errors.invalid(f"{param}.function", "must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise errors.invalid(f"{param}.function.name", "must match ^[a-zA-Z0-9_-]{1,64}$")
    if name in seen:
        raise errors.invalid(f"{param}.function.name", f"duplicates the name of an earlier tool ({name})")
    seen.add(name)
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object")):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            raise errors.invalid(f"{param}.function.{key}", f"must be {what}")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise errors.invalid(f"{param}.function.strict", "must be a boolean")
    check_strings(tool, param)
    return tool


def _choice(body: dict, names: list[str]) -> tuple[str, str | None]:
    choice = _given(body, "tool_choice")
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise errors.invalid("tool_choice", "must be 'none', 'auto', 'required' or a named function")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise errors.invalid("tool_choice", "must be 'none', 'auto', 'required' or a named function")
    fn = choice.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise errors.invalid("tool_choice.function.name", "must be a string")
    if fn["name"] not in names:
        raise errors.invalid("tool_choice.function.name", "names no function in tools")
    return "function", fn["name"]


def parse_tools(body: dict) -> ToolsSpec:
    for key, off in (("functions", []), ("function_call", "none")):
        v = _given(body, key)
        if v is not None and v != off:
            raise errors.invalid(key, "legacy function calling is not supported: use tools and tool_choice")
    raw = _given(body, "tools")
    if raw is not None and not isinstance(raw, list):
        raise errors.invalid("tools", "must be a list of tools")
    seen: set[str] = set()
    tools = [_tool(i, t, seen) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    parallel = _given(body, "parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise errors.invalid("parallel_tool_calls", "must be a boolean")
    choice, name = _choice(body, names)
    if choice == "required" and raw == []:
        choice = "none"  # as vLLM (and OpenAI): nothing to require
    if choice != "none" and not tools:
        raise errors.invalid("tool_choice", "needs a non-empty tools list")
    spec = ToolsSpec(tools if raw is not None else None, choice, name, parallel is not False)
    if spec.forced:
        fmt = _given(body, "response_format")
        if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
            raise errors.invalid("tool_choice", "a forced tool call cannot be combined with response_format")
        for key in _GUIDED:
            if _given(body, key) is not None:
                raise errors.invalid("tool_choice", f"a forced tool call cannot be combined with {key}")
    return spec


_warned_templates: set[int] = set()
TOOLS_IGNORED = "the chat template does not render tools: the model does not see the request's tools"


def note_ignored_tools(request: Any, spec: ToolsSpec, template: str | None) -> None:
    """Warn (a response header, a log line once per template) when `spec`'s tools reach a template
    that never reads them. `request`: the Starlette request (its `state.warnings`)."""
    if not spec.tools or template is None or reads_tools(template):
        return
    warnings = getattr(request.state, "warnings", None)
    if warnings is None:
        warnings = request.state.warnings = []
    warnings.append(TOOLS_IGNORED)
    if hash(template) not in _warned_templates:
        _warned_templates.add(hash(template))
        log.warning("%s (served anyway; docs/structured.md names templates that render tools)", TOOLS_IGNORED)


def check_parser(spec: ToolsSpec, parser: str | None) -> None:
    """`auto` parses the model's own calls: it needs a parser (as vLLM's --tool-call-parser)."""
    if spec.choice == "auto" and parser is None:
        raise errors.invalid(
            "tool_choice", '"auto" tool choice requires the router to be started with --tool-call-parser'
        )


def forced_schema(spec: ToolsSpec) -> dict | None:
    """The JSON schema forcing `required` / a named function (vLLM's), or None."""
    if not spec.forced or spec.tools is None:
        return None
    fns = {t["function"]["name"]: t["function"] for t in spec.tools}
    if spec.choice == "function":
        assert spec.name is not None
        return copy.deepcopy(fns[spec.name].get("parameters") or EMPTY_OBJECT_SCHEMA)
    alternatives = []
    defs: dict[str, Any] = {}
    for i, fn in enumerate(fns.values()):
        params = copy.deepcopy(fn.get("parameters") or EMPTY_OBJECT_SCHEMA)
        # Each schema's "#/$defs/..." references move with it into the array's root.
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise errors.invalid(
                    f"tools[{i}].function.parameters", f"$defs.{key} differs from another tool's"
                )
            defs[key] = value
        alternatives.append(
            {
                "properties": {"name": {"type": "string", "const": fn["name"]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    items = {"type": "object", "anyOf": alternatives}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not spec.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def message_fields(param: str, m: dict) -> dict:
    """The tool fields of message `param` as the template gets them (updates to the message)."""
    out: dict[str, Any] = {}
    role = m.get("role")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise errors.invalid(f"{param}.tool_call_id", "a tool message needs the id of its call")
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if role != "assistant":
        raise errors.invalid(f"{param}.tool_calls", "only assistant messages carry tool calls")
    if not isinstance(calls, list):
        raise errors.invalid(f"{param}.tool_calls", "must be a list")
    decoded = []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise errors.invalid(f"{where}.function.name", "must be a string")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise errors.invalid(f"{where}.id", "must be a string")
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                raise errors.invalid(f"{where}.function.arguments", "must be a JSON text") from None
        elif not args:
            args = {}
        elif not isinstance(args, dict | list):
            raise errors.invalid(f"{where}.function.arguments", "must be a JSON string")
        check_strings(call, where)
        decoded.append({**call, "function": {**fn, "arguments": args}})
    out["tool_calls"] = decoded
    return out
