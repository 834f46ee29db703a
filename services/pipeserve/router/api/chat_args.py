"""How a chat request asks its prompt to be rendered (vLLM's extra fields of chat completions).

* `chat_template_kwargs`: an object whose entries the chat template sees as variables (e.g.
  `{"enable_thinking": false}` for Qwen3), after the special tokens, which they may override.
  `chat_template` and `tokenize` are refused as vLLM refuses them; `messages` and `tools` too
  (the request's own fields say them); `add_generation_prompt` and `continue_final_message`
  inside it stand for the fields below (vLLM merges the kwargs over them). Every text in it must be
  valid Unicode (it is written into the prompt).
* `add_generation_prompt` (default true, or false with continue_final_message): the template
  opens the assistant's turn.
* `continue_final_message` (default false): the prompt ends inside the last message, which the
  model continues (a prefill); it cannot be combined with `add_generation_prompt` (as
  transformers and vLLM refuse it).
Each mistake is a 400 naming the field. The reasoning parser reads the same kwargs
(router/features/reasoning.py: `enable_thinking`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeserve.router import errors
from pipeserve.router.features.tools import check_strings

KWARGS = "chat_template_kwargs"
REFUSED = {
    "chat_template": "the template is the server's (--chat-template)",
    "tokenize": "the router tokenizes the rendered prompt itself",
    "messages": "the request's messages are the template's messages",
    "tools": "the request's tools are the template's tools",
}
FLAGS = ("add_generation_prompt", "continue_final_message")


@dataclass(frozen=True)
class ChatArgs:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def _flag(value: Any, param: str) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, bool):
        raise errors.invalid(param, "must be a boolean")
    return value


def parse_chat_args(body: dict) -> ChatArgs:
    raw = body.get(KWARGS)
    kwargs: dict[str, Any] = {}
    if raw is not None:
        if not isinstance(raw, dict):
            raise errors.invalid(KWARGS, "must be an object (variables for the chat template)")
        for key, why in REFUSED.items():
            if key in raw:
                raise errors.invalid(f"{KWARGS}.{key}", f"is not accepted: {why}")
        check_strings(raw, KWARGS)
        kwargs = {k: v for k, v in raw.items() if k not in FLAGS}
    given = {}
    for name in FLAGS:
        top = _flag(body.get(name), name)
        inner = _flag(raw.get(name), f"{KWARGS}.{name}") if raw is not None else None
        given[name] = inner if inner is not None else top
    cont = bool(given["continue_final_message"])
    gen = given["add_generation_prompt"]
    if cont and gen:
        raise errors.invalid(
            "continue_final_message",
            "cannot be combined with add_generation_prompt: the model continues the last message "
            "instead of opening a new one (set add_generation_prompt to false)",
        )
    return ChatArgs(not cont if gen is None else gen, cont, kwargs)
