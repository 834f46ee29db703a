"""A config field's one declaration: `opt(default, help, group=..., unit=..., range=..., ...)`.

Everything said about a setting is said here, in the field's metadata, and read from it by
  * the flags (flags.py: `--max-num-seqs`, its help text with the default, its argument group),
  * the checks (`check_ranges`, called first by every config's __post_init__: `range`),
  * the environment variable that replaces its default (`env`, a name declared in pipeserve/env.py),
  * docs/configuration.md (scripts/gen_config_docs.py; tests/test_configuration_docs.py keeps it fresh).
A field marked `internal` (a test or tuning knob) is still a flag — launchers pass it on with
`config_argv` — but neither `--help` nor the docs show it.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, Field, field, fields
from typing import Any

from pipeserve.errors import ConfigError

# The argument groups of `--help` and the sections of the docs, as a user looks for a setting.
GROUPS = {
    "model": "what is served and how it is loaded and split into stages",
    "serving": "batching, ports and the group's own deadlines",
    "cache": "the KV pool (L1), host memory (L2) and Redis (L3, HiCache)",
    "router": "the OpenAI-compatible HTTP API and how it picks a group",
    "supervision": "how failures are detected and groups restarted",
    "observability": "logs, flight records",
}
REQUIRED: Any = MISSING  # opt(REQUIRED, ...): the field has no default (the caller always gives it)

# "> 0", ">= 1", "in (0, 0.9]", "in [1, 64]": what check_ranges enforces and the docs show.
_BOUND = re.compile(r"^(>=|>|<=|<) (-?[\d.e+]+)$")
_INTERVAL = re.compile(r"^in ([\[(])(-?[\d.e+]+), (-?[\d.e+]+)([\])])$")


def opt(
    default: Any,
    help: str,
    *,
    group: str,
    unit: str = "",
    range: str = "",
    choices: tuple[str, ...] | None = None,
    env: str | None = None,
    internal: bool = False,
    chart: str = "",
    shown: str = "",
) -> Any:
    """A dataclass field with its description. `range`: a bound ("> 0") or interval ("in (0, 0.9]"),
    checked for values other than None; `chart`: the Helm value that sets it, for the docs; `shown`:
    what the default means when the value itself says little (None: "the checkpoint's")."""
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}")
    if range and not (_BOUND.match(range) or _INTERVAL.match(range)):
        raise ValueError(f"range {range!r}: expected '>= N', '> N' or 'in [a, b]'")
    meta: dict[str, Any] = {
        "help": help,
        "group": group,
        "unit": unit,
        "range": range,
        "choices": choices,
        "env": env,
    }
    meta |= {"internal": internal, "chart": chart, "default_text": shown}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


def in_range(value: float, rule: str) -> bool:
    if m := _BOUND.match(rule):
        op, bound = m.group(1), float(m.group(2))
        return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[op]
    m = _INTERVAL.match(rule)
    assert m is not None, rule
    lo, hi = float(m.group(2)), float(m.group(3))
    above = value >= lo if m.group(1) == "[" else value > lo
    below = value <= hi if m.group(4) == "]" else value < hi
    return above and below


def check_ranges(config: object) -> None:
    """Raise ConfigError naming the first field whose value is outside its declared range."""
    for f in fields(config):  # type: ignore[arg-type]
        rule, value = f.metadata.get("range"), getattr(config, f.name)
        if rule and value is not None and not in_range(value, rule):
            raise ConfigError(f"{f.name}: must be {rule} (got {value!r})")


def checker(config: object):
    """need(cond, field, message): raise ConfigError naming the field and its value unless cond."""

    def need(cond: bool, name: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{name}: {msg} (got {getattr(config, name)!r})")

    return need


def shown_default(f: Field) -> str:
    """The default as --help and the docs show it."""
    if f.default is MISSING:
        return "required"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if f.default is None or f.default == "":
        return "none"
    return str(f.default)


def help_text(f: Field) -> str:
    """One line: the description, unit, range, default and environment variable."""
    meta = f.metadata
    extra = [f"unit: {meta['unit']}"] if meta.get("unit") else []
    extra += [meta["range"]] if meta.get("range") else []
    extra.append(f"default: {meta.get('default_text') or shown_default(f)}")
    extra += [f"env {meta['env']}"] if meta.get("env") else []
    return f"{meta['help']} ({'; '.join(extra)})".replace("%", "%%")


def flag_help(text: str, default: str, env: str | None = None) -> str:
    """The help of a flag that is no config field (a subcommand's own), in help_text's form."""
    return f"{text} (default: {default}{f'; env {env}' if env else ''})".replace("%", "%%")
