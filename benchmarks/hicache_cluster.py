"""`pipeserve up` as the HiCache benchmark drives it: started on a free port in its own session,
its groups' stage metrics scraped, requests sent and attributed to the group that served them, and
every stage of every group killed for a restart.

Attribution: a request was served by the one group whose stage 0 counted more
pipeserve:prefix_cache_queries_total after it than before (requests are sent one at a time). Steering:
round_robin alternates between the two groups, so a short filler request moves the turn when the
next request must go to a given group. Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

SMOLLM2_VOCAB = 49152


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """`pipeserve up` in its own session; `stop()` ends it and everything it started."""

    def __init__(self, argv: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._err = open(log_dir / "up.log", "ab")
        cmd = [
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
            cmd + argv, stdout=subprocess.PIPE, stderr=self._err, text=True, start_new_session=True
        )

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        deadline, buf = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            buf += self.proc.stdout.readline() or ""
            if "serving" in buf:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"pipeserve up exited {self.proc.returncode}: {buf}")
            time.sleep(0.2)
        raise TimeoutError(f"pipeserve up not ready in {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._err.close()

    def groups(self) -> list[dict]:
        return httpx.get(self.url + "/groups", timeout=10, trust_env=False).json()


def scrape(health: str) -> dict[str, float]:
    """Every sample of a stage's /metrics page: 'name{labels}' -> value."""
    out = {}
    for line in httpx.get(health + "/metrics", timeout=10, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{")[0] == name and all(w in k for w in want))


class Cluster:
    """The benchmark's view of `up`: group names in order, their stages' metrics, requests."""

    def __init__(self, up: Up, model: str) -> None:
        self.up, self.model = up, model
        self.refresh()

    def refresh(self) -> None:
        self.groups = {g["name"]: g for g in self.up.groups()}
        self.names = sorted(self.groups)

    def stage0(self, name: str) -> dict[str, float]:
        return scrape(self.groups[name]["health"][0])

    def read_bytes(self, name: str) -> float:
        return sum(
            metric(scrape(h), "pipeserve:hicache_l3_read_bytes_total") for h in self.groups[name]["health"]
        )

    def queried(self) -> dict[str, float]:
        return {n: metric(self.stage0(n), "pipeserve:prefix_cache_queries_total") for n in self.names}

    def send(self, prompt: list[int], max_tokens: int = 2) -> tuple[dict, str]:
        """One streamed completion: ({ttft_s, cached_tokens, prompt_tokens}, the group that served it)."""
        before = self.queried()
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        ttft, usage = None, {}
        start = time.perf_counter()
        with httpx.stream(
            "POST", self.up.url + "/v1/completions", json=body, timeout=300, trust_env=False
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if ttft is None and any(c.get("text") for c in chunk.get("choices") or []):
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        after = self.queried()
        served = [n for n in self.names if after[n] > before[n]]
        if ttft is None or len(served) != 1:
            raise RuntimeError(f"no token, or not one serving group ({served})")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": usage.get("prompt_tokens")}, served[
            0
        ]

    def steer(self, target: str, rng: np.random.Generator) -> None:
        """Short fillers until round_robin's next pick is `target` (two groups: they alternate)."""
        for _ in range(4):
            _, served = self.send(ids(rng, 8), max_tokens=1)
            if served != target:
                return
        raise RuntimeError(f"round_robin never moved past {target}")

    def wait_stored(self, name: str, stores_before: float, blocks: int, timeout_s: float = 120) -> None:
        """Until `name`'s stage 0 has written `blocks` more pages, and neither its paced backlog nor
        its writer's queue holds any (or the deadline)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.stage0(name)
            stored = metric(m, "pipeserve:hicache_l3_stores_total") - stores_before
            waiting = metric(m, "pipeserve:hicache_l3_store_queue")
            waiting += metric(m, "pipeserve:hicache_l3_store_backlog")
            if stored >= blocks and waiting == 0:
                return
            time.sleep(0.2)
        print(f"# warning: {name} stored fewer than {blocks} pages in {timeout_s}s", file=sys.stderr)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, SMOLLM2_VOCAB, size=n).tolist()


def restart_groups(c: Cluster, timeout_s: float) -> float:
    """SIGKILL every stage of every group; wait until /groups shows new pids, all ready and routable."""
    old = {n: dict(c.groups[n]["pids"]) for n in c.names}
    start = time.monotonic()
    for n in c.names:
        for pid in old[n].values():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        groups = {g["name"]: g for g in c.up.groups()}
        if all(
            g["state"] == "ready"
            and g["pids"]
            and g["pids"] != old[n]
            and (g.get("router") or {}).get("ready")
            for n, g in groups.items()
        ):
            c.refresh()
            return time.monotonic() - start
    raise TimeoutError(f"groups not ready {timeout_s:.0f}s after the restart")
