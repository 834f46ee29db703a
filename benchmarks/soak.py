"""Soak: `make run`'s server under a long mixed load, with disconnects and hostile requests mixed in
(issue 29, point 4). Not a test: its figures go in benchmarks/RESULTS.md.

    python benchmarks/soak.py                          # 30 minutes at C=32, make run's flags
    python benchmarks/soak.py --minutes 3 --concurrency 8 --warmup-minutes 1   # a smoke run

It starts `pipeserve up` with make run's flags (the default model, `--quantization gguf`) on a free
port and runs `--concurrency` clients, each drawing its next request from a seeded mix:

| kind        | share | what                                                                  | ok if      |
|-------------|------:|-----------------------------------------------------------------------|------------|
| chat        |  30 % | a fresh text prompt (random words), 16-64 tokens                       | 200        |
| stream      |  20 % | the same, streamed to its [DONE]                                       | 200 + DONE |
| structured  |  10 % | response_format json_schema (an object of two fields)                  | 200, JSON  |
| fanout      |  10 % | /v1/completions with n=3, temperature 0.8                              | 200, 3     |
| disconnect  |  15 % | a stream the client drops after its first chunks                       | (dropped)  |
| hostile     |  15 % | malformed or out-of-range input (bad JSON, negative temperature, ...)  | 4xx        |

Every 10 s it samples resident memory by part: `up` itself (router and supervisor), Redis (L3:
its maxmemory bounds it), each stage without its KV caches, and those caches (L1 pool and L2 host
tier, which on a CPU become resident as the prefix cache fills them, up to their configured size).
At the end it prints them as JSON, and a verdict per criterion of the issue:

* RSS growth <= 5 % after warm-up (the median of the last 3 samples against the median of the 3
  samples after `--warmup-minutes`), for the processes with their caches apart; and the total
  within what the configuration lets it hold: those processes + 5 %, the KV caches at their
  configured size (the mappings' size), Redis at its maxmemory plus its resident memory at
  warm-up. The caches fill as fresh prompts arrive (each block kept until evicted), so their
  growth is bounded by configuration, not by time: a pod's memory limit must cover them;
* 0 responses >= 500 (a transport error counts as one too: a server that dropped a connection it
  should have answered);
* 0 group restarts (`/groups`' restart counts);
* every stage's running / waiting requests and KV blocks held by requests back to 0 within 5 s of
  the last request (`/metrics` of each stage's side port, named by `/groups`).

Each request has a 120 s client deadline; one that misses it counts as hung. The machine's load
is printed before and after (other processes slow every request: the figures say so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import Up, tree_rss  # benchmarks/ is not a package

WORDS = (
    "river mountain quiet engine paper garden silver window story winter market signal harbor "
    "lantern forest copper orbit meadow thunder violet canyon pocket ribbon marble falcon desert "
    "kettle echo island velvet compass glacier ember puzzle saddle tunnel willow beacon cobalt"
).split()
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
KINDS = (
    ("chat", 30),
    ("stream", 20),
    ("structured", 10),
    ("fanout", 10),
    ("disconnect", 15),
    ("hostile", 15),
)
DEADLINE_S = 120.0


def fresh_prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
    return f"Write one sentence about: {words}."


def hostile(rng: random.Random, model: str) -> tuple[str, bytes | dict]:
    """(path, body): input a server must refuse with a 4xx and survive."""
    msgs = [{"role": "user", "content": fresh_prompt(rng)}]
    chat = "/v1/chat/completions"
    cases: list[tuple[str, bytes | dict]] = [
        (chat, b'{"model": "x", "messages": [{"role": "user", "content": "hi"'),  # truncated JSON
        (chat, {"model": model, "messages": msgs, "temperature": -1}),
        (chat, {"model": model, "messages": msgs, "max_tokens": 10**9}),
        (chat, {"model": "no-such-model", "messages": msgs}),
        (chat, {"model": model, "messages": "hello"}),
        (chat, {"model": model, "messages": msgs, "n": 0}),
        (chat, {"model": model, "messages": msgs, "top_logprobs": 1000, "logprobs": True}),
        (chat, {"model": model, "messages": msgs, "logit_bias": {"-5": 1}}),
        (chat, {"model": model, "messages": msgs, "response_format": {"type": "json_schema"}}),
        ("/v1/completions", {"model": model, "prompt": [10**9]}),
        ("/v1/completions", {"model": model, "prompt": "x " * 40000, "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": "hi", "stop": ["a"] * 1000}),
    ]
    return cases[rng.randrange(len(cases))]


class Tally:
    def __init__(self) -> None:
        self.status: dict[str, Counter] = defaultdict(Counter)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.bad: list[str] = []  # a response that broke its kind's contract, said once each

    def add(self, kind: str, status: int | str, seconds: float, problem: str | None = None) -> None:
        self.status[kind][status] += 1
        self.latency[kind].append(seconds)
        if problem is not None and len(self.bad) < 20:
            self.bad.append(f"{kind}: {problem}")


async def one(client: httpx.AsyncClient, rng: random.Random, model: str, tally: Tally) -> None:
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    msgs = [{"role": "user", "content": fresh_prompt(rng)}]
    max_tokens = rng.randint(16, 64)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(DEADLINE_S):
            status, problem = await _request(client, rng, model, kind, msgs, max_tokens)
    except TimeoutError:
        status, problem = "hung", "no answer within the client deadline"
    except httpx.HTTPError as e:
        status, problem = "transport", f"{type(e).__name__}: {e}"
    tally.add(kind, status, time.monotonic() - t0, problem)


async def _request(client, rng, model, kind, msgs, max_tokens) -> tuple[int | str, str | None]:
    chat = {"model": model, "messages": msgs, "max_tokens": max_tokens}
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json=chat)
        return r.status_code, None if r.status_code == 200 else r.text[:200]
    if kind in ("stream", "disconnect"):
        chunks = 0
        drop_after = rng.randint(1, 4) if kind == "disconnect" else None
        async with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if drop_after is not None and chunks >= drop_after:
                    return "dropped", None  # leaving the block closes the connection
                if line == "data: [DONE]":
                    return r.status_code, None
            return r.status_code, None if r.status_code != 200 else "a stream without [DONE]"
    if kind == "structured":
        fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
        r = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 64, "response_format": fmt})
        if r.status_code != 200:
            return r.status_code, r.text[:200]
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            try:
                json.loads(choice["message"]["content"])
            except ValueError:
                return r.status_code, f"not JSON: {choice['message']['content'][:100]!r}"
        return r.status_code, None
    if kind == "fanout":
        body = {"model": model, "prompt": msgs[0]["content"], "n": 3, "temperature": 0.8, "max_tokens": 16}
        r = await client.post("/v1/completions", json=body)
        if r.status_code == 200 and len(r.json()["choices"]) != 3:
            return r.status_code, "not 3 choices"
        return r.status_code, None if r.status_code == 200 else r.text[:200]
    path, body = hostile(rng, model)
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    if r.status_code < 500:
        return r.status_code, None
    shown = json.dumps(body)[:120] if isinstance(body, dict) else repr(body)
    return r.status_code, f"{r.status_code} for {shown}"


async def clients(url: str, concurrency: int, until: float, seed: int, tally: Tally) -> None:
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < until:
                await one(client, rng, model, tally)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def cache_rss(pid: int) -> tuple[int, int]:
    """(resident, mapped) bytes of a stage's KV caches: its two largest mappings, the L1 pool and the
    L2 host tier (worker/kv_cache.py maps each as one anonymous region of its configured size; on a
    CPU a page is resident once a block there was written, so they fill up to that size as the
    prefix cache grows)."""
    sizes: list[tuple[int, int]] = []  # (size kB, rss kB) per mapping
    size = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line.startswith("Size:"):
                    size = int(line.split()[1])
                elif line.startswith("Rss:"):
                    sizes.append((size, int(line.split()[1])))
    except OSError:
        return 0, 0
    top = sorted(sizes, reverse=True)[:2]
    return sum(r for _, r in top) * 1024, sum(z for z, _ in top) * 1024


def redis_maxmemory(pid: int) -> int:
    """The private redis-server's maxmemory in bytes (0: none), asked on the port its process title
    names ("redis-server 127.0.0.1:PORT")."""
    try:
        port = int(psutil.Process(pid).cmdline()[0].rsplit(":", 1)[1].split()[0])
        return int(redis.Redis(port=port, socket_timeout=5).config_get("maxmemory")["maxmemory"])
    except (psutil.NoSuchProcess, IndexError, ValueError, redis.RedisError):
        return 0


def rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def components(url: str, up_pid: int) -> dict[str, int]:
    """Resident bytes by part: up itself (router and supervisor), Redis (L3, its maxmemory bounds
    it), the stages' processes without their KV caches, those caches (L1 + L2), and the rest."""
    stages = [int(pid) for g in httpx.get(url + "/groups", timeout=10).json() for pid in g["pids"].values()]
    children = psutil.Process(up_pid).children(recursive=True)
    redis = [c.pid for c in children if "redis" in c.name()]
    caches = [cache_rss(p) for p in stages]
    parts = {
        "up": rss(up_pid),
        "redis": sum(rss(p) for p in redis),
        "stages_without_caches": sum(rss(p) for p in stages) - sum(r for r, _ in caches),
        "stage_kv_caches": sum(r for r, _ in caches),
    }
    total = tree_rss(up_pid)
    # Every other process of the tree: the structured-output compile workers of stage 0.
    bounds = {
        "caches_configured": sum(z for _, z in caches),
        "redis_maxmemory": sum(map(redis_maxmemory, redis)),
    }
    return {**parts, "other_processes": total - sum(parts.values()), "total": total, **bounds}


Sample = tuple[float, dict[str, int]]  # (seconds, components())


async def sample_rss(url: str, pid: int, every_s: float, until: float, out: list[Sample]) -> None:
    t0 = time.monotonic()
    while time.monotonic() < until:
        out.append((time.monotonic() - t0, await asyncio.to_thread(components, url, pid)))
        await asyncio.sleep(every_s)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def drained(url: str, deadline_s: float = 5.0) -> tuple[list[dict], list[dict]]:
    """(/groups, each stage's running/waiting/blocks) once every stage is idle or at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        groups = httpx.get(url + "/groups", timeout=10).json()
        stages = []
        for g in groups:
            for health in g["health"]:
                text = httpx.get(health + "/metrics", timeout=10).text
                stages.append(
                    {
                        "stage": health,
                        **{
                            k: metric(text, "pipeserve:" + k)
                            for k in ("num_requests_running", "num_requests_waiting", "kv_blocks_used")
                        },
                    }
                )
        if all(not any(s[k] for k in s if k != "stage") for s in stages) or time.monotonic() > end:
            return groups, stages
        time.sleep(0.2)


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-minutes", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--extra", default="--quantization gguf", help="pipeserve up's flags (make run's)")
    args = ap.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "up.log"
    up = Up(None, 1, args.extra.split(), log)
    try:
        ready_s = up.wait_first_200(300.0, {"prompt": "hi", "max_tokens": 1})
        print(f"ready in {ready_s:.1f}s; log {log}")
        until = time.monotonic() + args.minutes * 60
        tally, mem = Tally(), []

        async def run() -> None:
            await asyncio.gather(
                clients(up.url, args.concurrency, until, args.seed, tally),
                sample_rss(up.url, up.proc.pid, 10.0, until, mem),
            )

        asyncio.run(run())
        groups, stages = drained(up.url)
        mem.append((args.minutes * 60, components(up.url, up.proc.pid)))
    finally:
        up.stop()
    report(args, tally, mem, groups, stages)


def report(args, tally: Tally, mem: list[Sample], groups: list[dict], stages: list[dict]) -> None:
    warm = [c for t, c in mem if t >= args.warmup_minutes * 60]

    def growth(part: str) -> dict:
        values = [c[part] for c in warm]
        base = statistics.median(values[:3]) if len(values) >= 3 else float("nan")
        last = statistics.median(values[-3:])
        return {"after_warmup_mib": round(base / 2**20, 1), "end_mib": round(last / 2**20, 1),
                "growth_pct": round(100 * (last - base) / base, 2) if base else None}  # fmt: skip

    memory = {part: growth(part) for part in warm[0] if part not in ("caches_configured", "redis_maxmemory")}
    processes = [memory[p] for p in ("up", "stages_without_caches", "other_processes")]
    base = sum(m["after_warmup_mib"] for m in processes)
    end = sum(m["end_mib"] for m in processes)
    pct = round(100 * (end - base) / base, 2)
    memory["processes_without_caches"] = {
        "after_warmup_mib": round(base, 1),
        "end_mib": round(end, 1),
        "growth_pct": pct,
    }
    # What the configuration lets the tree hold: the processes (after warm-up, + 5 %), the caches
    # at their configured size, Redis at its maxmemory plus what it held beyond its data at warm-up.
    last = warm[-1]
    bound = (
        base * 1.05
        + (last["caches_configured"] + last["redis_maxmemory"]) / 2**20
        + memory["redis"]["after_warmup_mib"]
    )
    memory["configured_bound_mib"] = round(bound, 1)
    codes = Counter()
    for c in tally.status.values():
        codes.update(c)
    fivexx = sum(n for s, n in codes.items() if isinstance(s, int) and s >= 500) + codes["transport"]
    summary = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "requests": sum(codes.values()),
        "by_kind": {k: dict(v) for k, v in tally.status.items()},
        "p50_s": {k: round(p(v, 0.5), 3) for k, v in tally.latency.items()},
        "p99_s": {k: round(p(v, 0.99), 3) for k, v in tally.latency.items()},
        "responses_5xx_or_transport": fivexx,
        "hung": codes["hung"],
        "contract_breaks": tally.bad,
        "memory": memory,
        "restarts": sum(g["restarts"] for g in groups),
        "stages_at_end": stages,
        "load_after": os.getloadavg(),
    }
    print(json.dumps(summary, indent=2))
    verdicts = {
        "RSS growth of the processes (caches apart) <= 5 %": pct <= 5,
        "total within what is configured (processes + 5 %, caches' size, Redis maxmemory)": (
            memory["total"]["end_mib"] <= bound
        ),
        "0 responses >= 500": fivexx == 0,
        "0 hung": codes["hung"] == 0,
        "0 restarts": summary["restarts"] == 0,
        "stages idle, 0 KV blocks held": all(
            s["num_requests_running"] == s["num_requests_waiting"] == s["kv_blocks_used"] == 0 for s in stages
        ),
        "every answer kept its contract": not tally.bad,
    }
    for name, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    sys.exit(0 if all(verdicts.values()) else 1)


if __name__ == "__main__":
    main()
