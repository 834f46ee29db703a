"""The OpenAPI description of the two generation endpoints' request and response bodies.

app.py passes `COMPLETIONS` / `CHAT` as the routes' `openapi_extra`, so
`GET /openapi.json` describes what router/api/protocol.py accepts. The parser is
the authority; this module documents it and must never contradict it:
* Anything valid by this schema passes protocol.py's checks. What only the
  deployment knows (the served model names, the context length, the
  vocabulary, max_concurrency for a batch of prompts) is said in the
  descriptions, not in the schema: such a request may still be refused with a
  400 (404 for an unknown model) naming the field.
* The sampling fields are generated from the one field list (sampling_fields.py:
  type, default, bounds, help), so a new sampling field appears here by itself
  with the bounds `SamplingParams.validate` enforces (tests/test_sampling_fields.py
  compares them with the list, tests/router/test_openapi_schema.py each bound
  with the validator); `_SHAPES` adds what is not a numeric bound (stop's
  lengths, logit_bias's size). A field whose type has no entry in `_TYPES`
  fails at import, as in protocol.py.
* JSON null means "not given" for every optional field, so each is nullable.
* Fields the engine does not implement are described by the one value they
  may take (tools empty...): any other is a 400. Cross-field rules
  JSON Schema cannot state (best_of >= n, min_tokens <= max_tokens) are in words, the schema stricter.
* Responses: 200 as JSON, or as text/event-stream (`data: {chunk}` events
  ending with `data: [DONE]`) when `stream` is true; errors in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from pipeserve.detokenize import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pipeserve.router.api import openapi_chat, openapi_tools
from pipeserve.router.api.openapi_structured import structured_properties
from pipeserve.router.api.protocol import MAX_N
from pipeserve.router.api.protocol_fields import PER_ENDPOINT  # each endpoint documents these its own way
from pipeserve.sampling_fields import DEFAULT_MAX_TOKENS, FIELDS, MAX_LOGPROBS, SAMPLING_FIELDS, SamplingField
from pipeserve.sampling_params import MAX_LOGIT_BIAS

# A stop string's length bound that keeps any schema-valid list under the total cap.
_STOP_ITEM_CHARS = MAX_STOP_CHARS // MAX_STOP_STRINGS

_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": _STOP_ITEM_CHARS}
_TYPES: dict[Any, dict] = {
    int: {"type": "integer"},
    int | None: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    list[str]: {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING}]},
    list[int]: {"type": "array", "items": {"type": "integer"}},
    dict[int, float]: {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]{1,20}$"},
        "additionalProperties": {"type": "number"},
    },
}
_SHAPES: dict[str, dict] = {
    "stop": {
        "description": f"at most {MAX_STOP_STRINGS} non-empty strings of {MAX_STOP_CHARS} characters in all",
        "anyOf": [
            {**_STOP_STRING, "maxLength": MAX_STOP_CHARS},
            {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS},
        ],
    },
    "stop_token_ids": {
        "items": {"type": "integer", "minimum": 0},
        "description": "token ids in the model's vocabulary",
    },
    "logit_bias": {
        "maxProperties": MAX_LOGIT_BIAS,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (in the model's vocabulary) -> bias added to its logit",
    },
}


def bounds(spec: SamplingField) -> dict:
    """A field's numeric bounds from the field list, as JSON Schema says them."""
    out: dict[str, Any] = {}
    if spec.minimum is not None:
        out["exclusiveMinimum" if spec.exclusive_minimum else "minimum"] = spec.minimum
    if spec.maximum is not None:
        out["maximum"] = spec.maximum
    return out


def nullable(schema: dict) -> dict:
    """`schema` or JSON null (null means "not given")."""
    return {"anyOf": [schema, {"type": "null"}]}


def _only(value: Any, kind: str, what: str = "not supported") -> dict:
    return nullable({"type": kind, "enum": [value], "description": f"{what}: only {value!r} is accepted"})


def sampling_field(name: str) -> dict:
    """The schema of one sampling field: its JSON type, default, validated range and help."""
    spec = FIELDS[name]
    text = spec.help
    if spec.model_default:  # request_defaults.py: the model's value comes before `default`
        text += f"; unset: the model's generation_config.json {spec.model_default} if it has one"
    help_text = {"description": text} if text else {}
    schema = {**_TYPES[spec.type], **help_text, **bounds(spec), **_SHAPES.get(name, {})}
    if "items" in schema and "items" in _TYPES[spec.type]:
        schema["items"] = {**_TYPES[spec.type]["items"], **schema["items"]}
    default = list(spec.default) if isinstance(spec.default, tuple) else spec.default
    return {**nullable(schema), "default": default}


def sampling_fields() -> dict[str, dict]:
    return {f.name: sampling_field(f.name) for f in SAMPLING_FIELDS if f.name not in PER_ENDPOINT}


_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0},
    "description": "token ids in the model's vocabulary",
}
_COMMON = {
    "model": nullable(
        {"type": "string", "description": "a served model name (404 otherwise); default: the first"}
    ),
    "stream": nullable({"type": "boolean", "default": False}),
    "stream_options": nullable(
        {
            "type": "object",
            "properties": {"include_usage": nullable({"type": "boolean", "default": False})},
            "description": "only with stream: true",
        }
    ),
    "return_token_ids": nullable({"type": "boolean", "default": False}),
    "user": nullable({"type": "string"}),
    "n": nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_N,
            "default": 1,
            "description": "choices per prompt (index = prompt index x n + j); with a seed, choice j "
            "samples with seed + j; each prompt's n (or best_of) requests count against max_concurrency",
        }
    ),
}
# stream_options is refused unless stream is true (protocol._stream_fields).
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _request(required: list[str], properties: dict, extra: dict | None = None) -> dict:
    # Unknown fields are ignored by the parser; the schema lists only the fields it reads.
    return {"type": "object", "required": required, "properties": properties, **(extra or {})}


def completion_request() -> dict:
    text = {"type": "string", "minLength": 1}
    prompt = {
        "description": "a string, a list of strings, token ids, or a list of token-id lists (a batch: "
        "one choice per prompt, at most max_concurrency prompts); the prompt plus max_tokens must fit "
        "the model's context",
        "anyOf": [text, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": {"anyOf": [text, _TOKEN_IDS]}}],
    }
    props = {
        "prompt": prompt,
        **_COMMON,
        **sampling_fields(),
        "max_tokens": sampling_field("max_tokens") | {"default": DEFAULT_MAX_TOKENS},
        "logprobs": sampling_field("logprobs"),
        "add_special_tokens": nullable({"type": "boolean", "default": True}),
        "echo": nullable(
            {
                "type": "boolean",
                "default": False,
                "description": "the prompt first in each choice's text (and, with logprobs, its tokens "
                "first, the first one null); max_tokens 0 is allowed with echo only",
            }
        ),
        "best_of": nullable(
            {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_N,
                "description": "candidates per prompt, >= n (default n); the n of highest cumulative "
                "logprob are returned; must equal n when streaming",
            }
        ),
        "suffix": _only("", "string"),
        **structured_properties(),
    }
    # best_of >= n and == n when streaming: cross-field rules JSON Schema cannot compare; the schema
    # admits best_of only with n 1 (or unset) and without stream (the parser accepts more).
    best_of_rule = {
        "if": {"required": ["best_of"], "properties": {"best_of": {"type": "integer"}}},
        "then": {
            "properties": {
                "n": {"anyOf": [{"type": "null"}, {"const": 1}]},
                "stream": {"anyOf": [{"type": "null"}, {"const": False}]},
            }
        },
    }
    return _request(["prompt"], props, {"allOf": [_STREAM_OPTIONS_NEED_STREAM, best_of_rule]})


def chat_request() -> dict:
    part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "minLength": 1},
            "content": nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}),
            "name": {"type": "string"},
            **openapi_tools.MESSAGE_PROPERTIES,
        },
        "allOf": openapi_tools.MESSAGE_RULES,
        "description": "rendered by the model's chat template",
    }
    max_tokens = sampling_field("max_tokens") | {"default": None}
    props = {
        "messages": {"type": "array", "minItems": 1, "items": message},
        **_COMMON,
        **sampling_fields(),
        "max_tokens": max_tokens,
        "max_completion_tokens": {**max_tokens, "description": "overrides max_tokens; default: the context"},
        "logprobs": nullable({"type": "boolean", "default": False}),
        "top_logprobs": nullable(
            {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "description": "needs logprobs"}
        ),
        "add_special_tokens": nullable({"type": "boolean", "default": False}),
        **structured_properties(),
        "tools": openapi_tools.TOOLS,
        "tool_choice": openapi_tools.TOOL_CHOICE,
        "parallel_tool_calls": openapi_tools.PARALLEL,
        "functions": nullable(
            {"type": "array", "maxItems": 0, "description": "legacy function calling is not supported"}
        ),
        "function_call": _only("none", "string", "legacy function calling is not supported"),
        **openapi_chat.PROPERTIES,
    }
    top_logprobs_need_logprobs = {
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }
    rules = [_STREAM_OPTIONS_NEED_STREAM, top_logprobs_need_logprobs, *openapi_chat.RULES]
    return _request(["messages"], props, {"allOf": rules})


# --- responses ------------------------------------------------------------------
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "invalid request (the field is named in `param`), including deployment limits: the context "
    "length, the vocabulary, a batch over max_concurrency",
    "401": "missing or wrong API key (when the server has one)",
    "404": "unknown model",
    "408": "the request's headers or body did not arrive in time",
    "413": "request body too large",
    "429": "too many requests in flight",
    "503": "no pipeline group is ready",
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
}


def _response(obj: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [obj]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


def _choice(body: dict) -> dict:
    return {
        "type": "object",
        "required": ["index", *body, "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            **body,
            "logprobs": {"type": ["object", "null"]},
            "finish_reason": {"type": ["string", "null"]},
            "token_ids": {"type": "array", "items": {"type": "integer"}},
            "prompt_token_ids": {"type": "array", "items": {"type": "integer"}},
        },
    }


def _chat_message() -> dict:
    message: dict[str, Any] = openapi_tools.RESPONSE_MESSAGE
    properties = {**message["properties"], "reasoning_content": openapi_chat.REASONING_CONTENT}
    return {**message, "properties": properties}


# One server-sent event: `data` is a JSON chunk (or an error object), the last one `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _operation(summary: str, request: dict, response: dict) -> dict:
    stream = "with stream: true, `data: {chunk}` server-sent events ending with `data: [DONE]`"
    responses = {
        "200": {
            "description": f"the generation (JSON), or {stream}",
            "content": {
                "application/json": {"schema": response},
                "text/event-stream": {"schema": _SSE_EVENT},
            },
        }
    }
    for status, why in _ERRORS.items():
        responses[status] = {"description": why, "content": {"application/json": {"schema": ERROR}}}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": responses,
    }


COMPLETIONS = _operation(
    "Create a completion",
    completion_request(),
    _response("text_completion", _choice({"text": {"type": "string"}})),
)
CHAT = _operation(
    "Create a chat completion",
    chat_request(),
    _response(
        "chat.completion",
        _choice({"message": _chat_message()}),
    ),
)
