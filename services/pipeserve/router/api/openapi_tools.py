"""The OpenAPI description of chat's tool-calling fields (router/features/tools.py is the authority).

What a schema cannot say is in the descriptions: tool names are unique, a named tool_choice
names one of `tools`, `auto` needs the deployment's --tool-call-parser, a forced choice takes
no other structured output, a call's `arguments` is a JSON text.
"""

from __future__ import annotations

NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {**NAME, "description": "unique among the request's tools"},
                "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "parameters": {
                    "anyOf": [{"type": "object"}, {"type": "null"}],
                    "description": "the arguments' JSON schema (what a forced tool_choice enforces)",
                },
                "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            },
        },
    },
    "description": "given to the chat template as sent (transformers' apply_chat_template(tools=...))",
}
TOOLS = {"anyOf": [{"type": "array", "items": TOOL}, {"type": "null"}]}
TOOL_CHOICE = {
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {**NAME, "description": "one of the request's tools"}},
                },
            },
        },
        {"type": "null"},
    ],
    "description": "default: auto with tools, else none. Any but none needs tools; auto needs the server's "
    "--tool-call-parser; required and a named function are forced by a JSON-schema grammar (not "
    "combinable with response_format json_* or guided_*)",
}
PARALLEL = {
    "anyOf": [{"type": "boolean", "default": True}, {"type": "null"}],
    "description": "false: at most one call per choice",
}
CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "a JSON text; the template gets it decoded"},
            },
        },
    },
}
# Message fields: an assistant's tool_calls; a tool message's tool_call_id (required for role tool).
MESSAGE_PROPERTIES = {
    "tool_calls": {"anyOf": [{"type": "array", "items": CALL}, {"type": "null"}]},
    "tool_call_id": {"type": "string"},
}
MESSAGE_RULES = [
    {
        "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
        "then": {"required": ["tool_call_id"]},
    },
    {
        "if": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
        "then": {"properties": {"role": {"const": "assistant"}}},
    },
]
# Chat's response: a message may carry calls instead of content.
RESPONSE_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
RESPONSE_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string"},
        "content": {"type": ["string", "null"], "description": "null when the message only calls tools"},
        "tool_calls": {"type": "array", "items": RESPONSE_CALL},
    },
}
