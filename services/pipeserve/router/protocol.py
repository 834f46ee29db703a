"""OpenAI request bodies -> validated internal requests carrying SamplingParams.

`parse_completion(body)` and `parse_chat(body)` take the decoded JSON body and
return a CompletionRequest / ChatRequest or raise APIError (400, naming the
field the client sent). Rules:
* Unknown fields are ignored (clients send extra ones); JSON null means "not
  given" for every optional field.
* The sampling fields are read by SamplingParams' own annotations (an `int`
  field takes a JSON integer, a `float` one a finite number, `list[str]` a
  string or a list of strings...), and range-checked by SamplingParams itself:
  the router and stage 0 run the same checks. Only `max_tokens` (chat's
  `max_completion_tokens`, default "up to the context") and `logprobs` (chat's
  `logprobs` + `top_logprobs`) differ per endpoint and are read here.
* Types are strict: an integer field (token ids included) takes a JSON integer
  or a float with an integral value (4.0, as pydantic's lax mode and so
  vLLM; JSON Schema's `integer` admits it too), not 1.5, a bool or a string;
  a number field a finite int/float (an integer too large for a
  float is refused, not an overflow), a bool field true/false.
* Text (prompt, message role/content/name, model, stop strings) must be
  valid Unicode: a lone surrogate ("\\ud800" in JSON) cannot be tokenized or
  echoed, so it is a 400 naming the field; messages never quote the value.
* `logit_bias` is an object mapping token ids (JSON strings of integers,
  as OpenAI's) to numbers; the ranges of it and of the penalties and
  `min_tokens` are SamplingParams' checks.
* Features the engine does not implement are refused, not ignored: n != 1,
  best_of != 1, echo, suffix, a response_format (completions: any; chat: other than text), tools,
  tool_choice, functions, `stream_options` without `stream: true`.
* `add_special_tokens` (vLLM's extension) is true by default for
  completions (the tokenizer's BOS, as `tokenizer(text)`), false for chat
  (the template writes it).
* What needs the tokenizer or the groups' limits (empty prompt, prompt
  length vs max_model_len, token ids vs vocab_size, max_tokens vs the
  context) is checked later by sampling_params.check_prompt /
  resolve_max_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from pipeserve.errors import InvalidRequestError
from pipeserve.router import errors
from pipeserve.sampling_params import SamplingParams, default_of

_MISSING = object()
_PER_ENDPOINT = ("max_tokens", "logprobs")  # read by each parser, not by their annotation


def _get(body: dict, key: str) -> Any:
    value = body.get(key, _MISSING)
    return _MISSING if value is None else value


def check_text(value: str, param: str) -> str:
    """`value`, if it encodes as UTF-8; a lone surrogate is a 400 that does not echo it."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise errors.invalid(
                param, f"contains a lone surrogate at character {e.start} (invalid Unicode)"
            ) from None
    return value


def _as_int(v: Any) -> int | None:
    """A JSON integer, or a float with an integral value (4.0), as pydantic's lax mode (and so vLLM)
    takes it; None for anything else (1.5, true, "4", NaN, inf)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _int(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    n = _as_int(v)
    if n is None:
        raise errors.invalid(key, f"must be an integer, got {_short(v)}")
    return n


def _number(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            f = float(v)  # an integer literal of hundreds of digits overflows here
        except OverflowError:
            f = math.inf
        if math.isfinite(f):
            return f
    raise errors.invalid(key, f"must be a finite number, got {_short(v)}")


def _bool(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise errors.invalid(key, f"must be a boolean, got {_short(v)}")
    return v


def _strings(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise errors.invalid(key, "must be a string or a list of strings")
    return [check_text(s, key) for s in v]


def _ints(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    ids = _token_list(v)
    if ids is None:
        raise errors.invalid(key, "must be a list of integers")
    return ids


def _short(v: Any) -> str:
    text = repr(v)  # repr escapes lone surrogates, so the message always renders
    return text if len(text) <= 40 else text[:37] + "..."


def _token_list(v: Any) -> list[int] | None:
    """`v` as a list of integers (see _as_int), or None when it is not one."""
    if not isinstance(v, list):
        return None
    ids = [_as_int(t) for t in v]
    return None if None in ids else ids  # type: ignore[return-value]


def _bias(body: dict, key: str, default: Any) -> Any:
    """OpenAI's logit_bias: {"token id": bias}; keys are decimal strings (or ints from a JSON-less client)."""
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, dict):
        raise errors.invalid(key, "must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for k, b in v.items():
        # At most 20 digits: int() raises past 4300 digits, and no vocabulary is that big.
        digits = isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 20
        t = int(k) if digits else (_as_int(k) if not isinstance(k, str) else None)
        if t is None or b is None:
            raise errors.invalid(key, f"must map token ids to numbers, got {_short(k)}: {_short(b)}")
        out[t] = _number({key: b}, key, 0.0)
    return out


# How each SamplingParams annotation is read from JSON. A field whose type is not here
# fails at import: give it a reader (or read it per endpoint).
_READERS = {
    int: _int,
    int | None: _int,
    float: _number,
    bool: _bool,
    list[str]: _strings,
    list[int]: _ints,
    dict[int, float]: _bias,
}
_HINTS = get_type_hints(SamplingParams)
_SAMPLING_FIELDS = [
    (f.name, _READERS[_HINTS[f.name]], default_of(f))
    for f in fields(SamplingParams)
    if f.name not in _PER_ENDPOINT
]


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


def _sampling(
    body: dict, max_tokens: int | None, max_tokens_param: str, logprobs: int | None
) -> SamplingParams:
    values = {name: read(body, name, default) for name, read, default in _SAMPLING_FIELDS}
    try:
        return SamplingParams(**values, max_tokens=max_tokens, logprobs=logprobs)
    except InvalidRequestError as e:
        param = max_tokens_param if e.param == "max_tokens" else e.param
        raise errors.invalid(param, e.message) from None


def _refuse_unsupported(body: dict) -> None:
    if _int(body, "n", 1) != 1:
        raise errors.invalid("n", "only n=1 is supported; send several prompts or requests instead")


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = _get(body, "stream_options")
    if options is _MISSING:
        return stream, False
    if not stream:
        raise errors.invalid("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise errors.invalid("stream_options", "must be an object")
    return stream, _bool(options, "include_usage", False)


def _model(body: dict) -> str | None:
    model = _get(body, "model")
    if model is _MISSING:
        return None
    if not isinstance(model, str):
        raise errors.invalid("model", f"must be a string, got {_short(model)}")
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
    if (ids := _token_list(prompt)) is not None:
        return [ids]
    prompts = [p if isinstance(p, str) else _token_list(p) for p in prompt]
    return None if None in prompts else prompts  # type: ignore[return-value]


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    prompt = _get(body, "prompt")
    if prompt is _MISSING:
        raise errors.invalid("prompt", "is required")
    prompts = _prompts(prompt)
    if prompts is None:
        raise errors.invalid(
            "prompt", "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    for p in prompts:
        if isinstance(p, str):
            check_text(p, "prompt")
    if _bool(body, "echo", False):
        raise errors.invalid("echo", "is not supported")
    if _int(body, "best_of", 1) != 1:
        raise errors.invalid("best_of", "only best_of=1 is supported")
    suffix = _get(body, "suffix")
    if suffix is not _MISSING and suffix != "":
        raise errors.invalid("suffix", "is not supported")
    if _get(body, "response_format") is not _MISSING:
        raise errors.invalid("response_format", "is not supported on /v1/completions")
    params = _sampling(body, _int(body, "max_tokens", 16), "max_tokens", _int(body, "logprobs", None))
    _refuse_unsupported(body)
    stream, include_usage = _stream_fields(body)
    return CompletionRequest(
        _model(body),
        prompts,
        params,
        stream,
        include_usage,
        _bool(body, "return_token_ids", False),
        _bool(body, "add_special_tokens", True),
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
    out = {**m, "role": role, "content": content}
    for key, value in out.items():  # every text the template may write into the prompt
        if isinstance(value, str):
            check_text(value, f"{param}.{key}")
    return out


def _refuse_tools(body: dict) -> None:
    for key in ("tools", "functions"):
        v = _get(body, key)
        if v is not _MISSING and v != []:
            raise errors.invalid(key, "tool calling is not supported")
    for key in ("tool_choice", "function_call"):
        v = _get(body, key)
        if v is not _MISSING and v != "none":
            raise errors.invalid(key, "tool calling is not supported")


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    messages = _get(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise errors.invalid("messages", "must be a non-empty list of messages")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    max_param = (
        "max_completion_tokens" if _get(body, "max_completion_tokens") is not _MISSING else "max_tokens"
    )
    max_tokens = _int(body, max_param, None)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not want_logprobs:
        raise errors.invalid("top_logprobs", "requires logprobs to be true")
    if top is not None and not 0 <= top <= 20:
        raise errors.invalid("top_logprobs", f"must be in [0, 20], got {_short(top)}")
    fmt = _get(body, "response_format")
    if fmt is not _MISSING and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise errors.invalid("response_format", "only {'type': 'text'} is supported")
    _refuse_tools(body)
    params = _sampling(body, max_tokens, max_param, (top or 0) if want_logprobs else None)
    _refuse_unsupported(body)
    stream, include_usage = _stream_fields(body)
    return ChatRequest(
        _model(body),
        parsed,
        params,
        stream,
        include_usage,
        _bool(body, "return_token_ids", False),
        _bool(body, "add_special_tokens", False),
        max_param,
    )
