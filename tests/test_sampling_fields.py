"""The one sampling field list (sampling_fields.py) is what SamplingParams, SamplingSpec, the OpenAPI
document, `pipeserve generate`'s flags and the wire message (generation.proto, field by field) say:
each is compared with it here, so none can drift; and no other product module declares a sampling
field again (its name with its type, or with its type and default)."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import msgspec
import pytest
from google.protobuf.descriptor_pb2 import DescriptorProto, FieldDescriptorProto, FileDescriptorSet

from pipeserve.cli import build_parser, main
from pipeserve.engine.plan import ON_PLAN, SamplingSpec
from pipeserve.engine.request import Request, sampling_spec
from pipeserve.errors import ExitCode, InvalidRequestError
from pipeserve.router.api import openapi
from pipeserve.router.api.protocol import parse_chat, parse_completion
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc.convert import sampling_from_proto
from pipeserve.sampling_fields import (
    DEFAULT_MAX_TOKENS,
    FIELDS,
    SAMPLING_FIELDS,
    STAGE_DERIVED,
    STAGE_FIELDS,
    SamplingField,
)
from pipeserve.sampling_params import SamplingParams, default_of

REPO = Path(__file__).resolve().parent.parent


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
    for f in msgspec.structs.fields(SamplingSpec)[: len(STAGE_FIELDS)]:
        spec = FIELDS[f.name]
        assert f.type == ON_PLAN.get(spec.type, spec.type), f.name
        default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
        assert default == ([] if isinstance(spec.default, tuple | dict) else spec.default), f.name


def test_sampling_spec_is_built_by_name_from_the_params() -> None:
    params = SamplingParams(temperature=1, top_k=5, seed=3, logit_bias={7: 1, 2: -1.5}, min_tokens=2)
    spec = sampling_spec(Request("r", [1, 2], params), frozenset({0}))
    for name in STAGE_FIELDS:
        want = getattr(params, name)
        want = sorted(want.items()) if name == "logit_bias" else want
        assert getattr(spec, name) == want, name
    # exact types (the digest covers the encoding): the int temperature travels as a float
    assert type(spec.temperature) is float and type(spec.logit_bias[0][1]) is float
    assert spec.min_tokens_stop_ids == [0]  # EOS, masked until min_tokens


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


# --- the wire message: generation.proto cannot be generated at run time, so it is checked here ---

PROTO = REPO / "services/pipeserve/rpc/generation.proto"
# Plain proto3 fields although their default is not proto3's zero: the router always sends them
# (max_tokens resolved, convert.py refuses None). Making one `optional` now would read an older
# client's greedy temperature 0 (a zero is never encoded) as the list's 1.
ALWAYS_SENT = {"max_tokens", "temperature", "top_p", "top_k"}


def _proto_scalar(base: Any, spec: SamplingField, inside: bool = False) -> str:
    if base is int:
        if inside:  # an int in a list or a map is a token id
            return "uint32"
        unsigned = spec.minimum is not None and spec.minimum >= 0
        wide = spec.maximum is not None and spec.maximum >= 2**32
        return ("uint" if unsigned else "int") + ("64" if wide else "32")
    return {float: "double", bool: "bool", str: "string"}[base]


def expected_wire_type(spec: SamplingField) -> str:
    """The proto field a sampling field of the list needs: its type, and `optional` when unset must
    read as None or as a default that is not proto3's zero (repetition_penalty's 1), but ALWAYS_SENT."""
    origin, args = get_origin(spec.type), get_args(spec.type)
    if origin is dict:
        return f"map<{_proto_scalar(args[0], spec, True)}, {_proto_scalar(args[1], spec, True)}>"
    if origin is list:
        return f"repeated {_proto_scalar(args[0], spec, True)}"
    base = next(a for a in args or (spec.type,) if a is not type(None))
    presence = spec.default is None or (spec.default not in (0, "", False) and spec.name not in ALWAYS_SENT)
    return ("optional " if presence else "") + _proto_scalar(base, spec)


def wire_types(message: DescriptorProto) -> dict[str, str]:
    """Each field of a message, as its .proto declaration writes its type."""
    entries = {n.name: n for n in message.nested_type if n.options.map_entry}

    def scalar(f: FieldDescriptorProto) -> str:
        return FieldDescriptorProto.Type.Name(f.type).removeprefix("TYPE_").lower()

    out = {}
    for f in message.field:
        if f.type == FieldDescriptorProto.TYPE_MESSAGE and f.type_name.split(".")[-1] in entries:
            key, value = entries[f.type_name.split(".")[-1]].field
            out[f.name] = f"map<{scalar(key)}, {scalar(value)}>"
        elif f.label == FieldDescriptorProto.LABEL_REPEATED:
            out[f.name] = f"repeated {scalar(f)}"
        else:
            out[f.name] = ("optional " if f.proto3_optional else "") + scalar(f)
    return out


def _compiled_proto(tmp_path: Path) -> DescriptorProto:
    """pb.SamplingParams as generation.proto declares it now (protoc), not as last generated."""
    out = tmp_path / "generation.pb"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO / "services")]
    subprocess.run([*cmd, f"--descriptor_set_out={out}", str(PROTO)], check=True, timeout=60)
    files = FileDescriptorSet.FromString(out.read_bytes()).file
    (message,) = [m for f in files for m in f.message_type if m.name == "SamplingParams"]
    return message


@pytest.mark.parametrize("source", ["generation.proto", "generation_pb2"])
def test_the_wire_message_is_the_lists_wire_fields(source: str, tmp_path: Path) -> None:
    """Field by field, name and type: the .proto as written, and the module generated from it."""
    if source == "generation_pb2":
        message = DescriptorProto()
        pb.SamplingParams.DESCRIPTOR.CopyToProto(message)
    else:
        message = _compiled_proto(tmp_path)
    want = {s.name: expected_wire_type(s) for s in SAMPLING_FIELDS if s.wire}
    assert wire_types(message) == want


def test_the_wire_checker_reads_types_and_presence() -> None:
    assert expected_wire_type(FIELDS["seed"]) == "optional uint64"
    assert expected_wire_type(FIELDS["top_k"]) == "int32"
    assert expected_wire_type(FIELDS["min_p"]) == "double"
    assert expected_wire_type(FIELDS["structured"]) == "string"
    assert expected_wire_type(FIELDS["repetition_penalty"]) == "optional double"
    assert expected_wire_type(FIELDS["max_tokens"]) == "uint32"
    assert expected_wire_type(FIELDS["logit_bias"]) == "map<uint32, double>"
    assert expected_wire_type(FIELDS["stop_token_ids"]) == "repeated uint32"


# --- one declaration: no other product module writes a sampling field's type or default ---

# A field of the same name and type that is another concept (not a copy of a sampling field).
NOT_SAMPLING = {
    ("pipeserve.model.moe", "MoeSpec", "top_k"),  # experts per token
    ("pipeserve.router.api.protocol", "CompletionRequest", "prompt_logprobs"),  # the client's, before echo
}


def second_declarations(module: str, source: str) -> list[str]:
    """A sampling field declared again: a class attribute `temperature: float` (the list's name and
    type), or a parameter `repetition_penalty: float = 1.0` (name, type and a default of the list's own
    choosing: not None, 0, "", False or empty)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for st in node.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                name = st.target.id
                if name in FIELDS and _same_type(st.annotation, FIELDS[name]):
                    if (module, node.name, name) not in NOT_SAMPLING:
                        found.append(f"{module}: {node.name}.{name}: {ast.unparse(st.annotation)}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = [*node.args.posonlyargs, *node.args.args]
            defaults = dict(zip(args[len(args) - len(node.args.defaults) :], node.args.defaults, strict=True))
            defaults |= {a: d for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True) if d}
            for arg, default in defaults.items():
                spec = FIELDS.get(arg.arg)
                if (
                    spec
                    and arg.annotation
                    and _same_type(arg.annotation, spec)
                    and _is_default(default, spec)
                ):
                    found.append(f"{module}: {node.name}({arg.arg}: {ast.unparse(arg.annotation)} = ...)")
    return found


def _same_type(annotation: ast.expr, spec: SamplingField) -> bool:
    text = ast.unparse(annotation).replace("Optional[", "").replace("typing.", "")
    return text.replace(" ", "") in {_type_text(spec.type), _type_text(ON_PLAN.get(spec.type, spec.type))}


def _type_text(t: Any) -> str:
    return (t.__name__ if isinstance(t, type) else str(t)).replace(" ", "")


def _is_default(node: ast.expr, spec: SamplingField) -> bool:
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return False
    # None, 0, "", False, empty: any optional parameter's idiom; 1.0, -1, 16 are the list's choices
    return bool(value) and value == spec.default and value is not True


def test_a_sampling_field_is_declared_once() -> None:
    sample = (
        "class S:\n    temperature: float\n    top_k: int = -1\n    seed: str = ''\n"
        "def f(repetition_penalty: float = 1.0, min_p: float = 0.5, min_tokens: int = 0): ...\n"
    )
    assert second_declarations("m", sample) == [
        "m: S.temperature: float",
        "m: S.top_k: int",
        "m: f(repetition_penalty: float = ...)",
    ]
    root = REPO / "services"
    bad = [
        hit
        for path in sorted((root / "pipeserve").rglob("*.py"))
        if path.name != "sampling_fields.py" and "_pb2" not in path.name
        for hit in second_declarations(
            ".".join(path.relative_to(root).with_suffix("").parts), path.read_text()
        )
    ]
    assert bad == [], f"declare a sampling field once, in sampling_fields.py's SamplingValues: {bad}"


def test_an_unset_wire_field_reads_as_the_lists_default() -> None:
    """A gRPC client other than the router may leave fields out: each reads as the list's default."""
    params = sampling_from_proto(pb.SamplingParams(max_tokens=4, top_p=1.0))  # ALWAYS_SENT: sent
    for spec in SAMPLING_FIELDS:
        if spec.wire and spec.name not in ALWAYS_SENT:
            want = list(spec.default) if isinstance(spec.default, tuple) else spec.default
            assert getattr(params, spec.name) == want, spec.name
