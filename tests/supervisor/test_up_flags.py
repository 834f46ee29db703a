"""`pipeserve up`'s flags are the config dataclasses' fields: every field it does not fix itself
is a flag, parsed into the config that `pipeserve up` builds (nothing listed twice, nothing left
unsettable), with the older spellings still accepted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipeserve.cli import build_parser
from pipeserve.config import EngineConfig, RouterConfig, StageServeConfig, SupervisorConfig
from pipeserve.supervisor.up import SUPERVISOR_PREFIX, UpConfigs, build_configs

# A valid value other than the default, for the fields whose default cannot simply be doubled.
SPECIAL = {
    "dtype": "float32",
    "device": "cuda",
    "max_model_len": 64,
    "num_kv_blocks": 64,
    "kv_cache_gb": 0.5,
    "kv_cache_dtype": "float16",
    "quantization": "int8",
    "num_threads": 1,
    "layer_split": "0:2",
    "max_inflight": 3,
    "policy": "least_load",
    "api_key": "sk-test",
    "chat_template": "{{ messages[0]['content'] }}",
    "tool_call_parser": "hermes",
    "generation_config": "vllm",
    "reasoning_parser": "qwen3",
    "host": "127.0.0.2",
    "port": 8123,
    "served_model_name": "served-name",
    "seed": 7,
    "hicache_url": "redis://127.0.0.1:6390/1",
    "host_cache_gb": 0.25,
    "hicache_ttl_s": 600,
    "hicache_write_policy": "always",
    "flight_dir": "/tmp/pipeserve-flight-test",
}
FIXED = {  # what `pipeserve up` sets itself or from its own flags (config: fields)
    "engine": {"model", "stages", "log_dir"},
    "serve": {"host", "health_port", "grpc_port", "served_model_name"},
    "router": {"model", "served_model_name"},
    "supervisor": set(),
}


def _other_value(cls: type, f: dataclasses.Field) -> object:
    if f.name in SPECIAL:
        return SPECIAL[f.name]
    if isinstance(f.default, bool):
        return not f.default
    assert isinstance(f.default, int | float), f"{cls.__name__}.{f.name}: give it a SPECIAL value"
    return f.default * 2


def _argv(cls: type, f: dataclasses.Field, value: object, prefix: str = "") -> list[str]:
    flag = "--" + (prefix + f.name).replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def test_every_config_field_is_a_flag_of_up(llama_dir: Path) -> None:
    argv = ["up", "--model", str(llama_dir), "--stages", "1", "--replicas", "2"]
    argv += ["--served-model-name", "served-name"]
    expect: dict[str, dict[str, object]] = {}
    for part, cls, prefix in (
        ("engine", EngineConfig, ""),
        ("serve", StageServeConfig, ""),
        ("router", RouterConfig, ""),
        ("supervisor", SupervisorConfig, SUPERVISOR_PREFIX),
    ):
        for f in dataclasses.fields(cls):
            if f.name in FIXED[part]:
                continue
            value = _other_value(cls, f)
            expect.setdefault(part, {})[f.name] = value
            argv += _argv(cls, f, value, prefix)
    configs = build_configs(build_parser().parse_args(argv))
    assert isinstance(configs, UpConfigs) and configs.replicas == 2
    for part, values in expect.items():
        got = {name: getattr(getattr(configs, part), name) for name in values}
        assert got == values, part
    # What up fixes itself: stage ports stay local, one name for the router and the stages.
    assert configs.serve.host == "127.0.0.1"
    assert configs.serve.served_model_name == configs.router.served_model_name == "served-name"
    assert configs.router.model == configs.engine.model == str(llama_dir)


def test_the_timeouts_and_the_environment(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESERVE_API_KEY", "from-env")
    old = ["--wedge-timeout-s", "7", "--wedge-grace-s", "2", "--drain-timeout-s", "9"]
    configs = build_configs(build_parser().parse_args(["up", "--model", str(llama_dir), *old]))
    assert (configs.serve.wedge_timeout_s, configs.serve.wedge_grace_s, configs.serve.drain_timeout_s) == (
        7.0,
        2.0,
        9.0,
    )
    assert configs.router.api_key == "from-env"
    assert configs.router.served_model_name == str(llama_dir)  # no --served-model-name: the path given


def test_a_bad_value_is_refused_by_the_parser_or_the_config(llama_dir: Path) -> None:
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        build_parser().parse_args(["up", "--model", str(llama_dir), "--policy", "random"])
    args = build_parser().parse_args(["up", "--model", str(llama_dir), "--supervisor-backoff-s", "0"])
    with pytest.raises(ValueError, match="backoff_s"):
        build_configs(args)
