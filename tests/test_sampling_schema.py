"""One sampling schema: SamplingParams is read from JSON and converted to/from protobuf by field name,
validated by one set of checks, and its prompt checks are shared by the router and the engine."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from pipeserve import LLM
from pipeserve.errors import InvalidRequestError
from pipeserve.router.api.protocol import parse_chat, parse_completion
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc.convert import WIRE_FIELDS, sampling_from_proto, sampling_to_proto
from pipeserve.sampling_params import SamplingParams, check_prompt, resolve_max_tokens

# A non-default value for every field. A field added to SamplingParams must be added here,
# which makes the round trips below cover it.
NON_DEFAULT = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_k": 3,
    "top_p": 0.25,
    "min_p": 0.125,
    "seed": 2**64 - 1,
    "stop": ["END", "\n\n"],
    "stop_token_ids": [1, 2],
    "ignore_eos": True,
    "logprobs": 20,
    "structured_kind": "regex",
    "structured": "[a-z]+",
    "structured_compact": True,
    "prompt_logprobs": 3,
    "presence_penalty": -2.0,
    "frequency_penalty": 1.5,
    "repetition_penalty": 2.0,
    "logit_bias": {1: -100.0, 1023: 2.5},
    "min_tokens": 3,
}
# Read from other JSON fields (router/features/structured.py): response_format, guided_*, structured_outputs.
STRUCTURED = {"structured_kind", "structured", "structured_compact"}


def test_every_field_has_a_non_default_sample() -> None:
    assert set(NON_DEFAULT) == {f.name for f in fields(SamplingParams)}
    defaults = SamplingParams()
    assert all(getattr(defaults, k) != v for k, v in NON_DEFAULT.items())


def test_the_proto_carries_exactly_the_wire_fields() -> None:
    assert set(WIRE_FIELDS) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert "stop" not in WIRE_FIELDS  # stop strings are the router's


def test_proto_round_trip_of_every_field() -> None:
    params = SamplingParams(**NON_DEFAULT)
    back = sampling_from_proto(sampling_to_proto(params))
    for name in WIRE_FIELDS:
        assert getattr(back, name) == getattr(params, name), name
    # Unset optional fields stay unset (HasField), and come back as None.
    plain = sampling_to_proto(SamplingParams())
    assert not plain.HasField("seed") and not plain.HasField("logprobs")
    assert sampling_from_proto(plain) == SamplingParams()
    with pytest.raises(ValueError, match="resolved"):
        sampling_to_proto(SamplingParams(max_tokens=None))


def test_unset_optional_proto_fields_read_as_their_defaults() -> None:
    """A gRPC client that never heard of repetition_penalty sends none: 1 (off), not proto3's 0."""
    msg = pb.SamplingParams(max_tokens=4, top_p=1.0, temperature=0.0)
    assert not msg.HasField("repetition_penalty")
    got = sampling_from_proto(msg)
    assert got.repetition_penalty == 1.0 and got.presence_penalty == 0.0 and got.logit_bias == {}


def test_a_bad_proto_is_an_invalid_request_naming_the_field() -> None:
    msg = sampling_to_proto(SamplingParams())
    msg.top_p = 0.0
    with pytest.raises(InvalidRequestError) as err:
        sampling_from_proto(msg)
    assert err.value.param == "top_p"


def test_every_field_is_read_from_the_json_body() -> None:
    plain = {k: v for k, v in NON_DEFAULT.items() if k not in STRUCTURED}
    so = {"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}}
    body = {"prompt": "x", **plain, **so}
    got = parse_completion(body).params
    assert {k: getattr(got, k) for k in NON_DEFAULT} == NON_DEFAULT
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], **plain, **so, "logprobs": True, "top_logprobs": 20}
    ).params
    assert {k: getattr(chat, k) for k in NON_DEFAULT} == NON_DEFAULT


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": 10**400}, "top_p"),
        ({"min_p": -(10**400)}, "min_p"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop_token_ids": [1, True]}, "stop_token_ids"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"frequency_penalty": -(10**400)}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
    ],
)
def test_validation_names_the_field_and_never_overflows(kw: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kw)
    assert err.value.param == param and len(err.value.message) < 200


def test_max_tokens_none_is_up_to_the_context() -> None:
    params = SamplingParams(max_tokens=None)
    assert resolve_max_tokens(params, prompt_len=10, max_model_len=64, strict=True) == 54


def test_the_engine_runs_the_routers_prompt_checks(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=64, num_kv_blocks=16)
    params = SamplingParams(max_tokens=4, stop_token_ids=[5])
    for ids in ([], [1, 5000], [3] * 64):
        with pytest.raises(InvalidRequestError) as shared:
            check_prompt(ids, params, 64, llm.engine.model_config.vocab_size)
        with pytest.raises(InvalidRequestError) as engine:
            llm.engine.validate(ids, params)
        assert (engine.value.param, engine.value.message) == (shared.value.param, shared.value.message)
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.validate([1, 2], SamplingParams(stop_token_ids=[10**6]))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.validate([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as err:
        llm.engine.validate([1, 2], SamplingParams(max_tokens=None))
    assert err.value.param == "max_tokens"
    # The offline LLM resolves None itself: up to the context.
    out = llm.generate([[7] * 60], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_offline_stop_strings_are_detokenized_incrementally(llama_dir: Path) -> None:
    """LLM feeds each new token to a TextStream: decode work is linear in the output, not quadratic."""
    llm = LLM(str(llama_dir), max_model_len=256, num_kv_blocks=32)
    greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    full = llm.generate(["The lighthouse keeper"], greedy)[0].outputs[0]
    assert llm.tok is not None
    decoded = []
    decode = llm.tok.decode
    llm.tok.decode = lambda ids: decoded.append(len(ids)) or decode(ids)  # type: ignore[method-assign]
    stop = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=["@@never@@"])
    out = llm.generate(["The lighthouse keeper"], stop)[0].outputs[0]
    assert out.text == full.text and out.token_ids == full.token_ids
    assert sum(decoded) <= 12 * len(out.token_ids), f"decoded {sum(decoded)} ids for {len(out.token_ids)}"
    # A stop string ends the request at the step that completed it, and is trimmed.
    cut = full.text[len(full.text) // 2 :][:3]
    stopped = llm.generate(["The lighthouse keeper"], SamplingParams(**{**stop.__dict__, "stop": [cut]}))
    o = stopped[0].outputs[0]
    assert o.finish_reason == "stop" and o.text == full.text[: full.text.index(cut)]
    assert len(o.token_ids) < len(full.token_ids)
