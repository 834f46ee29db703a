"""The one list of sampling fields: name, type, default, bounds, help, and where each one travels.

Derived from it (and checked against it by tests/test_sampling_fields.py):
* `SamplingParams` (sampling_params.py): its fields are these, in this order, with these types and
  defaults; `validate` enforces each field's numeric bounds from here (the other checks, of shape,
  are its own);
* the OpenAPI document (router/openapi.py): each field's JSON `minimum` / `maximum` /
  `exclusiveMinimum` and its description;
* `pipeserve generate`'s flags (cli.py): one flag per field marked `cli`;
* `SamplingSpec` (engine/plan.py, a msgspec Struct whose fields must be written out): its fields
  are the `stage` fields, in this order, then `STAGE_DERIVED` (a test compares them);
* the protobuf (rpc/generation.proto): the `wire` fields, by name (rpc/convert.py checks at import).

Defaults that differ per surface are here too: the completions API's `max_tokens` is
DEFAULT_MAX_TOKENS (OpenAI, vLLM), chat's is None (up to the context, resolved against the prompt
by sampling_params.resolve_max_tokens), and `pipeserve generate` has its own `cli_default`.
A field marked `model_default` takes the model's generation_config.json value first, when a request
leaves it unset (request_defaults.py).
Adding a sampling field: a row here, the field in SamplingParams (and its shape check), the proto
field (then `make proto`) and SamplingSpec's when it travels, and the engine code that acts on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "max_tokens",
        int | None,
        DEFAULT_MAX_TOKENS,
        "tokens to generate at most",
        minimum=1,
        stage=False,
        cli=True,
        cli_default=GENERATE_MAX_TOKENS,
        model_default="max_new_tokens",
    ),
    SamplingField(
        "temperature",
        float,
        1.0,
        "below 1e-5: greedy",
        minimum=0,
        cli=True,
        cli_default=0.0,
        model_default="temperature",
    ),
    SamplingField(
        "top_k", int, -1, "-1 or 0: off", minimum=-1, maximum=MAX_TOP_K, cli=True, model_default="top_k"
    ),
    SamplingField(
        "top_p",
        float,
        1.0,
        "nucleus mass kept",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        cli=True,
        model_default="top_p",
    ),
    SamplingField(
        "min_p",
        float,
        0.0,
        "min probability, relative to the top token's",
        minimum=0,
        maximum=1,
        cli=True,
        model_default="min_p",
    ),
    SamplingField("seed", int | None, None, "per-request seed", minimum=0, maximum=MAX_SEED, cli=True),
    SamplingField("stop", list[str], (), "stop strings (the router's: not sent)", wire=False, stage=False),
    SamplingField("stop_token_ids", list[int], (), "token ids that end the output", stage=False),
    SamplingField("ignore_eos", bool, False, "generate past EOS", stage=False, cli=True),
    SamplingField(
        "logprobs",
        int | None,
        None,
        "the sampled token's logprob and the top k",
        minimum=0,
        maximum=MAX_LOGPROBS,
    ),
    SamplingField("structured_kind", str, "", "json, json_object, regex, choice, grammar; '' off"),
    SamplingField("structured", str, "", "the schema, regex, JSON list of choices or EBNF"),
    SamplingField("structured_compact", bool, False, "JSON without free whitespace"),
    SamplingField(
        "prompt_logprobs",
        int | None,
        None,
        "vLLM's extension: each prompt token's logprob, rank and the top k there "
        "(completions: per choice; chat: top level; streamed in the first chunk); no prefix-cache hit",
        minimum=0,
        maximum=MAX_LOGPROBS,
    ),
    SamplingField(
        "presence_penalty", float, 0.0, "over the output tokens so far", minimum=-2, maximum=2, cli=True
    ),
    SamplingField(
        "frequency_penalty", float, 0.0, "x each output token's count", minimum=-2, maximum=2, cli=True
    ),
    SamplingField(
        "repetition_penalty",
        float,
        1.0,
        "over prompt and output tokens; 1: off",
        minimum=0,
        exclusive_minimum=True,
        cli=True,
        model_default="repetition_penalty",
    ),
    SamplingField("logit_bias", dict[int, float], {}, "token id -> bias added to its logit, in [-100, 100]"),
    SamplingField(
        "min_tokens",
        int,
        0,
        "no EOS, stop_token_ids or stop string before this many tokens; <= max_tokens",
        minimum=0,
        cli=True,
    ),
)
FIELDS = {f.name: f for f in SAMPLING_FIELDS}
STAGE_FIELDS = tuple(f.name for f in SAMPLING_FIELDS if f.stage)
# SamplingSpec's fields after STAGE_FIELDS, computed by stage 0: EOS (unless ignore_eos) + stop_token_ids.
STAGE_DERIVED = ("min_tokens_stop_ids",)
