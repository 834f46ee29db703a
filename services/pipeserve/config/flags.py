"""The command-line form of the configs: one flag per field, and back (`config_argv`).

`add_config_args` turns each field's declaration (fields.py: `opt`) into a flag of the argument
group the field names, with its help text (description, unit, range, default, environment
variable); an internal field is a flag without help (argparse.SUPPRESS). A launcher turns a config
back into the argv of a stage process with `config_argv`, so nothing is listed twice.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, fields
from typing import TypeVar

from pipeserve import env as pipeserve_env
from pipeserve.config.fields import GROUPS, help_text

T = TypeVar("T")
# Fields a stage process takes from its launcher, not from its own flags.
NOT_FLAGS = {"model", "stages", "log_dir"}
_METAVARS = {int: "N", float: "X", str: "S"}


def _flag_type(cls: type, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def group(parser: argparse.ArgumentParser, name: str) -> argparse._ArgumentGroup:
    """The parser's argument group `name` (fields.GROUPS), made on first use: flags of several
    configs share it."""
    for existing in parser._action_groups:
        if existing.title == name:
            return existing
    return parser.add_argument_group(name, GROUPS[name])


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, skip: set[str] = NOT_FLAGS, prefix: str = ""
) -> None:
    """One flag per dataclass field (`--max-num-seqs`; `--{prefix}-...` with a prefix), defaulting
    to the field's default, or to its environment variable (`env`) when that is set and non-empty."""
    for f in fields(cls):
        if f.name in skip:
            continue
        dest = prefix + f.name
        names = ["--" + dest.replace("_", "-")]
        kind = _flag_type(cls, f.name)
        default = None if f.default is MISSING else f.default
        if (env := f.metadata.get("env")) and (value := pipeserve_env.get(env)):
            default = value  # a string: argparse converts it with `type`
        shown = argparse.SUPPRESS if f.metadata.get("internal") else help_text(f)
        where = group(parser, f.metadata["group"])
        if kind is bool:
            where.add_argument(
                *names, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=shown
            )
        else:
            choices = f.metadata.get("choices")
            metavar = None if choices else _METAVARS.get(kind)
            where.add_argument(
                *names, dest=dest, type=kind, default=default, choices=choices, help=shown, metavar=metavar
            )


def config_from_args(
    cls: type[T], args: argparse.Namespace, skip: set[str] = NOT_FLAGS, prefix: str = "", **fixed
) -> T:
    """The config of the parsed flags; `fixed` values win over flags of the same name."""
    values = {f.name: getattr(args, prefix + f.name) for f in fields(cls) if f.name not in skip}  # type: ignore[arg-type]
    return cls(**{**values, **fixed})


def config_argv(config: object, skip: set[str] = NOT_FLAGS) -> list[str]:
    """The flags that reproduce `config` through add_config_args (defaults omitted)."""
    argv: list[str] = []
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if f.name in skip or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv
