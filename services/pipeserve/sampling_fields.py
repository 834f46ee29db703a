"""The sampling fields, each declared once: name, type, default, bounds, help, and where it travels.

`SamplingValues` below is the one declaration (a dataclass: its annotations are the types mypy
checks everywhere); SAMPLING_FIELDS is read from it. Derived from it (and checked against it by
tests/test_sampling_fields.py, which also fails on a second hand-written declaration elsewhere):
* `SamplingParams` (sampling_params.py): a subclass adding the checks; `validate` enforces each
  field's numeric bounds from here (the other checks, of shape, are its own);
* the OpenAPI document (router/api/openapi.py): each field's JSON `minimum` / `maximum` /
  `exclusiveMinimum` and its description;
* `pipeserve generate`'s flags (cli.py): one flag per field marked `cli`;
* `SamplingSpec` (engine/plan.py): a msgspec Struct made from the `stage` fields, in this order,
  then `STAGE_DERIVED`, and built by name (engine/request.py);
* the protobuf (rpc/generation.proto): the `wire` fields; it cannot be generated at run time, so
  rpc/convert.py checks the names at import and a test checks every field's name and type.

Defaults that differ per surface are here too: the completions API's `max_tokens` is
DEFAULT_MAX_TOKENS (OpenAI, vLLM), chat's is None (up to the context, resolved against the prompt
by sampling_params.resolve_max_tokens), and `pipeserve generate` has its own `cli_default`.
A field marked `model_default` takes the model's generation_config.json value first, when a request
leaves it unset (request_defaults.py).
Adding a sampling field: a row in SamplingValues (and its shape check in SamplingParams when it has
one), the proto field (then `make proto`) when it travels, and the engine code that acts on it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, get_type_hints

DEFAULT_MAX_TOKENS = 16  # completions (OpenAI, vLLM) and SamplingParams(); chat: None (the context)
GENERATE_MAX_TOKENS = 32  # `pipeserve generate`'s default
MAX_SEED = 2**64 - 1  # the wire's uint64
MAX_TOP_K = 2**31 - 1  # the wire's int32
MAX_LOGPROBS = 20  # logprobs / top_logprobs / prompt_logprobs: the router and stage 0 refuse more

_SAME = object()


@dataclass(frozen=True)
class SamplingField:
    name: str
    type: Any  # the annotation of SamplingParams' field
    default: Any  # a list/dict default is given as () / {} and copied per instance
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # `minimum` itself is refused (top_p > 0, repetition_penalty > 0)
    wire: bool = True  # in pb.SamplingParams (router -> stage 0); `stop` is the router's alone
    stage: bool = True  # in SamplingSpec (stage 0 -> the stages' samplers)
    cli: bool = False  # a `pipeserve generate` flag
    cli_default: Any = _SAME  # its default there, when not `default`
    # The generation_config.json key whose value is the model's default for this field, used when a
    # request leaves it unset (vLLM's `--generation-config auto` list; request_defaults.py)
    model_default: str = ""

    @property
    def flag_default(self) -> Any:
        return self.default if self.cli_default is _SAME else self.cli_default

    def bounds_text(self) -> str:
        """The range in words, as error messages and flag help say it: "[0, 1]", "(0, 1]", ">= 1"."""
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:
            return f"{'(' if self.exclusive_minimum else '['}{_num(lo)}, {_num(hi)}]"
        if lo is not None:
            return f"{'>' if self.exclusive_minimum else '>='} {_num(lo)}"
        return f"<= {_num(hi)}" if hi is not None else ""

    def in_bounds(self, value: float) -> bool:
        if self.minimum is not None and (
            value <= self.minimum if self.exclusive_minimum else value < self.minimum
        ):
            return False
        return self.maximum is None or value <= self.maximum


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def declare(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **spec: Any) -> Any:
    """One field of SamplingValues: its default (or `factory`, list or dict: a fresh one per
    instance) and its SamplingField attributes (`minimum`, `cli`, ...) as dataclass metadata."""
    spec = {"help": help, **spec}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=spec)
    return field(default=default, metadata=spec)


@dataclass
class SamplingValues:
    """The sampling fields, in their order (SamplingSpec is array_like: the order is its encoding)."""

    max_tokens: int | None = declare(
        DEFAULT_MAX_TOKENS,
        "tokens to generate at most",
        minimum=1,
        stage=False,
        cli=True,
        cli_default=GENERATE_MAX_TOKENS,
        model_default="max_new_tokens",
    )
    temperature: float = declare(
        1.0, "below 1e-5: greedy", minimum=0, cli=True, cli_default=0.0, model_default="temperature"
    )
    top_k: int = declare(-1, "-1 or 0: off", minimum=-1, maximum=MAX_TOP_K, cli=True, model_default="top_k")
    top_p: float = declare(
        1.0,
        "nucleus mass kept",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        cli=True,
        model_default="top_p",
    )
    min_p: float = declare(
        0.0,
        "min probability, relative to the top token's",
        minimum=0,
        maximum=1,
        cli=True,
        model_default="min_p",
    )
    seed: int | None = declare(None, "per-request seed", minimum=0, maximum=MAX_SEED, cli=True)
    stop: list[str] = declare(
        factory=list, help="stop strings (the router's: not sent)", wire=False, stage=False
    )
    stop_token_ids: list[int] = declare(factory=list, help="token ids that end the output", stage=False)
    ignore_eos: bool = declare(False, "generate past EOS", stage=False, cli=True)
    logprobs: int | None = declare(
        None, "the sampled token's logprob and the top k", minimum=0, maximum=MAX_LOGPROBS
    )
    # Structured outputs (engine/grammar.py); the router normalizes every API spelling to these.
    structured_kind: str = declare("", "json, json_object, regex, choice, grammar; '' off")
    structured: str = declare("", "the schema, regex, JSON list of choices or EBNF")
    structured_compact: bool = declare(False, "JSON without free whitespace")
    prompt_logprobs: int | None = declare(
        None,
        "vLLM's extension: each prompt token's logprob, rank and the top k there "
        "(completions: per choice; chat: top level; streamed in the first chunk); no prefix-cache hit",
        minimum=0,
        maximum=MAX_LOGPROBS,
    )
    # Logits processors (vLLM's definitions; worker/penalties.py): the defaults leave a row untouched.
    presence_penalty: float = declare(0.0, "over the output tokens so far", minimum=-2, maximum=2, cli=True)
    frequency_penalty: float = declare(0.0, "x each output token's count", minimum=-2, maximum=2, cli=True)
    repetition_penalty: float = declare(
        1.0,
        "over prompt and output tokens; 1: off",
        minimum=0,
        exclusive_minimum=True,
        cli=True,
        model_default="repetition_penalty",
    )
    logit_bias: dict[int, float] = declare(
        factory=dict, help="token id -> bias added to its logit, in [-100, 100]"
    )
    min_tokens: int = declare(
        0,
        "no EOS, stop_token_ids or stop string before this many tokens; <= max_tokens",
        minimum=0,
        cli=True,
    )


def _read_fields() -> tuple[SamplingField, ...]:
    hints = get_type_hints(SamplingValues)
    out = []
    for f in fields(SamplingValues):
        default = f.default
        if f.default_factory is not MISSING:  # a list is given as () (SamplingField is shared), a dict {}
            default = () if f.default_factory is list else f.default_factory()
        out.append(SamplingField(f.name, hints[f.name], default, **f.metadata))
    return tuple(out)


SAMPLING_FIELDS: tuple[SamplingField, ...] = _read_fields()
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # at their defaults: off
FIELDS = {f.name: f for f in SAMPLING_FIELDS}
STAGE_FIELDS = tuple(f.name for f in SAMPLING_FIELDS if f.stage)
# SamplingSpec's fields after STAGE_FIELDS, computed by stage 0: EOS (unless ignore_eos) + stop_token_ids.
STAGE_DERIVED = ("min_tokens_stop_ids",)
