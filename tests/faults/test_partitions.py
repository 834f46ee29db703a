"""Faults between hosts, each under a bounded mixed load (greedy completions, whole and streamed):
every request ends within its deadline, right (transformers' ids) or with a clean OpenAI-shaped
error, answered once; KV blocks are back to 0 on every stage; the group serves again after the heal.

What the product does (docs/architecture.md, "Group stop"): a ring link silent past
`ring_timeout_s` stops the group (every stage exits 3) and the supervisor/operator restarts it
whole; here the test restarts it (`Cluster.restart_group`) and asserts the router answers clean
503s while no group is ready. A cut between the router and stage 0 is the router's to handle: its
Generate deadlines end the open calls, its health polls take the group out of routing (503), and
the group is routed to again once the polls answer.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from checker import Case, Load, check
from cluster import RING_TIMEOUT_S, Cluster
from faults_support import FAULTS, cluster_fixture  # noqa: F401  (the `cluster` fixture)

from conftest import hf_greedy, random_prompts

pytestmark = FAULTS
MAX_TOKENS = 6


def cases(model_dir: Path, n: int, seed: int) -> list[Case]:
    """n greedy completions of random token prompts, every other one streamed."""
    prompts = random_prompts(n, 4, 12, 1000, seed)
    want = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    return [Case(p, w, i % 2 == 1, MAX_TOKENS) for i, (p, w) in enumerate(zip(prompts, want, strict=True))]


def load(c: Cluster, n: int, seed: int, gap_s: float = 0.1) -> Load:
    return Load(c.url, str(c.model_dir), cases(c.model_dir, n, seed), concurrency=4, gap_s=gap_s).start()


def assert_serves(c: Cluster, seed: int) -> None:
    """A fresh load all answered right (the group serves), then every stage holds 0 blocks."""
    counts = check(load(c, 6, seed).join())
    assert counts["ok"] == 6, counts
    c.assert_blocks_freed()


def assert_503(c: Cluster) -> None:
    r = httpx.post(
        c.url + "/v1/completions",
        json={"model": str(c.model_dir), "prompt": [5, 6, 7], "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 503 and r.json()["error"]["message"], r.text


def wait_stopped(c: Cluster, timeout_s: float = RING_TIMEOUT_S + 10) -> None:
    """Every stage of the group has exited (a group stop takes all of them)."""
    deadline = time.monotonic() + timeout_s
    while len(c.stage_exited()) < c.stages:
        assert time.monotonic() < deadline, f"group did not stop: exited {c.stage_exited()}"
        time.sleep(0.1)


def test_the_harness_serves_across_hosts(cluster: Cluster) -> None:
    """No fault: every request right; the ring and Redis cross the bridge (stage 0 reaches Redis)."""
    assert_serves(cluster, seed=1)
    assert cluster.hosts.pids("redis"), "redis-server is not running in its namespace"


def test_a_short_partition_of_the_ring_heals_without_a_restart(cluster: Cluster) -> None:
    """stage 0 <-> stage 1 cut for 1 s (< ring_timeout_s) under load: TCP carries the ring over the
    gap; every request ends right, nobody exits."""
    running = load(cluster, 8, seed=2)
    time.sleep(0.5)
    cluster.hosts.link("s1", up=False)
    time.sleep(1.0)
    cluster.hosts.link("s1", up=True)
    counts = check(running.join())
    assert counts["ok"] == 8, counts
    assert cluster.stage_exited() == []
    cluster.assert_blocks_freed()


def test_a_ring_partition_past_the_deadline_stops_the_group(cluster: Cluster) -> None:
    """stage 0 <-> stage 1 cut past ring_timeout_s: the group stops (every stage exits), every open
    request ends with a clean error, the router answers 503 until the group is restarted whole,
    then serves right again."""
    running = load(cluster, 8, seed=3, gap_s=0.3)
    time.sleep(0.5)
    cluster.hosts.link("s1", up=False)
    wait_stopped(cluster)
    cluster.hosts.link("s1", up=True)
    counts = check(running.join())
    assert counts["error"] >= 1, counts  # the requests in flight at the stop
    assert_503(cluster)
    cluster.restart_group()
    cluster.wait_ready()
    assert_serves(cluster, seed=4)


def test_a_partition_between_router_and_stage0(cluster: Cluster) -> None:
    """The router's back link cut for longer than its Generate deadlines: open calls end with a
    clean error (none hangs), new requests get 503 once the polls fail, and after the heal the
    same group (no restart) serves right with every block freed."""
    running = load(cluster, 8, seed=5, gap_s=0.3)
    time.sleep(0.5)
    cluster.hosts.link("router", up=False)
    check(running.join())
    assert_503(cluster)
    cluster.hosts.link("router", up=True)
    cluster.wait_ready()
    assert cluster.stage_exited() == []
    assert_serves(cluster, seed=6)


def test_a_slow_ring_link(cluster: Cluster) -> None:
    """stage 1's link at 1 Mbit/s (tbf, both ways): slower, but every request ends right."""
    cluster.hosts.slow("s1", 1000)
    counts = check(load(cluster, 6, seed=7).join())
    assert counts["ok"] == 6, counts
    cluster.hosts.slow("s1", None)
    cluster.assert_blocks_freed()


def test_a_frozen_host(cluster: Cluster) -> None:
    """Every process of stage 1's host SIGSTOPped: for 1 s the group rides it out (all right); past
    ring_timeout_s stage 0 stops the group, requests end clean, and a restart serves again."""
    running = load(cluster, 6, seed=8)
    time.sleep(0.3)
    cluster.hosts.freeze("s1")
    time.sleep(1.0)
    cluster.hosts.thaw("s1")
    assert check(running.join())["ok"] == 6
    running = load(cluster, 6, seed=9, gap_s=0.3)
    time.sleep(0.3)
    frozen = cluster.hosts.freeze("s1")
    wait_stopped_s0(cluster)
    cluster.hosts.thaw("s1")
    assert frozen
    counts = check(running.join())
    assert counts["error"] >= 1, counts
    wait_stopped(cluster)
    assert_503(cluster)
    cluster.restart_group()
    cluster.wait_ready()
    assert_serves(cluster, seed=10)


def wait_stopped_s0(c: Cluster, timeout_s: float = RING_TIMEOUT_S + 10) -> None:
    deadline = time.monotonic() + timeout_s
    while "s0" not in c.stage_exited():
        assert time.monotonic() < deadline, "stage 0 did not stop the group"
        time.sleep(0.1)
