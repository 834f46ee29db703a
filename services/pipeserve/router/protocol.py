"""OpenAI request bodies -> validated internal requests.

`parse_completion(body)` and `parse_chat(body)` take the decoded JSON body and
return a CompletionRequest / ChatRequest or raise APIError (400, naming the
field). Rules:
* Unknown fields are ignored (clients send extra ones); JSON null means "not
  given" for every optional field.
* Types are strict: an integer field takes a JSON integer (not a bool, not a
  string), a number field a finite int/float, a bool field true/false.
* Ranges follow vLLM/OpenAI (temperature >= 0, top_p in (0, 1], logprobs
  0..20, max_tokens >= 1 ...); the sampling ranges are SamplingParams' own
  checks, so the router and stage 0 agree on what is valid.
* Features the engine does not implement are refused, not ignored: n != 1,
  best_of != 1, echo, non-zero penalties, logit_bias, a JSON response_format.
* What needs the tokenizer or the groups' limits (empty prompt after
  tokenization, prompt length vs max_model_len, token ids vs vocab_size) is
  checked later by `check_prompt` / `GenParams.to_proto`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pipeserve.errors import InvalidRequestError
from pipeserve.router import errors
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.sampling_params import SamplingParams

_MISSING = object()


def _get(body: dict, key: str) -> Any:
    value = body.get(key, _MISSING)
    return _MISSING if value is None else value


def _int(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise errors.invalid(key, f"must be an integer, got {v!r}")
    return v


def _number(body: dict, key: str, default: Any) -> Any:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise errors.invalid(key, f"must be a finite number, got {v!r}")
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = _get(body, key)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise errors.invalid(key, f"must be a boolean, got {v!r}")
    return v


def _token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


@dataclass
class GenParams:
    max_tokens: int | None  # None: up to the context length (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the token's logprob and the top k

    def to_proto(self, prompt_len: int, max_model_len: int, vocab_size: int) -> pb.SamplingParams:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise errors.invalid(
                "stop_token_ids", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
            )
        # More than the context can never be generated; the cap also keeps the value in uint32.
        limit = max(1, max_model_len - prompt_len)
        max_tokens = limit if self.max_tokens is None else min(self.max_tokens, max_model_len)
        p = pb.SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            min_p=self.min_p,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )
        if self.seed is not None:
            p.seed = self.seed
        if self.logprobs is not None:
            p.logprobs = self.logprobs
        return p


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: GenParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: token ids in every choice and chunk


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    params: GenParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


def _common(body: dict, max_tokens: int | None, logprobs: int | None) -> GenParams:
    """The sampling fields both endpoints share, range-checked by SamplingParams."""
    stop = _get(body, "stop")
    if stop is _MISSING:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise errors.invalid("stop", "must be a string or a list of strings")
    stop_ids = _get(body, "stop_token_ids")
    stop_ids = [] if stop_ids is _MISSING else stop_ids
    if not _token_list(stop_ids):
        raise errors.invalid("stop_token_ids", "must be a list of integers")
    seed = _int(body, "seed", None)
    if seed is not None and seed >= 2**64:
        raise errors.invalid("seed", "must be < 2**64")
    top_k = _int(body, "top_k", -1)
    if top_k >= 2**31:
        raise errors.invalid("top_k", "must be < 2**31")
    values = dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=-1 if top_k == 0 else top_k,
        min_p=_number(body, "min_p", 0.0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs,
    )
    try:
        SamplingParams(**{**values, "max_tokens": 1 if max_tokens is None else max_tokens})
    except InvalidRequestError as e:
        raise errors.from_invalid_request(e) from None
    _refuse_unsupported(body)
    return GenParams(**values)


def _refuse_unsupported(body: dict) -> None:
    if _int(body, "n", 1) != 1:
        raise errors.invalid("n", "only n=1 is supported; send several prompts or requests instead")
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key, 0.0) != 0.0:
            raise errors.invalid(key, "is not supported (must be 0)")
    if _number(body, "repetition_penalty", 1.0) != 1.0:
        raise errors.invalid("repetition_penalty", "is not supported (must be 1)")
    bias = _get(body, "logit_bias")
    if bias is not _MISSING and (not isinstance(bias, dict) or bias):
        raise errors.invalid("logit_bias", "is not supported")


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    options = _get(body, "stream_options")
    if options is _MISSING:
        return stream, False
    if not isinstance(options, dict):
        raise errors.invalid("stream_options", "must be an object")
    return stream, _bool(options, "include_usage", False)


def _model(body: dict) -> str | None:
    model = _get(body, "model")
    if model is _MISSING:
        return None
    if not isinstance(model, str):
        raise errors.invalid("model", f"must be a string, got {model!r}")
    return model


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise errors.invalid(None, "the request body must be a JSON object")
    prompt = _get(body, "prompt")
    if prompt is _MISSING:
        raise errors.invalid("prompt", "is required")
    if isinstance(prompt, str) or (_token_list(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise errors.invalid(
            "prompt", "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    if _bool(body, "echo", False):
        raise errors.invalid("echo", "is not supported")
    if _int(body, "best_of", 1) != 1:
        raise errors.invalid("best_of", "only best_of=1 is supported")
    suffix = _get(body, "suffix")
    if suffix is not _MISSING and suffix != "":
        raise errors.invalid("suffix", "is not supported")
    logprobs = _int(body, "logprobs", None)
    params = _common(body, _int(body, "max_tokens", 16), logprobs)
    stream, include_usage = _stream_fields(body)
    ids = _bool(body, "return_token_ids", False)
    return CompletionRequest(_model(body), prompts, params, stream, include_usage, ids)


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
    return {**m, "role": role, "content": content}


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise errors.invalid(None, "the request body must be a JSON object")
    messages = _get(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise errors.invalid("messages", "must be a non-empty list of messages")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    max_tokens = _int(body, "max_completion_tokens", _MISSING)
    if max_tokens is _MISSING:
        max_tokens = _int(body, "max_tokens", None)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None)
    if top is not None and not want_logprobs:
        raise errors.invalid("top_logprobs", "requires logprobs to be true")
    if top is not None and not 0 <= top <= 20:
        raise errors.invalid("top_logprobs", f"must be in [0, 20], got {top}")
    fmt = _get(body, "response_format")
    if fmt is not _MISSING and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise errors.invalid("response_format", "only {'type': 'text'} is supported")
    params = _common(body, max_tokens, (top or 0) if want_logprobs else None)
    stream, include_usage = _stream_fields(body)
    ids = _bool(body, "return_token_ids", False)
    return ChatRequest(_model(body), parsed, params, stream, include_usage, ids)


def check_prompt(ids: list[int], param: str, max_model_len: int, vocab_size: int) -> None:
    """A tokenized prompt the groups can take: non-empty, in the vocabulary, shorter than the context."""
    if not ids:
        raise errors.invalid(param, "the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise errors.invalid(param, f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise errors.invalid(
            param,
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{len(ids)} tokens: no room to generate.",
        )
