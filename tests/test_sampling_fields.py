"""The one sampling field list (sampling_fields.py) is what SamplingParams, SamplingSpec, the OpenAPI
document and `pipeserve generate`'s flags say: each is compared with it here, so none can drift."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import get_type_hints

import pytest

from pipeserve.cli import build_parser, main
from pipeserve.engine.plan import SamplingSpec
from pipeserve.errors import ExitCode, InvalidRequestError
from pipeserve.router import openapi
from pipeserve.router.protocol import parse_chat, parse_completion
from pipeserve.sampling_fields import (
    DEFAULT_MAX_TOKENS,
    FIELDS,
    SAMPLING_FIELDS,
    STAGE_DERIVED,
    STAGE_FIELDS,
    SamplingField,
)
from pipeserve.sampling_params import SamplingParams, default_of


def test_sampling_params_has_the_lists_fields() -> None:
    hints = get_type_hints(SamplingParams)
    got = [(f.name, hints[f.name], default_of(f)) for f in fields(SamplingParams)]
    want = [
        (s.name, s.type, list(s.default) if isinstance(s.default, tuple) else s.default)
        for s in SAMPLING_FIELDS
    ]
    assert got == want


def test_sampling_spec_has_the_stage_fields_in_order() -> None:
    """SamplingSpec is array_like (fields by position): its fields are the list's stage fields, in order."""
    assert SamplingSpec.__struct_fields__ == (*STAGE_FIELDS, *STAGE_DERIVED)


@pytest.mark.parametrize("spec", [s for s in SAMPLING_FIELDS if s.bounds_text()], ids=lambda s: s.name)
def test_the_validator_enforces_the_lists_bounds(spec: SamplingField) -> None:
    step = 1 if spec.type in (int, int | None) else 1e-6
    if spec.minimum is not None:
        SamplingParams(**{spec.name: spec.minimum + (step if spec.exclusive_minimum else 0)})
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**{spec.name: spec.minimum - (0 if spec.exclusive_minimum else step)})
        assert err.value.param == spec.name and spec.bounds_text() in err.value.message
    if spec.maximum is not None:
        SamplingParams(**{spec.name: spec.maximum})
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**{spec.name: spec.maximum + step})
        assert err.value.param == spec.name


def _props(op: dict) -> dict:
    return op["requestBody"]["content"]["application/json"]["schema"]["properties"]


@pytest.mark.parametrize("op", [openapi.COMPLETIONS, openapi.CHAT], ids=["completions", "chat"])
def test_openapi_ranges_are_the_lists(op: dict) -> None:
    props = _props(op)
    for spec in SAMPLING_FIELDS:
        if not spec.bounds_text():
            continue
        # chat's logprobs is a boolean: top_logprobs carries the number, in logprobs' bounds
        name = "top_logprobs" if (spec.name, op) == ("logprobs", openapi.CHAT) else spec.name
        (num,) = [s for s in props[name]["anyOf"] if s.get("type") in ("integer", "number")]
        got = {k: num[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in num}
        low = "exclusiveMinimum" if spec.exclusive_minimum else "minimum"
        want = {low: spec.minimum} if spec.minimum is not None else {}
        want |= {"maximum": spec.maximum} if spec.maximum is not None else {}
        assert got == want, spec.name


def test_max_tokens_defaults_are_defined_once() -> None:
    assert FIELDS["max_tokens"].default == DEFAULT_MAX_TOKENS == SamplingParams().max_tokens
    assert _props(openapi.COMPLETIONS)["max_tokens"]["default"] == DEFAULT_MAX_TOKENS
    assert parse_completion({"prompt": "x"}).params.max_tokens == DEFAULT_MAX_TOKENS
    # chat: up to the context (None, resolved against the prompt), as OpenAI and vLLM
    assert _props(openapi.CHAT)["max_tokens"]["default"] is None
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).params.max_tokens is None


def _generate_flags() -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["generate"]._actions}


def test_generate_flags_are_the_lists() -> None:
    flags = _generate_flags()
    cli = [s for s in SAMPLING_FIELDS if s.cli]
    assert {s.name for s in cli} <= set(flags)
    assert not {s.name for s in SAMPLING_FIELDS if not s.cli} & set(flags)
    for spec in cli:
        action = flags[spec.name]
        assert action.option_strings[0] == "--" + spec.name.replace("_", "-")
        assert action.default == spec.flag_default, spec.name
        if spec.type is bool:
            assert isinstance(action, argparse.BooleanOptionalAction)
        else:
            assert action.type is (int if spec.type in (int, int | None) else float), spec.name
        assert spec.help in (action.help or ""), spec.name


def test_generate_takes_the_engine_flags() -> None:
    """Every EngineConfig field is a `generate` flag (as on `stage`/`up`) but those named like a
    sampling flag (seed: the request's) and the model/stages, which are generate's own."""
    from dataclasses import fields

    from pipeserve.config import EngineConfig

    flags = _generate_flags()
    sampling = {s.name for s in SAMPLING_FIELDS if s.cli}
    engine = {f.name for f in fields(EngineConfig)} - {"model", "stages", "log_dir"} - sampling
    assert engine <= set(flags)
    assert {"quantization", "kv_cache_dtype", "max_model_len", "stages"} <= set(flags)
    assert "gguf" in flags["quantization"].choices


def test_generate_refuses_a_bad_value_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before any model is looked for or loaded."""
    assert main(["generate", "--prompt", "x", "--top-p", "0"]) == ExitCode.CANNOT_START
    assert "top_p" in capsys.readouterr().err
