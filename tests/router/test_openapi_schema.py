"""router/api/openapi.py documents what protocol.py accepts: every SamplingParams field is in both request
schemas (generated, so a new field shows up by itself), and each documented bound is the validator's."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pipeserve.errors import InvalidRequestError
from pipeserve.router.api import openapi
from pipeserve.router.api.protocol import parse_chat, parse_completion
from pipeserve.sampling_params import SamplingParams


def _props(op: dict) -> dict:
    return op["requestBody"]["content"]["application/json"]["schema"]["properties"]


def _numeric(schema: dict) -> dict:
    return next(s for s in schema["anyOf"] if s.get("type") in ("integer", "number"))


@pytest.mark.parametrize("op", [openapi.COMPLETIONS, openapi.CHAT], ids=["completions", "chat"])
def test_every_sampling_field_is_documented(op: dict) -> None:
    # structured*: normalized from response_format / guided_* / structured_outputs (documented).
    internal = {"structured_kind", "structured", "structured_compact"}
    assert {f.name for f in fields(SamplingParams)} - internal <= set(_props(op))
    assert {"response_format", "guided_json", "guided_choice", "structured_outputs"} <= set(_props(op))


NUMERIC = [
    name
    for name, schema in _props(openapi.COMPLETIONS).items()
    if name in {f.name for f in fields(SamplingParams)}
    and any(s.get("type") in ("integer", "number") for s in schema["anyOf"])
]


@pytest.mark.parametrize("name", NUMERIC)
def test_documented_bounds_are_the_validators(name: str) -> None:
    """At each documented bound the validator accepts; one step past it, it refuses the field."""
    num = _numeric(_props(openapi.COMPLETIONS)[name])
    step = 1 if num["type"] == "integer" else 1e-9
    for key, inside, outside in (
        ("minimum", 0, -step),
        ("maximum", 0, step),
        ("exclusiveMinimum", step, 0),
    ):
        if key not in num:
            continue
        SamplingParams(**{name: num[key] + inside})
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**{name: num[key] + outside})
        assert e.value.param == name


def test_documented_defaults_are_the_parsers() -> None:
    completion = parse_completion({"prompt": "x"}).params
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]}).params
    for params, op in ((completion, openapi.COMPLETIONS), (chat, openapi.CHAT)):
        for name, schema in _props(op).items():
            if hasattr(params, name) and name != "logprobs":  # chat's logprobs is a bool, not the count
                assert schema["default"] == getattr(params, name), name
