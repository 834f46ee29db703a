"""`pipeserve stage`'s flags, in one place: `pipeserve stage` (cli.py) and the operator, which checks
an InferencePipeline's `spec.engine` map against them, build them here.

Import contract: this module imports only the typed configs (config.py) and the log flags
(obs/logs.py) — no torch, and not the CLI with its other subcommands (router, up, bench): the
operator's image loads it (tests/test_import_graph.py).
"""

from __future__ import annotations

import argparse
import os

from pipeserve.config import EngineConfig, StageServeConfig, add_config_args
from pipeserve.obs.logs import add_log_args


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def add_stage_args(parser: argparse.ArgumentParser) -> None:
    """The stage's own flags (model, rank, rendezvous), then EngineConfig's and StageServeConfig's."""
    parser.add_argument("--model", default=os.environ.get("PIPESERVE_MODEL"))
    parser.add_argument("--rank", type=int, default=_env_int("PIPESERVE_RANK"))
    parser.add_argument("--world-size", type=int, default=_env_int("PIPESERVE_WORLD_SIZE"))
    parser.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"))
    parser.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"))
    parser.add_argument(
        "--rendezvous-file",
        default=os.environ.get("PIPESERVE_RENDEZVOUS_FILE"),
        help="rendezvous through a file (stages on one machine) instead of MASTER_ADDR:MASTER_PORT",
    )
    add_config_args(parser, EngineConfig)
    add_config_args(parser, StageServeConfig, skip=set())


def stage_parser() -> argparse.ArgumentParser:
    """A parser of exactly what `pipeserve stage` accepts after the subcommand (log flags included)."""
    parser = argparse.ArgumentParser(prog="pipeserve stage")
    add_stage_args(parser)
    add_log_args(parser)
    return parser
