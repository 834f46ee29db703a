"""L3 under `pipeserve up` (its private redis-server, the default when redis-server is installed):
a second group of the same model serves a prefix the first group saw twice from L3 (once is not
stored: the second-hit policy), and a group
restarted whole (every stage process killed) serves it from L3 again — asserted from the stages'
metrics, HF-exact, and reported to the client as cached tokens. The redis-server that `up`
supervises comes back by itself when it dies."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import httpx
import redis

from conftest import hf_greedy
from pipeline_support import wait_dead
from serving_support import UpProcess, generate, greedy_request, metric, stub, wait_until


def _group(up: UpProcess, name: str) -> dict:
    return next(g for g in up.groups() if g["name"] == name)


def _stage0_metric(group: dict, name: str, **labels: str) -> float:
    text = httpx.get(group["health"][0] + "/metrics", timeout=5).text
    return metric(text, name, **labels) or 0.0


def _l3_hit_tokens(group: dict) -> float:
    return _stage0_metric(group, "pipeserve:prefix_cache_hits_total", tier="l3")


def _ids(group: dict, rid: str, prompt: list[int]) -> list[int]:
    tokens, finish = generate(stub(group["grpc"]), greedy_request(rid, prompt, 8))
    assert finish == "length"
    return tokens


def test_l3_is_shared_by_groups_and_survives_a_group_restart(llama_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1024) for _ in range(300)]
    want = hf_greedy(llama_dir, prompt, 8)
    args = ["--model", str(llama_dir), "--stages", "2", "--replicas", "2", "--num-kv-blocks", "256"]
    up = UpProcess(*args, "--host-cache-gb", "0", "--hicache-url", "local", log_dir=tmp_path)
    try:
        up.wait_ready()
        assert "L3: private redis-server at redis://127.0.0.1:" in up.log()
        g0, g1 = _group(up, "group-0"), _group(up, "group-1")
        # Computed on group 0 and seen once: nothing is written (the default policy, second-hit)...
        assert _ids(g0, "a", prompt) == want
        assert _stage0_metric(g0, "pipeserve:hicache_l3_pages_ordered_total") == 0
        # ... seen again (a prefix-cache hit: shared): its pages are written to L3.
        assert _ids(g0, "a2", prompt) == want
        assert _stage0_metric(g0, "pipeserve:hicache_l3_pages_ordered_total") >= 256 // 16
        time.sleep(1.0)  # the stores are asynchronous
        assert _ids(g1, "b", prompt) == want
        assert _l3_hit_tokens(g1) >= 256, "group 1 did not read group 0's pages"
        assert _l3_hit_tokens(g0) == 0

        # Group 0 restarted whole: its L1 is gone, L3 is not.
        old = [int(p) for p in g0["pids"].values()]
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        assert not wait_dead(old, 10)
        wait_until(
            lambda: (g := _group(up, "group-0"))["restarts"] >= 1 and g["state"] == "ready",
            120,
            "group 0 restarted and ready",
            interval_s=0.2,
        )
        g0 = _group(up, "group-0")
        assert _ids(g0, "c", prompt) == want
        assert _l3_hit_tokens(g0) >= 256, "the restarted group did not read L3"

        # The client sees the cached tokens (whichever group serves it, the prefix is cached).
        r = httpx.post(
            up.url + "/v1/completions",
            json={"model": str(llama_dir), "prompt": prompt, "max_tokens": 2, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256

        # The private Redis dies: up starts it again on its port.
        port = int(re.search(r"private redis-server at redis://127.0.0.1:(\d+)", up.log()).group(1))
        client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
        pid = int(client.info("server")["process_id"])
        os.kill(pid, signal.SIGKILL)

        def back() -> bool:
            try:
                return int(client.info("server")["process_id"]) != pid
            except redis.RedisError:
                return False

        wait_until(back, 15, "the private redis-server answers again", interval_s=0.2)
        # The new server answers as soon as it listens; `up` logs only once its readiness check
        # returned, a moment later on a loaded machine: the log line is an event of its own.
        wait_until(lambda: "started again" in up.log(), 15, "up logged the restart", interval_s=0.2)
    finally:
        assert up.stop() == 0, up.log()[-3000:]
