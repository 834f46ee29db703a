"""How benchmarks/peer.py starts the two servers it puts side by side, per cell of a sweep.

llama.cpp's `llama-server` runs with the flags of the comparison issue 27 reported —
`-np 16 -c 16384 -t 2 -tb 2` (threads: the CPUs this process may use; 2 on that machine) — wherever
they fit the cell. They give each of the 16 slots 16384 / 16 = 1024 tokens of context (the KV cache
is split per slot), so a cell that needs more is served with more:

  - concurrency above 16 (C=64): `-np C`, one slot per request in flight;
  - a request longer than a slot's 1024 tokens (prompt 2048 + output): slots of the request's length
    rounded up to 256 tokens, and `-c` = slots × that.

Each such choice is its own launch key (`np64-c65536`), so the sweep starts llama-server afresh for
those cells, and the table prints every command used. `pipeserve up` keeps one set of flags for all
cells: the configuration's (`CONFIGS`), `make run`'s own being `s1` (one stage, and
`--quantization gguf` for the Q4_1 file; L3 on when redis-server is installed, as `make run`
installs it).
"""

from __future__ import annotations

import math
import os
import shutil

from pipeserve.bench.cells import Cell

ISSUE_SLOTS, ISSUE_CTX = 16, 16384
SLOT_ROUND = 256
# name -> (stages, extra `pipeserve up` flags, description)
CONFIGS: dict[str, tuple[int, list[str], str]] = {
    "s2": (2, [], "S=2, L3 as `make run`"),
    "s1": (1, [], "S=1, L3 as `make run` (make run's flags)"),
    "s2-l3off": (2, ["--hicache-url", "off"], "S=2, --hicache-url off"),
    "s1-l3off": (1, ["--hicache-url", "off"], "S=1, --hicache-url off"),
}


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2


def llama_key(cell: Cell) -> str:
    """The launch a cell needs of llama-server: `np{slots}-c{context}`."""
    slots = max(ISSUE_SLOTS, cell.concurrency)
    per_slot = max(ISSUE_CTX // ISSUE_SLOTS, math.ceil(cell.context / SLOT_ROUND) * SLOT_ROUND)
    return f"np{slots}-c{slots * per_slot}"


def llama_argv(server: str, gguf: str, key: str, port: int) -> list[str]:
    slots, ctx = (int(part[len(p) :]) for part, p in zip(key.split("-"), ("np", "c"), strict=True))
    t = str(threads())
    argv = [server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    return [*argv, "-np", str(slots), "-c", str(ctx), "-t", t, "-tb", t]


def l3_state(config: str) -> str:
    """What L3 a configuration serves with on this machine (`pipeserve up` starts redis-server itself)."""
    if "--hicache-url" in CONFIGS[config][1]:
        return "L3 off"
    return "L3 on (private redis-server)" if shutil.which("redis-server") else "L3 off: no redis-server here"


def pipeserve_argv(exe: str, subject_flags: list[str], config: str, port: int, log_dir: str) -> list[str]:
    stages, extra, _ = CONFIGS[config]
    argv = [exe, "up", *subject_flags, "--port", str(port), "--stages", str(stages), *extra]
    return [*argv, "--log-dir", log_dir]
