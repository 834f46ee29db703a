"""LocalGroup: the followers of a pipeline group as child processes of stage 0's process.

Used by the offline `LLM(stages=S)` (stage 0 runs in the caller's process)
and by the local supervisor (`pipeserve up`: every stage is a child). Rendezvous is a file in a private
directory: nothing listens on a port, and gloo binds to 127.0.0.1.

No orphans: children exit when the ring breaks (stage 0 gone closes their
links), when their parent process is gone (they watch PIPESERVE_PARENT_PID),
and `stop()` waits a bounded time, then kills what is left.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pipeserve import env as pipeserve_env
from pipeserve.config import EngineConfig, config_argv
from pipeserve.obs.logs import GROUP_ENV

if TYPE_CHECKING:  # ring.group imports torch: `pipeserve up` (which never runs a stage) must not (start-up)
    from pipeserve.ring.group import Rendezvous

log = logging.getLogger(__name__)

PARENT_ENV = pipeserve_env.PARENT_PID


def local_group_config(config: EngineConfig, processes: int | None = None) -> EngineConfig:
    """Share one machine between `processes` stage processes (default: the group's S stages):
    threads and the memory-derived KV budget per stage, unless the caller set them."""
    n = processes if processes is not None else config.stages
    changes: dict = {}
    if config.num_threads is None:
        changes["num_threads"] = max(1, (os.cpu_count() or 1) // n)
    if config.num_kv_blocks is None and config.kv_cache_gb is None:
        changes["kv_cache_memory_fraction"] = config.kv_cache_memory_fraction / n
    return dataclasses.replace(config, **changes)


class LocalGroup:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dir = Path(tempfile.mkdtemp(prefix="pipeserve-group-"))
        self.rendezvous_file = str(self.dir / "rendezvous")
        self.procs: dict[int, subprocess.Popen] = {}

    def rendezvous(self, rank: int = 0) -> Rendezvous:
        from pipeserve.ring.group import Rendezvous

        return Rendezvous(rank, self.config.stages, file=self.rendezvous_file)

    def start(
        self,
        ranks: range | None = None,
        extra_argv: Callable[[int], list[str]] | None = None,
        log_name: Callable[[int], str] = "stage-{}.log".format,
        group: str | None = None,
    ) -> None:
        """Start the stage processes of `ranks` (default 1..S-1: stage 0 is the caller). They inherit
        this process's environment (PIPESERVE_LOG_FORMAT / _LEVEL included); `group` names the group
        in their log lines."""
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        if group is not None:
            env[GROUP_ENV] = group
        ranks = range(1, self.config.stages) if ranks is None else ranks
        for rank in ranks:
            argv = [
                sys.executable,
                "-m",
                "pipeserve.cli",
                "stage",
                "--model",
                self.config.model,
                "--rank",
                str(rank),
                "--world-size",
                str(self.config.stages),
                "--rendezvous-file",
                self.rendezvous_file,
                *config_argv(self.config),
                *(extra_argv(rank) if extra_argv else ()),
            ]
            out = None
            if self.config.log_dir:
                Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
                out = open(Path(self.config.log_dir) / log_name(rank), "ab")
            try:
                self.procs[rank] = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                )
            finally:
                if out is not None:
                    out.close()  # the child holds its own descriptor
        log.info("started stages %s: pids %s", list(ranks), [self.procs[r].pid for r in ranks])

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def exited(self) -> dict[int, int]:
        """rank -> exit status of the children that have exited."""
        return {rank: rc for rank, p in self.procs.items() if (rc := p.poll()) is not None}

    def stop(self, grace_s: float = 10.0) -> dict[int, int]:
        """Wait up to grace_s for every child to exit, then terminate and kill; returns exit statuses."""
        deadline = time.monotonic() + grace_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            for p in self.procs.values():
                if sig is not None and p.poll() is None:
                    p.send_signal(sig)
            for p in self.procs.values():
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if all(p.poll() is not None for p in self.procs.values()):
                break
            if sig is not None:
                log.warning("stages did not exit after %s", sig.name)
            deadline = time.monotonic() + 5.0
        shutil.rmtree(self.dir, ignore_errors=True)
        return {rank: p.returncode for rank, p in self.procs.items()}
