"""One client cannot slow the others (issue 29, point 5): an ordinary request's latency under
hostile clients, on `pipeserve up` with `make run`'s flags.

A steady stream of ordinary requests (a 4-token greedy completion of a short fresh prompt, one
every --probe-every-s, each on its own connection) is timed while one hostile case runs:

  baseline     nothing else
  scoring      4 concurrent prompt scorings: a ~4k-token fresh prompt, prompt_logprobs 20, one
               after the other in each of the 4 clients
  fanout       5 concurrent n=128, best_of=128 completions (max_tokens 16)
  grammar      16 concurrent structured requests, each its own JSON schema with a 20k-entry enum
  disconnect   8 clients that send a 1k-token completion (max_tokens 64) and drop the connection
               after 50-500 ms, over and over

The hostile clients run in a child process (their JSON parsing must not take this process's
GIL from the timed stream). Cases alternate round by round (--rounds); each case reports the
ordinary requests' p50/p99/max and errors, the hostile requests' status codes, and how long
stage 0's gauges took to show no work (running, waiting, KV blocks in use all 0) after the
hostile clients stopped. Goal: p99 <= 2 s in every case.

    .venv/bin/python benchmarks/hostile.py                       # 2 rounds x 5 cases, 30 s each
    .venv/bin/python benchmarks/hostile.py --cases scoring --duration-s 20 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

CASES = ("baseline", "scoring", "fanout", "grammar", "disconnect")
GOAL_P99_S = 2.0
WORDS = (
    "apple river stone cloud music garden window yellow seven machine quiet forest paper ocean light "
    "dream valley copper signal winter harbor candle mirror thunder lantern orbit meadow"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# --- hostile clients (child process) ------------------------------------------
def hostile(url: str, case: str, duration_s: float, seed: int) -> dict[str, int]:
    """Run `case` against `url` for duration_s; returns status code -> count."""
    codes: dict[str, int] = {}
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def count(code: object) -> None:
        with lock:
            codes[str(code)] = codes.get(str(code), 0) + 1

    def post(body: dict | bytes) -> None:
        """One request; a refusal of load (429, 503) is followed by its Retry-After's wait, as the
        OpenAI SDKs do: the case is N concurrent hostile requests, not a client spinning on refusals
        (on this machine that spin's own CPU would be measured, not the server's)."""
        wait = max(1.0, end - time.monotonic() + 5)
        try:
            if isinstance(body, bytes):
                head = {"content-type": "application/json"}
                r = httpx.post(url + "/v1/completions", content=body, headers=head, timeout=wait)
            else:
                r = httpx.post(url + "/v1/completions", json=body, timeout=wait)
            count(r.status_code)
        except httpx.HTTPError as e:
            count(type(e).__name__)
            return
        if r.status_code in (429, 503):
            time.sleep(min(float(r.headers.get("retry-after", 1)), max(0.0, end - time.monotonic())))

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        k = 0
        bomb = b""
        if case == "grammar":  # serialized once: each request's schema differs by its "@K@" entry
            # 20k entries that fit the router's cap on a structured output's size (a bomb over it is
            # refused in the router at once, and would measure nothing but the clients' own CPU).
            enum = ["@K@", *(f"v{j}" for j in range(1, 20000))]
            schema = {"type": "object", "properties": {"v": {"enum": enum}}, "required": ["v"]}
            rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            bomb = json.dumps({"prompt": "Pick one: ", "max_tokens": 8, "response_format": rf}).encode()
        while time.monotonic() < end:
            k += 1
            if case == "scoring":
                post({"prompt": text(rng, 3600), "max_tokens": 1, "prompt_logprobs": 20})
            elif case == "fanout":
                post({"prompt": text(rng, 20), "n": 128, "best_of": 128, "max_tokens": 16})
            elif case == "grammar":
                post(bomb.replace(b"@K@", f"{seed}.{i}.{k}".encode()))
            elif case == "disconnect":
                drop(url, {"prompt": text(rng, 900), "max_tokens": 64}, rng.uniform(0.05, 0.5))
                count("dropped")

    width = {"scoring": 4, "fanout": 5, "grammar": 16, "disconnect": 8}[case]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(width)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def drop(url: str, body: dict, after_s: float) -> None:
    """Send a completion request and close the connection after `after_s`, unread."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(after_s)


# --- the timed stream and the gauges (this process) ---------------------------
def probe_stream(url: str, duration_s: float, every_s: float, seed: int) -> tuple[list[float], int]:
    """Ordinary requests, one every `every_s`, each timed; returns (latencies of 200s, failures)."""
    lat: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"prompt": f"Note {seed}-{i}: the weather today is", "max_tokens": 4, "temperature": 0}
        body["ignore_eos"] = True
        t0 = time.perf_counter()
        try:
            with httpx.Client(timeout=60) as c:  # a connection of its own, as separate users
                r = c.post(url + "/v1/completions", json=body)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        dt = time.perf_counter() - t0
        with lock:
            if ok:
                lat.append(dt)
            else:
                failures[0] += 1

    with ThreadPoolExecutor(32) as pool:
        t_end = time.monotonic() + duration_s
        i = 0
        while time.monotonic() < t_end:
            pool.submit(one, i)
            i += 1
            time.sleep(every_s)
    return lat, failures[0]


def gauges(stage0: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(stage0 + "/metrics", timeout=5).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used"):
            if line.startswith(f"pipeserve:{name}"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def time_to_idle(stage0: str, timeout_s: float = 120) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if all(v == 0 for v in gauges(stage0).values()):
            return time.monotonic() - t0
        time.sleep(0.05)
    return float("inf")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_case(url: str, stage0: str, case: str, args: argparse.Namespace, seed: int) -> dict:
    child = None
    if case != "baseline":
        argv = [sys.executable, __file__, "--hostile", case, "--url", url]
        argv += ["--duration-s", str(args.duration_s), "--seed", str(seed)]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        time.sleep(args.warmup_s)  # the hostile load in place before the stream is timed
    lat, failed = probe_stream(url, args.duration_s - args.warmup_s, args.probe_every_s, seed)
    codes: dict = {}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child is not None:
        try:
            out, _ = child.communicate(timeout=args.duration_s + 120)  # reaped: its CPU is counted below
            codes = json.loads(out.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            child.kill()
            codes = {"client timeout": 1}
    idle = time_to_idle(stage0)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "case": case,
        "n": len(lat),
        "failed": failed,
        "p50_s": pct(lat, 0.5),
        "p99_s": pct(lat, 0.99),
        "max_s": max(lat, default=float("nan")),
        "hostile_codes": codes,
        "idle_after_s": idle,
        # the hostile clients' own CPU seconds: on this machine they share the server's cores
        "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--probe-every-s", type=float, default=0.25)
    ap.add_argument("--up-args", default="--quantization gguf", help="make run's UP_ARGS")
    ap.add_argument("--url", help="a running server (else pipeserve up is started)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--hostile", choices=CASES[1:], help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hostile:
        print(json.dumps(hostile(args.url, args.hostile, args.duration_s, args.seed)))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    up = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_dir = tempfile.mkdtemp(prefix="hostile-")
        argv = [sys.executable, "-m", "pipeserve.cli", "up", "--port", str(port), "--log-dir", log_dir]
        with open(Path(log_dir) / "up.log", "ab") as log:  # its access log: a line per hostile request
            up = subprocess.Popen([*argv, *args.up_args.split()], stdout=subprocess.DEVNULL, stderr=log)
        print(f"pipeserve up: logs in {log_dir}", flush=True)
    try:
        wait_ready(url)
        stage0 = httpx.get(url + "/groups", timeout=5).json()[0]["health"][0]
        results = []
        for rnd in range(args.rounds):  # cases alternate round by round
            for i, case in enumerate(cases):
                r = run_case(url, stage0, case, args, seed=rnd * 100 + i + int(time.time()) % 10000)
                r["round"] = rnd
                results.append(r)
                print(json.dumps(r), flush=True)
        report(results, cases)
        if args.json:
            Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "results": results}, indent=1))
    finally:
        if up is not None:
            up.terminate()
            up.wait(60)
    return 0


def report(results: list[dict], cases: list[str]) -> None:
    print(f"\nCPU: {cpu_name()}, {os.cpu_count()} vCPUs. p99 goal <= {GOAL_P99_S} s.")
    print(
        "| case | ordinary requests | failed | p50 s | p99 s median [min-max] | max s | hostile codes "
        "| idle after s | clients' CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        rs = [r for r in results if r["case"] == case]
        p99 = [r["p99_s"] for r in rs]
        codes: dict = {}
        for r in rs:
            for k, v in r["hostile_codes"].items():
                codes[k] = codes.get(k, 0) + v
        print(
            f"| {case} | {sum(r['n'] for r in rs)} | {sum(r['failed'] for r in rs)} "
            f"| {statistics.median(r['p50_s'] for r in rs):.2f} | {statistics.median(p99):.2f} "
            f"[{min(p99):.2f}-{max(p99):.2f}] | {max(r['max_s'] for r in rs):.2f} "
            f"| {json.dumps(codes)} | {max(r['idle_after_s'] for r in rs):.2f} "
            f"| {statistics.median(r['client_cpu_s'] for r in rs):.1f} |"
        )


def wait_ready(url: str, timeout_s: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready within {timeout_s}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
