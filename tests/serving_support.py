"""Helpers for serving tests: live stage groups (GroupSlot, the supervisor's own launcher),
gRPC calls to stage 0, side-port reads, and `pipeserve up` processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx

from pipeserve.config import EngineConfig, StageServeConfig
from pipeserve.local.ports import PortBook, free_port
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc
from pipeserve.supervisor.group import GroupSlot


def wait_until(
    cond: Callable[[], object], timeout_s: float = 10.0, what: str = "condition", interval_s: float = 0.02
) -> None:
    """Poll cond() until it is true; fails the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(interval_s)


def wait_http(
    url: str, timeout_s: float, status: int = 200, alive: Callable[[], object] = lambda: None
) -> httpx.Response:
    """Poll url until it answers `status`; fails the test at the deadline or when `alive()`
    returns something (e.g. the exit statuses of processes that should be serving)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if dead := alive():
            raise AssertionError(f"waiting for {url}: {dead}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code == status:
                return r
            last = (r.status_code, r.text[:200])
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer {status} within {timeout_s}s (last: {last})")


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample from Prometheus text, matched by name and labels."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (e.g. a counter over causes)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stub(target: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(target))


def greedy_request(rid: str, prompt: list[int], max_tokens: int, **kw) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1, **kw)
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)


def generate(
    s: pb_grpc.GenerationStub, req: pb.GenerateRequest, timeout_s: float = 60
) -> tuple[list[int], str]:
    tokens: list[int] = []
    finish = ""
    for msg in s.Generate(req, timeout=timeout_s):
        tokens += msg.token_ids
        finish = msg.finish_reason or finish
    return tokens, finish


def wait_compilers(health_url: str, timeout_s: float = 120) -> None:
    """A grammar compiler worker of this stage 0 is warm. The workers start beside the ready stage
    (its time to Ready does not wait for their imports, 2-30 s of CPU on a loaded machine), and a
    structured request sent before one is warm waits for it, past a test harness's short deadline
    to a first message (the product's is 120 s)."""

    def warm() -> bool:
        text = httpx.get(health_url + "/metrics", timeout=2).text
        return (metric(text, "pipeserve:grammar_workers") or 0) >= 1

    wait_until(warm, timeout_s, "a grammar compiler worker of stage 0 warm", interval_s=0.2)


@contextlib.contextmanager
def live_group(model_dir: Path, stages: int, log_dir: Path, **serve: object) -> Iterator[GroupSlot]:
    """A group of `stages` live stage processes, ready (every /readyz 200); stopped afterwards."""
    config = EngineConfig(
        model=str(model_dir), stages=stages, num_threads=1, num_kv_blocks=256, log_dir=str(log_dir)
    )
    slot = GroupSlot("group-t", config, StageServeConfig(**serve))  # type: ignore[arg-type]
    slot.start()
    try:
        for rank in range(stages):
            wait_http(slot.health_url(rank) + "/readyz", 120, alive=lambda: slot.group_exited())
        wait_compilers(slot.health_url(0))
        yield slot
    finally:
        slot.kill(grace_s=5.0)


class UpProcess:
    """`pipeserve up` as a child process, on free ports; `stop()` signals it and waits."""

    def __init__(self, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "up.log"
        self.ready_line = ""
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        argv = [
            sys.executable,
            "-m",
            "pipeserve.cli",
            "up",
            "--port",
            str(self.port),
            "--log-dir",
            str(log_dir),
        ]
        self.proc = subprocess.Popen(
            [*argv, *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            text=True,
        )

    def wait_ready(self, timeout_s: float = 180) -> str:
        """The one line `pipeserve up` prints when every group is ready."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = ""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            buf += chunk or ""
            if "serving" in buf and buf.endswith("\n"):
                self.ready_line = buf.strip()
                return self.ready_line
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"pipeserve up not ready (exit {self.proc.poll()}): {buf}\n{self.log()[-3000:]}")

    def groups(self) -> list[dict]:
        return httpx.get(self.url + "/groups", timeout=5).json()

    def pids(self) -> dict[str, dict]:
        """Every group's stage pids, by group name."""
        return {g["name"]: g["pids"] for g in self.groups()}

    def assert_unharmed(self, pids: dict[str, dict], model: str) -> None:
        """No group restarted, no stage process replaced since `pids`, and a normal request answered."""
        groups = self.groups()
        assert [g["restarts"] for g in groups] == [0] * len(groups), groups
        assert {g["name"]: g["pids"] for g in groups} == pids, "a stage process was replaced"
        r = httpx.post(
            self.url + "/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)
        finally:
            self._log.close()


@contextlib.contextmanager
def running_up(*args: str, log_dir: Path, env: dict[str, str] | None = None) -> Iterator[UpProcess]:
    """`pipeserve up ARGS` once every group is ready (`ready_line` holds its line); afterwards it is
    stopped with SIGTERM and must exit 0."""
    server = UpProcess(*args, log_dir=log_dir, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        # the signal by its name: "shutting down (signal 1)" read like SIGHUP
        assert "SIGTERM: shutting down" in server.log(), server.log()[-3000:]


@contextlib.contextmanager
def live_slots(config: EngineConfig, names: tuple[str, ...] = ("g0", "g1")) -> Iterator[dict[str, GroupSlot]]:
    """Groups started by the supervisor's own GroupSlot, each ready (stage 0's /readyz); killed afterwards."""
    ports = PortBook()
    slots = {name: GroupSlot(name, config, StageServeConfig(), ports=ports) for name in names}
    try:
        for s in slots.values():
            s.start()
        for s in slots.values():
            wait_http(s.health_url(0) + "/readyz", 120, alive=s.group_exited)
        yield slots
    finally:
        for s in slots.values():
            s.kill(grace_s=5.0)
