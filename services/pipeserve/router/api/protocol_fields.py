"""How the OpenAI request bodies' fields are read: JSON types, strictly (router/api/protocol.py).

* An integer field (token ids included) takes a JSON integer or a float with an integral value
  (4.0, as pydantic's lax mode and so vLLM), not 1.5, a bool or a string; a number field a finite
  int/float (an integer too large for a float is refused, not an overflow); a bool field
  true/false; JSON null means "not given".
* Text must be valid Unicode (`check_text`): a lone surrogate is a 400 naming the field.
* Each SamplingParams field is read by its annotation (`READERS`); the fields every endpoint reads
  alike are `SAMPLING_FIELDS` (name, reader, default), all but protocol.PER_ENDPOINT.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, get_type_hints

from pipeserve.router import errors
from pipeserve.sampling_params import SamplingParams, default_of

MISSING = object()
PER_ENDPOINT = (
    "max_tokens",
    "logprobs",
    "structured_kind",
    "structured",
    "structured_compact",
)  # read by each parser, not by their annotation


def value_of(body: dict, key: str) -> Any:
    value = body.get(key, MISSING)
    return MISSING if value is None else value


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


def as_int(v: Any) -> int | None:
    """A JSON integer, or a float with an integral value (4.0), as pydantic's lax mode (and so vLLM)
    takes it; None for anything else (1.5, true, "4", NaN, inf)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def read_int(body: dict, key: str, default: Any) -> Any:
    v = value_of(body, key)
    if v is MISSING:
        return default
    n = as_int(v)
    if n is None:
        raise errors.invalid(key, f"must be an integer, got {short(v)}")
    return n


def read_number(body: dict, key: str, default: Any) -> Any:
    v = value_of(body, key)
    if v is MISSING:
        return default
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            f = float(v)  # an integer literal of hundreds of digits overflows here
        except OverflowError:
            f = math.inf
        if math.isfinite(f):
            return f
    raise errors.invalid(key, f"must be a finite number, got {short(v)}")


def read_bool(body: dict, key: str, default: Any) -> Any:
    v = value_of(body, key)
    if v is MISSING:
        return default
    if not isinstance(v, bool):
        raise errors.invalid(key, f"must be a boolean, got {short(v)}")
    return v


def read_strings(body: dict, key: str, default: Any) -> Any:
    v = value_of(body, key)
    if v is MISSING:
        return default
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise errors.invalid(key, "must be a string or a list of strings")
    return [check_text(s, key) for s in v]


def read_ints(body: dict, key: str, default: Any) -> Any:
    v = value_of(body, key)
    if v is MISSING:
        return default
    ids = token_list(v)
    if ids is None:
        raise errors.invalid(key, "must be a list of integers")
    return ids


def short(v: Any) -> str:
    text = repr(v)  # repr escapes lone surrogates, so the message always renders
    return text if len(text) <= 40 else text[:37] + "..."


def token_list(v: Any) -> list[int] | None:
    """`v` as a list of integers (see as_int), or None when it is not one."""
    if not isinstance(v, list):
        return None
    ids = [as_int(t) for t in v]
    return None if None in ids else ids  # type: ignore[return-value]


def read_bias(body: dict, key: str, default: Any) -> Any:
    """OpenAI's logit_bias: {"token id": bias}; keys are decimal strings (or ints from a JSON-less client)."""
    v = value_of(body, key)
    if v is MISSING:
        return default
    if not isinstance(v, dict):
        raise errors.invalid(key, "must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for k, b in v.items():
        # At most 20 digits: int() raises past 4300 digits, and no vocabulary is that big.
        digits = isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 20
        t = int(k) if digits else (as_int(k) if not isinstance(k, str) else None)
        if t is None or b is None:
            raise errors.invalid(key, f"must map token ids to numbers, got {short(k)}: {short(b)}")
        out[t] = read_number({key: b}, key, 0.0)
    return out


# How each SamplingParams annotation is read from JSON. A field whose type is not here
# fails at import: give it a reader (or read it per endpoint).
READERS = {
    int: read_int,
    int | None: read_int,
    float: read_number,
    bool: read_bool,
    list[str]: read_strings,
    list[int]: read_ints,
    dict[int, float]: read_bias,
}
_HINTS = get_type_hints(SamplingParams)
SAMPLING_FIELDS = [
    (f.name, READERS[_HINTS[f.name]], default_of(f))
    for f in fields(SamplingParams)
    if f.name not in PER_ENDPOINT
]
