"""The OpenAPI description of chat's rendering fields and reasoning output.

router/api/chat_args.py reads the request fields and router/api/chat_output.py writes `reasoning_content`;
this module documents them and never contradicts them. The schema is stricter where that is
simpler: `add_generation_prompt` and `continue_final_message` inside chat_template_kwargs (the
parser takes them there too, as vLLM does) are left to the top-level fields. What only the
deployment's chat template knows (which variables it reads, what types it needs) is in words:
a value the template cannot use is a 400 naming chat_template_kwargs.
"""

from __future__ import annotations

from typing import Any

from pipeserve.router.api.chat_args import FLAGS, KWARGS, REFUSED


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


PROPERTIES: dict[str, Any] = {
    KWARGS: _nullable(
        {
            "type": "object",
            "propertyNames": {"not": {"enum": [*REFUSED, *FLAGS]}},
            "properties": {
                "enable_thinking": {
                    "type": "boolean",
                    "description": "Qwen3-style templates: false renders an empty thinking block, and "
                    "the qwen3 reasoning parser then gives no reasoning_content",
                }
            },
            "description": "variables for the chat template (vLLM's), over the special tokens; a "
            "value the deployment's template cannot use is a 400 naming chat_template_kwargs",
        }
    ),
    "add_generation_prompt": _nullable(
        {
            "type": "boolean",
            "description": "the template opens the assistant's turn; default true (false with "
            "continue_final_message)",
        }
    ),
    "continue_final_message": _nullable(
        {
            "type": "boolean",
            "default": False,
            "description": "the prompt ends inside the last message, which the model continues; not "
            "with add_generation_prompt true",
        }
    ),
}
# continue_final_message true refuses add_generation_prompt true.
RULES = [
    {
        "if": {
            "required": ["continue_final_message"],
            "properties": {"continue_final_message": {"const": True}},
        },
        "then": {"properties": {"add_generation_prompt": {"not": {"const": True}}}},
    }
]
# The response message's reasoning (with --reasoning-parser); streamed as delta.reasoning_content.
REASONING_CONTENT = {
    "type": ["string", "null"],
    "description": "the model's reasoning (<think>...</think>), with the server's --reasoning-parser",
}
