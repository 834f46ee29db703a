"""Every setting is declared once with its help, and `--help` explains every flag with its default.

The flags of `pipeserve up`, `stage`, `router` and `generate` come from the config fields'
declarations (services/pipeserve/config/fields.py: `opt`); an internal field is a flag without help.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import fields

import pytest

from pipeserve.cli import build_parser
from pipeserve.config import CONFIGS, GROUPS, EngineConfig, StageServeConfig, SupervisorConfig, config_argv
from pipeserve.config.fields import help_text
from pipeserve.model.default import DEFAULT_MODEL_NAME

SUBCOMMANDS = ("up", "stage", "router", "generate")


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _internal_flags() -> set[str]:
    out = set()
    for cls in CONFIGS:
        for f in fields(cls):
            if f.metadata.get("internal"):
                flag = f.name.replace("_", "-")
                out |= {"--" + flag, "--supervisor-" + flag}
    return out


def test_every_field_is_declared_with_help_and_group() -> None:
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in CONFIGS
        for f in fields(cls)
        if not f.metadata.get("help") or f.metadata.get("group") not in GROUPS
    ]
    assert missing == [], f"declare them with config.fields.opt(default, help, group=...): {missing}"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_flag_is_explained_with_its_default(command: str) -> None:
    internal = _internal_flags()
    bad = []
    for action in _subparser(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0]
        if action.help == argparse.SUPPRESS:
            if name not in internal:
                bad.append(f"{name}: hidden but not an internal field")
        elif not action.help or not re.search(r"\bdefault\b", action.help, re.IGNORECASE):
            bad.append(f"{name}: {action.help!r}")
    assert bad == [], f"`pipeserve {command} --help` leaves flags unexplained: {bad}"


def test_help_text_has_the_fields_default_unit_range_and_env() -> None:
    by_name = {f.name: f for f in fields(EngineConfig)}
    assert help_text(by_name["step_target_ms"]).endswith("(unit: ms; >= 0; default: 250.0)")
    assert "env PIPESERVE_HICACHE_URL" in help_text(by_name["hicache_url"])
    assert "default: on" in help_text(by_name["enable_prefix_caching"])


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()


def test_model_help_names_the_model_served_by_default() -> None:
    text = " ".join(_help("up").split())
    assert f"default: {DEFAULT_MODEL_NAME}," in text


def test_internal_fields_are_hidden_but_still_flags(tmp_path) -> None:
    text = _help("up")
    assert "--num-kv-blocks" not in text and "--supervisor-start-grace-s" not in text
    assert "--kv-cache-gb" in text
    args = build_parser().parse_args(["up", "--num-kv-blocks", "64", "--supervisor-start-grace-s", "9"])
    assert args.num_kv_blocks == 64 and args.supervisor_start_grace_s == 9.0
    # a launcher passes an internal field on to its stages as a flag the stage parses
    engine = EngineConfig(model=str(tmp_path), num_kv_blocks=64, heartbeat_s=2.0)
    stage = build_parser().parse_args(["stage", *config_argv(engine)])
    assert stage.num_kv_blocks == 64 and stage.heartbeat_s == 2.0


def test_flags_are_grouped_as_users_look_for_them() -> None:
    groups = {g.title: g for g in _subparser("up")._action_groups}
    assert set(GROUPS) <= set(groups)
    flags = {t: {o for a in g._group_actions for o in a.option_strings} for t, g in groups.items()}
    assert {"--model", "--stages", "--quantization"} <= flags["model"]
    assert {"--kv-cache-gb", "--hicache-url", "--host-cache-gb"} <= flags["cache"]
    assert {"--policy", "--api-key", "--port"} <= flags["router"]
    assert {"--wedge-timeout-s", "--supervisor-backoff-s"} <= flags["supervision"]
    assert {"--flight-dir", "--log-dir"} <= flags["observability"]


def test_up_help_fits_a_screen_per_group() -> None:
    """At 100 columns, no group of `pipeserve up --help` is longer than a 50-line terminal."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "100")
        text = _help("up")
    sections = re.split(r"\n(?=[a-z]+:\n)", text)
    long = {s.split(":")[0]: s.count("\n") for s in sections if s.count("\n") > 50}
    assert long == {}, long


def test_prefixed_and_shared_fields_keep_one_flag() -> None:
    """StageServeConfig and RouterConfig share served_model_name; the supervisor's fields take a prefix."""
    actions = _subparser("up")._actions
    names = [o for a in actions for o in a.option_strings]
    assert len(names) == len(set(names))
    assert all("--supervisor-" + f.name.replace("_", "-") in names for f in fields(SupervisorConfig))
    assert "--drain-timeout-s" in [o for a in _subparser("router")._actions for o in a.option_strings]
    assert StageServeConfig().drain_timeout_s == _subparser("router").get_default("drain_timeout_s")


def test_declared_ranges_are_checked(tmp_path) -> None:
    from pipeserve.config import RouterConfig
    from pipeserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_num_seqs: must be >= 1 \(got 0\)"):
        EngineConfig(model=str(tmp_path), max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"kv_cache_memory_fraction: must be in \(0, 0.9\]"):
        EngineConfig(model=str(tmp_path), kv_cache_memory_fraction=0.95)
    with pytest.raises(ConfigError, match=r"port: must be in \[0, 65535\]"):
        RouterConfig(model=str(tmp_path), port=65536)
    EngineConfig(model=str(tmp_path), kv_cache_memory_fraction=0.9, max_model_len=None)  # bounds, None


def test_help_shows_the_declared_default_not_the_environments(monkeypatch) -> None:
    """An environment variable replaces a flag's default, but --help never prints its value (an API key)."""
    monkeypatch.setenv("PIPESERVE_API_KEY", "sk-secret-value")
    assert build_parser().parse_args(["up"]).api_key == "sk-secret-value"
    text = _help("up")
    assert "sk-secret-value" not in text and "env PIPESERVE_API_KEY" in " ".join(text.split())
