"""SamplingParams: what a caller asks of one generation (vLLM's shape), and the prompt checks.

There is one sampling field list, sampling_fields.py (names, types, defaults,
bounds, help, where each travels): SamplingParams subclasses its declaration
(SamplingValues), so it has exactly its fields, in its order, and `validate`
enforces its bounds.
The router builds `SamplingParams` straight from the JSON body
(router/api/protocol.py reads each field by its annotation here), `rpc/convert.py`
maps it to and from `pb.SamplingParams` by field name, and the engine reads it.
Validation raises InvalidRequestError naming the field, at construction, so a
bad request never reaches the scheduler.

A field stage 0 never receives (the router applies `stop`) is `wire=False` in
the list: it has no proto field.

`max_tokens=None` means "up to the context" (chat's default); it is resolved
against the prompt by `resolve_max_tokens`, the one place where the prompt
length is known, before the request leaves the router (or enters the engine
from the offline LLM).

`check_prompt` is the one prompt validator (empty, ids outside the
vocabulary, no room left in the context), called by the router and by
`LLMEngine.validate`.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, dataclass
from typing import Any

from pipeserve.detokenize import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pipeserve.errors import InvalidRequestError
from pipeserve.sampling_fields import SAMPLING_FIELDS, SamplingValues

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
# temperature whose reciprocal leaves float32 would make inf/NaN probabilities.
SAMPLING_EPS = 1e-5

# The fields with numeric bounds in the list: validate checks each (an integer or a finite number).
_RANGED = tuple(f for f in SAMPLING_FIELDS if f.minimum is not None or f.maximum is not None)
MAX_LOGIT_BIAS = 300  # entries of logit_bias at most (OpenAI documents no limit; keeps plans small)


@dataclass
class SamplingParams(SamplingValues):
    """The fields are SamplingValues' (sampling_fields.py: one declaration each); this adds the checks."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def fail(param: str, msg: str) -> None:
            raise InvalidRequestError(param, msg)

        for spec in _RANGED:  # the numeric bounds of the field list (sampling_fields.py)
            v = getattr(self, spec.name)
            if v is None and spec.type in _OPTIONAL:
                continue
            integer = spec.type in (int, int | None)
            if not (_is_int(v) if integer else _is_finite(v)) or not spec.in_bounds(v):
                bounds = spec.bounds_text()
                what = "an integer" if integer else "a finite number"
                fail(
                    spec.name, f"must be {what} {'in ' if bounds[0] in '[(' else ''}{bounds}, got {_show(v)}"
                )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or sum(map(len, self.stop)) > MAX_STOP_CHARS:
            fail("stop", f"at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            fail("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", f"must be a boolean, got {_show(self.ignore_eos)}")
        _check_structured(self, fail)
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            fail("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for t, b in bias.items():
            if not _is_int(t) or t < 0:
                fail("logit_bias", f"keys must be token ids (non-negative integers), got {_show(t)}")
            if not _is_finite(b) or not -100 <= b <= 100:
                fail("logit_bias", f"biases must be in [-100, 100], got {_show(b)} for token {t}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")


_OPTIONAL = (int | None, float | None)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 256 * 1024


def _check_structured(p: SamplingParams, fail: Any) -> None:
    """The shape of a structured spec (whether it compiles is stage 0's check: engine/grammar.py)."""
    if not isinstance(p.structured_kind, str) or p.structured_kind not in ("", *STRUCTURED_KINDS):
        fail("structured", f"unknown kind {_show(p.structured_kind)}")
    if not isinstance(p.structured, str) or len(p.structured) > MAX_STRUCTURED_CHARS:
        fail("structured", f"must be a string of at most {MAX_STRUCTURED_CHARS} characters")
    if not isinstance(p.structured_compact, bool):
        fail("structured_compact", "must be a boolean")
    if p.structured_kind in ("json", "regex", "choice", "grammar") and not p.structured:
        fail("structured", f"a {p.structured_kind} constraint must not be empty")


def default_of(f: Field) -> Any:
    """A dataclass field's default value (calling its default_factory)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"{f.name} has no default")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """A finite real; an int too large for a float (10**400) is not: math.isfinite would raise."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _show(v: Any) -> str:
    """A value quoted in an error message, short (a 10**400 literal is not echoed whole)."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_prompt(
    ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int, param: str = "prompt"
) -> None:
    """A tokenized prompt a group can take (non-empty, in the vocabulary, shorter than the context),
    and stop token ids in the vocabulary. Raises InvalidRequestError naming the field."""
    if not ids:
        raise InvalidRequestError(param, "the prompt is empty")
    bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(param, f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            param,
            f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{len(ids)} tokens: no room to generate.",
        )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            "stop_token_ids", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
        )
    bad = sorted(t for t in params.logit_bias if t >= vocab_size)
    if bad:
        raise InvalidRequestError(
            "logit_bias", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
        )


def resolve_max_tokens(
    params: SamplingParams, prompt_len: int, max_model_len: int, strict: bool, param: str = "max_tokens"
) -> int:
    """The number of tokens to generate at most: `max_tokens`, or what the context leaves when None.

    strict (the HTTP API, as vLLM): prompt + max_tokens beyond the context is an error naming
    `param` (the field the client sent). Not strict (the offline LLM): the engine stops at the
    context ("length"), so a larger max_tokens is kept as is.
    """
    room = max_model_len - prompt_len
    if params.max_tokens is None:
        return max(1, room)
    if strict and params.max_tokens > room:
        raise InvalidRequestError(
            param,
            f"'{param}' is too large: {_show(params.max_tokens)}. This model's maximum context length "
            f"is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({_show(params.max_tokens)} > {max_model_len} - {prompt_len}).",
        )
    return params.max_tokens
