"""Structured outputs in the request body -> one normalized spec (kind, text, compact, field).

Accepted spellings (both endpoints; OpenAI has `response_format` on chat only, vLLM takes it on
completions too):
* `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
* vLLM's `guided_json` (an object or a JSON string), `guided_regex`, `guided_choice` (a list of
  strings), `guided_grammar` (EBNF in xgrammar's GBNF dialect, with a `root` rule);
* vLLM's `structured_outputs`: {json | regex | choice | grammar | json_object: true} and
  `disable_any_whitespace` (JSON without free whitespace).
At most one kind per request: a second one is a 400 naming it. Only the shape is checked here (the
router never imports xgrammar), and the size (MAX_STRUCTURED_CHARS, SamplingParams' cap, named here
by the field the client sent): whether a schema, regex or grammar compiles is stage 0's check,
whose error (param "structured") `rename` turns into the field the client sent. A forced tool call
(router/features/tools.py) is a schema the router built from `tools`: its errors name `tools`
(`parse_structured(body, forced_by="tools")`), never a field the client did not send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeserve.router import errors
from pipeserve.sampling_params import MAX_STRUCTURED_CHARS

_MISSING = object()


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # "json", "json_object", "regex", "choice", "grammar"
    text: str
    compact: bool
    param: str  # the field the client sent, for errors


def _get(obj: dict, key: str) -> Any:
    v = obj.get(key, _MISSING)
    return _MISSING if v is None else v


def _schema_text(v: Any, param: str) -> str:
    """A JSON Schema given as an object (-> its JSON text, key order kept) or as JSON text (kept:
    whether it parses and compiles is stage 0's check, as any schema's)."""
    if isinstance(v, str):
        return _string(v, param)
    if not isinstance(v, dict):
        raise errors.invalid(param, "must be a JSON Schema object")
    try:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode().decode()
    except (ValueError, UnicodeEncodeError):
        raise errors.invalid(param, "is not valid JSON (NaN, infinity or a lone surrogate)") from None


def _string(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v:
        raise errors.invalid(param, "must be a non-empty string")
    try:
        v.encode()
    except UnicodeEncodeError:
        raise errors.invalid(param, "contains a lone surrogate (invalid Unicode)") from None
    return v


def _choice(v: Any, param: str) -> str:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise errors.invalid(param, "must be a non-empty list of non-empty strings")
    for c in v:
        _string(c, param)
    return json.dumps(v, ensure_ascii=False)


def _response_format(v: Any) -> tuple[str, str] | None:
    p = "response_format"
    if not isinstance(v, dict):
        raise errors.invalid(p, "must be an object with a 'type'")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise errors.invalid(f"{p}.json_schema", "must be an object with 'name' and 'schema'")
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise errors.invalid(f"{p}.json_schema.name", "must be a non-empty string")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise errors.invalid(f"{p}.json_schema.strict", "must be a boolean")
        schema = js.get("schema")
        if schema is None:  # OpenAI allows it out: any JSON object
            return "json_object", ""
        return "json", _schema_text(schema, f"{p}.json_schema.schema")
    raise errors.invalid(f"{p}.type", "must be 'text', 'json_object' or 'json_schema'")


def _structured_outputs(v: Any) -> tuple[list[tuple[str, str, str]], bool]:
    p = "structured_outputs"
    if not isinstance(v, dict):
        raise errors.invalid(p, "must be an object")
    found: list[tuple[str, str, str]] = []
    if (x := _get(v, "json")) is not _MISSING:
        found.append(("json", _schema_text(x, f"{p}.json"), f"{p}.json"))
    if (x := _get(v, "regex")) is not _MISSING:
        found.append(("regex", _string(x, f"{p}.regex"), f"{p}.regex"))
    if (x := _get(v, "choice")) is not _MISSING:
        found.append(("choice", _choice(x, f"{p}.choice"), f"{p}.choice"))
    if (x := _get(v, "grammar")) is not _MISSING:
        found.append(("grammar", _string(x, f"{p}.grammar"), f"{p}.grammar"))
    if (x := _get(v, "json_object")) is not _MISSING:
        if not isinstance(x, bool):
            raise errors.invalid(f"{p}.json_object", "must be a boolean")
        if x:
            found.append(("json_object", "", f"{p}.json_object"))
    if _get(v, "structural_tag") is not _MISSING:
        raise errors.invalid(f"{p}.structural_tag", "is not supported")
    compact = _get(v, "disable_any_whitespace")
    if compact is not _MISSING and not isinstance(compact, bool):
        raise errors.invalid(f"{p}.disable_any_whitespace", "must be a boolean")
    return found, compact is True


def parse_structured(body: dict, forced_by: str | None = None) -> StructuredSpec | None:
    """The request's one structured-output constraint, or None; a 400 naming the field when bad.
    `forced_by`: the body's guided_json is the router's schema for that field (a forced tool call)."""
    found: list[tuple[str, str, str]] = []
    compact = False
    if (v := _get(body, "response_format")) is not _MISSING:
        rf = _response_format(v)
        if rf is not None:
            found.append((*rf, "response_format"))
    for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if (v := _get(body, key)) is not _MISSING:
            read = {"json": _schema_text, "regex": _string, "choice": _choice}[kind]
            found.append((kind, read(v, key), key))
    if (v := _get(body, "guided_grammar")) is not _MISSING:
        found.append(("grammar", _string(v, "guided_grammar"), "guided_grammar"))
    if (v := _get(body, "structured_outputs")) is not _MISSING:
        more, compact = _structured_outputs(v)
        found += more
    if len(found) > 1:
        raise errors.invalid(
            found[1][2], f"only one structured output per request: {found[0][2]} is given already"
        )
    if not found:
        return None
    kind, text, param = found[0]
    if forced_by is not None and param == "guided_json":
        param = forced_by
        compact = True  # a forced call's JSON: no free whitespace to spend the budget on (vLLM's choice)
    if len(text) > MAX_STRUCTURED_CHARS:
        cap = f"more than the {MAX_STRUCTURED_CHARS} a structured output may have"
        if param == forced_by:
            raise errors.invalid(
                param,
                f"forcing a tool call (tool_choice) needs a schema of every tool's parameters: "
                f"{len(text)} characters, {cap}; send fewer tools, or tool_choice 'auto'",
            )
        raise errors.invalid(param, f"has {len(text)} characters, {cap}")
    return StructuredSpec(kind, text, compact, param)


def sampling_fields(spec: StructuredSpec | None) -> dict[str, Any]:
    """The SamplingParams fields of a spec (none: the defaults)."""
    if spec is None:
        return {}
    return {"structured_kind": spec.kind, "structured": spec.text, "structured_compact": spec.compact}


def rename(e: errors.APIError, spec: StructuredSpec | None) -> errors.APIError:
    """Stage 0's "structured" error names the field the client sent."""
    if spec is not None and e.param in ("structured", "structured_compact"):
        return errors.invalid(spec.param, e.message)
    return e
