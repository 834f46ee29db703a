"""The servers of a side-by-side: one already running, or one the bench starts for each session.

A session is what a server serves a run of cells in: `session(key, ready)` yields a `Live` (its URL,
the root pid of its process tree, an RSS sampler over that tree, the time it took to be ready). Cells
that need the server started another way (llama-server with more slots for C=64, a larger context
for long prompts) have another `launch_key`, and get a session of their own.

  - `RunningServer`: started by someone else (`pipeserve bench --compare URL`): every cell shares one
    key, a session only starts the sampler (when a pid is known) and ready time is not measured;
  - `LaunchedServer`: `argv_for(key, port)` is started in its own process group when the session
    opens and stopped (SIGTERM to the group, SIGKILL after a grace) when it closes, so only one
    server runs at a time. Ready time: from just before the process is spawned to the first
    successful 1-token completion of the session's `ready` prompt (fresh, like every prompt: its
    computing counts in no pass, and it leaves nothing a later prompt could reuse).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pipeserve.bench.cells import Cell
from pipeserve.bench.host import RssSampler
from pipeserve.bench.workloads import BenchRequest


@dataclass
class Live:
    url: str
    pid: int | None
    sampler: RssSampler | None
    ready_s: float | None = None
    argv: list[str] | None = None


@dataclass
class RunningServer:
    """A server someone else started; `pid` (optional) roots the process tree whose RSS is sampled."""

    url: str
    pid: int | None = None
    # True when the server is known to be `pipeserve up`: its prefix-cache counters must be readable.
    pipeserve: bool = False
    api_key: str | None = None
    model: str | None = None  # None: the first of GET /v1/models

    def describe(self) -> str:
        return self.url + (f" (pid {self.pid})" if self.pid else "")

    def launch_key(self, cell: Cell) -> str:
        return "running"

    @contextlib.contextmanager
    def session(self, key: str, ready: BenchRequest) -> Iterator[Live]:
        if self.pid is None:
            yield Live(self.url, None, None)
            return
        with RssSampler(self.pid) as sampler:
            yield Live(self.url, self.pid, sampler)


def complete_once(url: str, req: BenchRequest, timeout_s: float, api_key: str | None = None) -> bool:
    """One greedy 1-token completion of `req`'s prompt; True when it answered 200 with a choice."""
    body = {"prompt": req.prompt if req.text is None else req.text, "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(
            url + "/v1/completions", json=body, headers=headers, timeout=timeout_s, trust_env=False
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json().get("choices"))


@dataclass
class LaunchedServer:
    """A server this bench starts per session: `argv_for(key, port)`, logs under `log_dir`."""

    name: str
    argv_for: Callable[[str, int], list[str]]
    key_for: Callable[[Cell], str]
    port: int
    log_dir: Path
    pipeserve: bool = False
    api_key: str | None = None
    model: str | None = None  # None: the first of GET /v1/models
    ready_timeout_s: float = 600.0
    env: dict[str, str] | None = None
    commands: dict[str, list[str]] = field(default_factory=dict)  # every argv used, by launch key

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def describe(self) -> str:
        return self.name

    def launch_key(self, cell: Cell) -> str:
        return self.key_for(cell)

    @contextlib.contextmanager
    def session(self, key: str, ready: BenchRequest) -> Iterator[Live]:
        argv = self.argv_for(key, self.port)
        self.commands[key] = argv
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{self.name.split()[0]}-{key}.log".replace("/", "_")
        with open(log, "ab") as out:
            start = time.monotonic()
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(self.env or {})},
            )  # fmt: skip
        try:
            with RssSampler(proc.pid) as sampler:
                ready_s = self._wait_ready(proc, ready, start, log)
                yield Live(self.url, proc.pid, sampler, ready_s, argv)
        finally:
            stop_group(proc)

    def _wait_ready(self, proc: subprocess.Popen, ready: BenchRequest, start: float, log: Path) -> float:
        while not complete_once(self.url, ready, 60.0, self.api_key):
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({proc.returncode}) before ready; see {log}")
            if time.monotonic() - start > self.ready_timeout_s:
                raise RuntimeError(f"{self.name} not ready after {self.ready_timeout_s:g} s; see {log}")
            time.sleep(0.05)  # the ready time's resolution
        return time.monotonic() - start


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> int:
    """SIGTERM to the process's group (it was started in its own session), SIGKILL after `grace_s`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode
