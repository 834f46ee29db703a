"""Every environment variable pipeserve reads, declared and read here only.

A variable is declared once (`_var`: its name, what it does, its default); the rest of the tree
names it by the constant below and reads it with `get` / `get_int` (tests/test_configuration_env.py
fails on an `os.environ` read or a `PIPESERVE_*` name written anywhere else in services/ or
operator/). The operator reads its variables here too: it runs from the same installed
distribution (its image carries `pipeserve`, whose stage flags it checks), so one list documents
every variable of every process. docs/configuration.md lists them (scripts/gen_config_docs.py).
An empty variable counts as unset everywhere.

Import contract: the standard library only (the router's and the operator's images load it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Var:
    name: str
    help: str  # one line: what it sets, and who reads it
    default: str = ""  # as the docs show it; "" means unset


VARS: dict[str, Var] = {}


def _var(name: str, help: str, default: str = "") -> str:
    VARS[name] = Var(name, help, default)
    return name


# --- every process ---------------------------------------------------------------------------------
HOME = _var(
    "PIPESERVE_HOME",
    "caches: the default model, converted GGUF files, model checks, flight dumps",
    "~/.cache/pipeserve",
)
LOG_FORMAT = _var("PIPESERVE_LOG_FORMAT", "text or json (--log-format); exported to children", "text")
LOG_LEVEL = _var("PIPESERVE_LOG_LEVEL", "log level (--log-level); exported to children", "INFO")
TRACE_FILE = _var("PIPESERVE_TRACE_FILE", "append every OpenTelemetry span as one JSON line to this file")
# --- flags' defaults (docs/configuration.md's env column) ------------------------------------------
MODEL = _var("PIPESERVE_MODEL", "--model of up, stage and router")
HICACHE_URL = _var("PIPESERVE_HICACHE_URL", "--hicache-url (the operator sets it from spec.hicache)")
FLIGHT_DIR = _var("PIPESERVE_FLIGHT_DIR", "--flight-dir: where flight dumps are written")
API_KEY = _var("PIPESERVE_API_KEY", "--api-key: the router's bearer token (the chart's apiKey Secret)")
UPSTREAM = _var("PIPESERVE_UPSTREAM", "router --upstream")
DISCOVER = _var("PIPESERVE_DISCOVER", "router --discover")
NAMESPACE = _var("PIPESERVE_NAMESPACE", "router --namespace")
PIPELINE = _var("PIPESERVE_PIPELINE", "router --pipeline")
MODELS = _var("PIPESERVE_MODELS", "router --models")
POLICY = _var("PIPESERVE_POLICY", "router --policy")
# --- set by a launcher for the process it starts -----------------------------------------------------
RANK = _var("PIPESERVE_RANK", "stage --rank (set by the operator from the pod's index)")
WORLD_SIZE = _var("PIPESERVE_WORLD_SIZE", "stage --world-size (set by the operator)")
RENDEZVOUS_FILE = _var("PIPESERVE_RENDEZVOUS_FILE", "stage --rendezvous-file")
GROUP = _var("PIPESERVE_GROUP", "a stage's group, named in its logs and flight dumps (set by its launcher)")
PARENT_PID = _var("PIPESERVE_PARENT_PID", "a local stage exits when this process is gone (local launcher)")
# --- testing and kernels ---------------------------------------------------------------------------
FAULTS = _var("PIPESERVE_FAULTS", "fault injection for tests, JSON of ring/faults.py's Faults")
KERNELS = _var(
    "PIPESERVE_KERNELS",
    "auto, torch or triton: the kernel backend (read by pipeserve_kernels, its own package)",
    "auto",
)
# --- other software's conventions, read here too ---------------------------------------------------
MASTER_ADDR = _var("MASTER_ADDR", "stage --master-addr (torch's convention; set by the operator)")
MASTER_PORT = _var("MASTER_PORT", "stage --master-port (torch's convention; set by the operator)")
POD_NAMESPACE = _var("POD_NAMESPACE", "the operator's namespace and lease namespace (downward API)")
POD_NAME = _var("POD_NAME", "the operator's leader-election identity (downward API)", "the host name")
KUBERNETES_SERVICE_HOST = _var("KUBERNETES_SERVICE_HOST", "set in a pod: router discovery's in-cluster auth")


def get(name: str) -> str | None:
    """The variable's value; None when unset or empty."""
    return os.environ.get(name) or None


def get_int(name: str) -> int | None:
    value = get(name)
    return int(value) if value is not None else None


def home() -> Path:
    """$PIPESERVE_HOME, else ~/.cache/pipeserve: the one place its default is applied."""
    return Path(get(HOME) or Path.home() / ".cache" / "pipeserve")


def environ() -> Mapping[str, str]:
    """The whole environment, for a reader of variables it does not own (OpenTelemetry's OTEL_*,
    which its SDK reads as well)."""
    return os.environ
