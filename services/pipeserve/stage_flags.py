"""`pipeserve stage`'s flags, in one place: `pipeserve stage` (cli.py) and the operator, which checks
an InferencePipeline's `spec.engine` map against them, build them here.

Import contract: this module imports only the typed configs (config/) and the log flags
(obs/logs.py) — no torch, and not the CLI with its other subcommands (router, up, bench): the
operator's image loads it (tests/test_import_graph.py).
"""

from __future__ import annotations

import argparse

from pipeserve import env as pipeserve_env
from pipeserve.config import EngineConfig, StageServeConfig, add_config_args
from pipeserve.config.fields import flag_help
from pipeserve.config.flags import group
from pipeserve.obs.logs import add_log_args

E = pipeserve_env


def add_stage_args(parser: argparse.ArgumentParser) -> None:
    """The stage's own flags (rank, rendezvous), then EngineConfig's (--model among them) and
    StageServeConfig's. The own flags default to the variables a launcher sets (pipeserve/env.py)."""
    own = group(parser, "serving")
    own.add_argument(
        "--rank", type=int, default=E.get_int(E.RANK), help=flag_help("this stage's rank", "required", E.RANK)
    )
    own.add_argument(
        "--world-size",
        type=int,
        default=E.get_int(E.WORLD_SIZE),
        help=flag_help("the group's number of stages", "required", E.WORLD_SIZE),
    )
    own.add_argument(
        "--master-addr",
        default=E.get(E.MASTER_ADDR),
        help=flag_help("stage 0's rendezvous host", "none", E.MASTER_ADDR),
    )
    own.add_argument(
        "--master-port",
        type=int,
        default=E.get_int(E.MASTER_PORT),
        help=flag_help("stage 0's rendezvous port", "none", E.MASTER_PORT),
    )
    own.add_argument(
        "--rendezvous-file",
        default=E.get(E.RENDEZVOUS_FILE),
        help=flag_help(
            "rendezvous through a file (stages on one machine) instead of MASTER_ADDR:MASTER_PORT",
            "none",
            E.RENDEZVOUS_FILE,
        ),
    )
    add_config_args(parser, EngineConfig, skip={"stages", "log_dir"})
    add_config_args(parser, StageServeConfig, skip=set())


def stage_parser() -> argparse.ArgumentParser:
    """A parser of exactly what `pipeserve stage` accepts after the subcommand (log flags included)."""
    parser = argparse.ArgumentParser(prog="pipeserve stage")
    add_stage_args(parser)
    add_log_args(parser)
    return parser
