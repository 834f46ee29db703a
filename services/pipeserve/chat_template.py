"""Chat templates rendered as transformers' `apply_chat_template(tokenize=False)` renders them.

The checkpoint's template is code from the hub: it runs in jinja2's immutable sandbox with what
transformers (5.x, `utils/chat_template_utils.py`) gives it, so a prompt is the same text:
* the environment: trim_blocks, lstrip_blocks, the loopcontrols extension, a `{% generation %}`
  block (transformers tracks assistant spans with it; here it renders its body), transformers'
  `tojson` filter (json.dumps: no HTML escaping, keys in their order), `raise_exception`,
  `strftime_now`, and a `namespace` that refuses underscore-prefixed names;
* the variables: `messages`, `tools` (None without tools), `documents`, `add_generation_prompt`,
  the tokenizer's special tokens, then the request's `chat_template_kwargs` (which override any
  of those but the four named ones; vLLM's `chat_template_kwargs`);
* a message's reasoning is aliased as transformers does (`reasoning_content`, `thinking`,
  `reasoning`: the first given fills `reasoning_content` and `thinking`), so a Qwen3 template
  sees an earlier turn's reasoning under the name it reads;
* `continue_final_message`: the prompt ends where the last message's content ends (no end of
  turn), found with transformers' marker, with its errors.
A template's own failure (`raise_exception`, a jinja error, any exception its code raises on the
request's values) is an InvalidRequestError naming the field that fed it: a 400, never a 500.
`reads_tools(source)`: whether a template reads the `tools` variable at all; one that does not
drops a request's tools (the router then says so: router/features/tools.py `note_ignored_tools`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeserve.errors import InvalidRequestError

# Names a message's reasoning is passed under (transformers' _REASONING_FIELDS).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' marker for the end of the message to continue.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(Exception):
    """`raise_exception(msg)` in a template."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter, not jinja2's (which escapes <>&' as HTML and sorts keys): tool schemas and
    # call arguments render as apply_chat_template renders them
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, rendered in place."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 declares it a set)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace without underscore-prefixed attributes (transformers' TemplateNamespace)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's own signature trick: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")


def compile_template(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.filters["tojson"] = _tojson
    return env.from_string(text)


@functools.lru_cache(maxsize=16)
def reads_tools(source: str) -> bool:
    """Whether the template's code reads `tools` anywhere (a template that does not renders a
    request's tools nowhere: SmolLM2's, Llama 2's, most base models'); False if it does not parse."""
    try:
        ast = compile_template("").environment.parse(source)
    except jinja2.TemplateError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def alias_reasoning(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def render(
    template: jinja2.Template,
    source: str,
    messages: list[dict],
    tools: list[dict] | None,
    special: dict[str, str],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text; `source` is the template's text (continue_final_message checks it)."""
    chat = alias_reasoning(messages)
    final = ""
    if continue_final_message:
        if "content" not in source:
            raise InvalidRequestError(
                "continue_final_message", "the chat template does not read a message's content"
            )
        final = chat[-1].get("content") or ""
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    variables = {**special, **(template_kwargs or {})}
    fed_by = "chat_template_kwargs" if template_kwargs else "messages"
    try:
        text = template.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except TemplateError as e:
        raise InvalidRequestError("messages", str(e)) from None
    except jinja2.TemplateError as e:
        raise InvalidRequestError(fed_by, f"chat template failed: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
        # the template's code on the request's values ('<s>' + a kwarg given as a number...)
        raise InvalidRequestError(fed_by, f"chat template failed: {type(e).__name__}: {e}") from None
    if continue_final_message:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise InvalidRequestError(
                "continue_final_message",
                "the final message does not appear in the prompt the chat template renders",
            )
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
