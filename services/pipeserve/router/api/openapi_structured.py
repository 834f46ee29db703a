"""The OpenAPI description of the structured-output fields (router/features/structured.py reads them).

Both endpoints take every spelling. What the schema cannot say is said in words: at most one
kind per request (a second is a 400 naming it: "only one structured output"), and a schema,
regex or grammar that stage 0 cannot compile is a 400 naming the field ("does not compile").
"""

from __future__ import annotations

from typing import Any

_ONE = "At most one structured output per request (response_format other than text, guided_*, "
_ONE += "structured_outputs): a second is a 400 naming it."
_COMPILES = "Compiled by the group (xgrammar); one that does not compile is a 400 naming this field."


def _n(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _schema(what: str) -> dict:
    return {
        "anyOf": [
            {"type": "object"},
            {"type": "string", "minLength": 1, "description": "a JSON Schema as JSON text"},
        ],
        "description": f"{what}. {_COMPILES}",
    }


_CHOICE = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "string", "minLength": 1},
    "description": "the output is exactly one of these strings",
}
_TEXT = {"type": "string", "minLength": 1}


def structured_properties() -> dict[str, Any]:
    json_schema = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "description": {"type": "string"},
            "schema": {"type": "object", "description": f"the JSON Schema of the output. {_COMPILES}"},
            "strict": _n({"type": "boolean"}),
        },
    }
    response_format = {
        "oneOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema},
            },
        ],
        "description": f"OpenAI's response format (vLLM takes it on completions too). {_ONE}",
    }
    return {
        "response_format": _n(response_format),
        "guided_json": _n(_schema("vLLM: the output follows this JSON Schema")),
        "guided_regex": _n({**_TEXT, "description": f"vLLM: the output matches this regex. {_COMPILES}"}),
        "guided_choice": _n(_CHOICE),
        "guided_grammar": _n(
            {**_TEXT, "description": f"vLLM: an EBNF (GBNF) grammar with a `root` rule. {_COMPILES}"}
        ),
        "structured_outputs": _n(
            {
                "type": "object",
                "properties": {
                    "json": _n(_schema("the output follows this JSON Schema")),
                    "regex": _n({**_TEXT, "description": _COMPILES}),
                    "choice": _n(_CHOICE),
                    "grammar": _n({**_TEXT, "description": f"EBNF (GBNF), `root` rule. {_COMPILES}"}),
                    "json_object": _n({"type": "boolean", "description": "true: any JSON object"}),
                    "disable_any_whitespace": _n(
                        {"type": "boolean", "default": False, "description": "JSON without free whitespace"}
                    ),
                },
                "description": f"vLLM: one of json, regex, choice, grammar, json_object. {_ONE}",
            }
        ),
    }
