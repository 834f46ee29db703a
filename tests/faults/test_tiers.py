"""A stage cut from Redis (HiCache's L3) under the mixed load, healed after 1 s, then after 10 s.

L3 may only ever cost misses (docs/architecture.md, HiCache): with stage 1 cut from Redis, its
writes fail (counted) and its loads time out (hicache_timeout_s); stage 0 uses a loaded prefix only
when every stage loaded its pages in time, so it recomputes, and every request is right. The
group never stops. Before the cut, the load's prompts are stored in L3 and the group restarted
(L1/L2 empty), so the load during the cut orders L3 loads that stage 1 cannot serve. Redis' keys
stay consistent: every page decodes under its key (cluster.l3_pages), and blocks whose pages only
some stages wrote are never loaded.
"""

from __future__ import annotations

import time

import httpx
from checker import Table, check
from cluster import Cluster
from faults_support import FAULTS, cluster_fixture, session_cluster, table_fixture  # noqa: F401  (fixtures)
from flow import assert_serves, load, ready_after

from serving_support import metric, metric_sum, wait_until

pytestmark = FAULTS


SEEDS = {1.0: 21, 10.0: 22}  # a prompt set per heal: each is stored in L3 before the restart


def test_stage_redis_partition(cluster: Cluster, table: Table) -> None:
    """Healed after 1 s, then (another prompt set, the same group) after 10 s."""
    for seed in SEEDS.values():
        assert check(load(cluster, 12, seed, lo=33, hi=60).join())["ok"] == 12  # the prompts' pages in L3
    stored = [0]

    def settled() -> bool:  # every stage's writer has written what it was ordered
        stored[:] = [cluster.l3_pages()[0]]
        return cluster.stage0_metric("pipeserve:hicache_l3_store_backlog") == 0 and stored[0] >= 24

    wait_until(settled, 30, "L3 writes settled", interval_s=0.2)
    cluster.restart_group()  # L1 and L2 empty: the same prompts are found in L3 only
    cluster.wait_ready()
    # The fault measured is the cut, not a cold start: the compiler workers' imports (seconds of CPU
    # on a loaded machine) done first, as reset() does before every test.
    cluster.wait_compilers()
    hosts, failed_before = cluster.hosts, 0.0
    for heal_s, seed in SEEDS.items():
        running = load(cluster, 12, seed, lo=33, hi=60, gap_s=0.25)  # the same prompts
        time.sleep(0.3)
        hosts.cut("s1", "redis")
        hosts.cut("redis", "s1")
        time.sleep(heal_s)
        hosts.cut("s1", "redis", cut=False)
        hosts.cut("redis", "s1", cut=False)
        fault = f"stage 1 <-> Redis cut, healed at {heal_s:g} s"
        ready_after(cluster, time.monotonic(), lambda s, r=running, f=fault: table.record(f, r.join(), s))
        assert check(running.join())["ok"] == 12, "L3 may only cost misses: every request right"
        assert cluster.stage_exited() == []
        text = httpx.get(cluster.health_url("s0") + "/metrics", timeout=2).text
        loads = metric_sum(text, "pipeserve:hicache_l3_group_loads_total")
        failed = loads - (metric(text, "pipeserve:hicache_l3_group_loads_total", outcome="ok") or 0)
        complete, partial = cluster.l3_pages()  # every page decodes; pages of a block agree
        assert complete >= stored[0], (complete, stored)
        print(f"heal {heal_s:g} s: L3 loads {loads} ({failed} failed); blocks {complete} + {partial} partial")
        assert failed > failed_before, "no L3 load met the cut: the fault was not exercised"
        failed_before = failed
    assert_serves(cluster, 100)
