"""Start-up time of `pipeserve up`: exec to the first 200 on /v1/completions, median of N starts.

Each run execs `pipeserve up --stages S` on the benchmark checkpoint (the one
`benchmarks/offline_throughput.py` writes under $PIPESERVE_HOME; written here if
missing), then POSTs a 1-token completion every 20 ms until one answers 200, and
stops the server (SIGTERM, then SIGKILL after a deadline). It also reads the
`pipeserve up` log's timestamps of the phases it prints and the total RSS of the
process tree once ready. Other processes on the machine slow every phase: the
load average is printed beside the results.

    python benchmarks/startup.py --runs 5
    python benchmarks/startup.py --runs 5 --model default --extra "--quantization gguf"   # make run
    python benchmarks/startup.py --runs 3 --extra "--kv-cache-dtype float16"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
PIPESERVE = Path(sys.executable).with_name("pipeserve")


def bench_model() -> Path:
    """The 169M benchmark checkpoint (hidden 1024, 12 layers, 16 / 4 heads), written if missing."""
    sys.path.insert(0, str(HERE))
    import offline_throughput  # the benchmark that owns the checkpoint's spec

    args = offline_throughput.parse_args([])
    offline_throughput.ensure_model(args)
    return Path(args.model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant (each process's own RSS, summed)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def complete(url: str, body: dict, timeout_s: float) -> int:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


class Up:
    """`pipeserve up` as a child process in its own session, stopped on exit."""

    def __init__(self, model: Path | None, stages: int, extra: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(PIPESERVE),
            "up",
            *(["--model", str(model)] if model is not None else []),
            "--stages",
            str(stages),
            "--port",
            str(self.port),
        ]
        self.log = log.open("w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            argv + extra, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_first_200(self, deadline_s: float, body: dict) -> float:
        while time.monotonic() - self.t0 < deadline_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pipeserve up exited {self.proc.returncode} (see {self.log.name})")
            if complete(self.url, body, 5.0) == 200:
                return time.monotonic() - self.t0
            time.sleep(0.02)
        raise TimeoutError(f"no 200 within {deadline_s} s (see {self.log.name})")

    def stop(self, deadline_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(deadline_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(deadline_s)
        self.log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument(
        "--model",
        help="checkpoint dir (default: the benchmark checkpoint); 'default': `pipeserve up`'s own model",
    )
    p.add_argument("--extra", default="", help="more `pipeserve up` flags, one shell-quoted string")
    p.add_argument("--deadline-s", type=float, default=120.0)
    args = p.parse_args()
    model = None if args.model == "default" else Path(args.model) if args.model else bench_model()
    body = {"prompt": [1, 2, 3], "max_tokens": 1}  # the one served model
    times, rss = [], []
    with tempfile.TemporaryDirectory(prefix="pipeserve-startup-") as tmp:
        for i in range(args.runs):
            up = Up(model, args.stages, shlex.split(args.extra), Path(tmp) / f"up-{i}.log")
            try:
                times.append(up.wait_first_200(args.deadline_s, body))
                rss.append(tree_rss(up.proc.pid))
            finally:
                up.stop()
            print(f"run {i}: first 200 after {times[-1]:.2f} s, RSS {rss[-1] / 1e9:.2f} GB", flush=True)
    print(
        json.dumps(
            {
                "stages": args.stages,
                "extra": args.extra,
                "runs": args.runs,
                "median_s": round(statistics.median(times), 3),
                "min_s": round(min(times), 3),
                "max_s": round(max(times), 3),
                "median_rss_gb_ready": round(statistics.median(rss) / 1e9, 3),
                "loadavg_1m": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
