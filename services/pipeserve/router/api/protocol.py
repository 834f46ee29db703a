"""OpenAI request bodies -> validated internal requests carrying SamplingParams.

`parse_completion(body)` and `parse_chat(body)` take the decoded JSON body and
return a CompletionRequest / ChatRequest or raise APIError (400, naming the
field the client sent). Rules:
* Unknown fields are ignored (clients send extra ones); JSON null means "not
  given" for every optional field.
* The sampling fields are read by SamplingParams' own annotations
  (router/api/protocol_fields.py: an `int` field takes a JSON integer, a
  `float` one a finite number, `list[str]` a string or a list of strings...), and
  range-checked by SamplingParams itself: the router and stage 0 run the same checks.
  Only `max_tokens` (chat's `max_completion_tokens`, default "up to the context") and `logprobs` (chat's
  `logprobs` + `top_logprobs`) differ per endpoint and are read here.
* Types are strict: an integer field (token ids included) takes a JSON integer
  or a float with an integral value (4.0, as pydantic's lax mode and so
  vLLM; JSON Schema's `integer` admits it too), not 1.5, a bool or a string;
  a number field a finite int/float (an integer too large for a
  float is refused, not an overflow), a bool field true/false.
* Text (prompt, message role/content/name, model, stop strings) must be
  valid Unicode: a lone surrogate ("\\ud800" in JSON) cannot be tokenized or
  echoed, so it is a 400 naming the field; messages never quote the value.
* `n` (1..MAX_N, both endpoints) and `best_of` (completions: n..MAX_N, equal
  to n when streaming, as vLLM) are read here and fanned out by router/upstream/fanout.py.
* `echo` (completions) and `prompt_logprobs` (both): router/features/echo.py; `max_tokens: 0` only with echo.
* `logit_bias` is an object mapping token ids (JSON strings of integers,
  as OpenAI's) to numbers; the ranges of it and of the penalties and
  `min_tokens` are SamplingParams' checks.
* Features the engine does not implement are refused, not ignored:
  suffix, legacy functions/function_call,
  `stream_options` without `stream: true`.
* Chat's tools, tool_choice, parallel_tool_calls and the tool fields of
  messages are read by router/features/tools.py (`ChatRequest.tools`); a forced
  tool choice sets the body's `guided_json` before sampling is read.
  chat_template_kwargs, add_generation_prompt and continue_final_message
  are read by router/api/chat_args.py (`ChatRequest.chat_args`).
* Structured outputs (`response_format`, vLLM's `guided_*` and
  `structured_outputs`) are read by router/features/structured.py into the
  `structured*` sampling fields.
* A sampling field the body leaves unset takes the model's default (request_defaults.py, from its
  generation_config.json) before the endpoint's own; `max_tokens_from_model` marks a max_tokens that
  came from the model, which the context cuts instead of refusing.
* `add_special_tokens` (vLLM's extension) is true by default for
  completions (the tokenizer's BOS, as `tokenizer(text)`), false for chat
  (the template writes it).
* What needs the tokenizer or the groups' limits (empty prompt, prompt
  length vs max_model_len, token ids vs vocab_size, max_tokens vs the
  context) is checked later by sampling_params.check_prompt /
  resolve_max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pipeserve.errors import InvalidRequestError
from pipeserve.request_defaults import NO_DEFAULTS, RequestDefaults
from pipeserve.router import errors
from pipeserve.router.api.chat_args import ChatArgs, parse_chat_args
from pipeserve.router.api.protocol_fields import (
    MISSING,
    SAMPLING_FIELDS,
    check_text,
    read_bool,
    read_int,
    short,
    token_list,
    value_of,
)
from pipeserve.router.features.structured import StructuredSpec, parse_structured, sampling_fields
from pipeserve.router.features.tools import NO_TOOLS, ToolsSpec, forced_schema, message_fields, parse_tools
from pipeserve.sampling_fields import DEFAULT_MAX_TOKENS, MAX_LOGPROBS
from pipeserve.sampling_params import SamplingParams

MAX_N = 128  # choices (and best_of candidates) per prompt


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids in every choice and chunk
    add_special_tokens: bool = True
    max_tokens_param: str = "max_tokens"  # the field the client sent, for errors
    structured: StructuredSpec | None = None  # router/features/structured.py
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # candidates generated per prompt (>= n); the n most probable are returned
    echo: bool = False  # the prompt first in each choice (router/features/echo.py)
    max_tokens_zero: bool = False  # echo with max_tokens 0: one token is asked and dropped
    prompt_logprobs: int | None = None  # as the client asked (echo + logprobs asks stage 0 for more)
    max_tokens_from_model: bool = False  # the model's default: cut to the context, never refused


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    add_special_tokens: bool = False
    max_tokens_param: str = "max_tokens"
    tools: ToolsSpec = NO_TOOLS  # tools for the template, tool_choice, parallel_tool_calls (tools.py)
    structured: StructuredSpec | None = None  # router/features/structured.py
    n: int = 1
    best_of: int = 1
    # chat_template_kwargs, add_generation_prompt, continue_final_message (router/api/chat_args.py)
    chat_args: ChatArgs = field(default_factory=ChatArgs)
    max_tokens_from_model: bool = False  # the model's default: cut to the context, never refused


def _sampling(
    body: dict,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    structured: StructuredSpec | None = None,
    defaults: RequestDefaults = NO_DEFAULTS,
) -> SamplingParams:
    values = {
        name: read(body, name, defaults.value(name, default)) for name, read, default in SAMPLING_FIELDS
    }
    values.update(sampling_fields(structured))
    try:
        return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs)
    except InvalidRequestError as e:
        param = max_tokens_param if e.param == "max_tokens" else e.param
        raise errors.invalid(param, e.message) from None


def _n(body: dict) -> int:
    n = read_int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise errors.invalid("n", f"must be in [1, {MAX_N}], got {short(n)}")
    return n


def _best_of(body: dict, n: int, stream: bool) -> int:
    best_of = read_int(body, "best_of", n)
    if not n <= best_of <= MAX_N:
        raise errors.invalid("best_of", f"must be in [n, {MAX_N}] (n = {n}), got {short(best_of)}")
    if stream and best_of != n:
        raise errors.invalid("best_of", "must equal n when streaming (the best are known only at the end)")
    return best_of


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = read_bool(body, "stream", False)
    options = value_of(body, "stream_options")
    if options is MISSING:
        return stream, False
    if not stream:
        raise errors.invalid("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise errors.invalid("stream_options", "must be an object")
    return stream, read_bool(options, "include_usage", False)


def _model(body: dict) -> str | None:
    model = value_of(body, "model")
    if model is MISSING:
        return None
    if not isinstance(model, str):
        raise errors.invalid("model", f"must be a string, got {short(model)}")
    return check_text(model, "model")


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise errors.invalid(None, "the request body must be a JSON object")
    return body


def _prompts(prompt: Any) -> list[str | list[int]] | None:
    """A completion's `prompt` as a list of prompts (text or token ids), or None if it has no such shape."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        return None
    if (ids := token_list(prompt)) is not None:
        return [ids]
    prompts = [p if isinstance(p, str) else token_list(p) for p in prompt]
    return None if None in prompts else prompts  # type: ignore[return-value]


def parse_completion(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> CompletionRequest:
    body = _object(body)
    prompt = value_of(body, "prompt")
    if prompt is MISSING:
        raise errors.invalid("prompt", "is required")
    prompts = _prompts(prompt)
    if prompts is None:
        raise errors.invalid(
            "prompt", "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    for p in prompts:
        if isinstance(p, str):
            check_text(p, "prompt")
    echo = read_bool(body, "echo", False)
    suffix = value_of(body, "suffix")
    if suffix is not MISSING and suffix != "":
        raise errors.invalid("suffix", "is not supported")
    structured = parse_structured(body)
    max_tokens = read_int(body, "max_tokens", defaults.value("max_tokens", DEFAULT_MAX_TOKENS))
    from_model = value_of(body, "max_tokens") is MISSING and defaults.from_model(
        "max_tokens", DEFAULT_MAX_TOKENS
    )
    zero = echo and max_tokens == 0  # the prompt scored alone (vLLM): one token asked, then dropped
    logprobs = read_int(body, "logprobs", None)
    params = _sampling(body, 1 if zero else max_tokens, "max_tokens", logprobs, structured, defaults)
    asked_prompt_logprobs = params.prompt_logprobs
    if echo and logprobs is not None:  # the echoed tokens' logprobs come from the prompt's scores
        params = replace(params, prompt_logprobs=max(params.prompt_logprobs or 0, logprobs))
    stream, include_usage = _stream_fields(body)
    n = _n(body)
    return CompletionRequest(
        _model(body),
        prompts,
        params,
        stream,
        include_usage,
        read_bool(body, "return_token_ids", False),
        read_bool(body, "add_special_tokens", True),
        structured=structured,
        n=n,
        best_of=_best_of(body, n, stream),
        echo=echo,
        max_tokens_zero=zero,
        prompt_logprobs=asked_prompt_logprobs,
        max_tokens_from_model=from_model,
    )


def _message(i: int, m: Any) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise errors.invalid(param, "must be an object")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise errors.invalid(f"{param}.role", "must be a non-empty string")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise errors.invalid(f"{param}.content", "only text content parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise errors.invalid(f"{param}.content", "must be a string or a list of content parts")
    # None means absent (transformers' apply_chat_template drops such keys; templates test `is defined`)
    out = {k: v for k, v in m.items() if v is not None} | {"role": role, "content": content}
    out |= message_fields(param, out)  # tool_calls' arguments decoded for the template (tools.py)
    for key, value in out.items():  # every text the template may write into the prompt
        if isinstance(value, str):
            check_text(value, f"{param}.{key}")
    return out


def parse_chat(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> ChatRequest:
    body = _object(body)
    messages = value_of(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise errors.invalid("messages", "must be a non-empty list of messages")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    max_param = (
        "max_completion_tokens" if value_of(body, "max_completion_tokens") is not MISSING else "max_tokens"
    )
    max_tokens = read_int(body, max_param, defaults.value("max_tokens", None))
    from_model = value_of(body, max_param) is MISSING and defaults.from_model("max_tokens", None)
    want_logprobs = read_bool(body, "logprobs", False)
    top = read_int(body, "top_logprobs", None)
    if top is not None and not want_logprobs:
        raise errors.invalid("top_logprobs", "requires logprobs to be true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise errors.invalid("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {short(top)}")
    tools = parse_tools(body)
    if (schema := forced_schema(tools)) is not None:  # enforced through guided_json, as vLLM
        body = {**body, "guided_json": schema}
    structured = parse_structured(body, forced_by="tools" if schema is not None else None)
    params = _sampling(
        body, max_tokens, max_param, (top or 0) if want_logprobs else None, structured, defaults
    )
    stream, include_usage = _stream_fields(body)
    return ChatRequest(
        _model(body),
        parsed,
        params,
        stream,
        include_usage,
        read_bool(body, "return_token_ids", False),
        read_bool(body, "add_special_tokens", False),
        max_param,
        tools,
        structured,
        n=_n(body),
        chat_args=parse_chat_args(body),
        max_tokens_from_model=from_model,
    )
