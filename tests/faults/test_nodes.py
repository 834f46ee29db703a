"""Faults of a node rather than a link, under the mixed load (flow.py): a slow ring link, a frozen
host (SIGSTOP of every process in it) and a node that comes back with a new address.

A frozen stage for 1 s is ridden out; past ring_timeout_s stage 0 stops the group, and the
restart forms once the host is thawed and its old processes are gone. A node replaced by one with
another address (a rescheduled pod): the group stops, and the restarted group finds it by name
(the operator gives MASTER_ADDR as stage 0's DNS name; the router's upstream is a name too), as
stage 0 (the rendezvous' master, the router's upstream) and as a follower.
"""

from __future__ import annotations

import time

import pytest
from checker import Table, check
from cluster import Cluster
from faults_support import FAULTS, cluster_fixture, session_cluster, table_fixture  # noqa: F401  (fixtures)
from flow import assert_503, assert_serves, load, ready_after, wait_stopped

pytestmark = FAULTS


def test_a_slow_ring_link(cluster: Cluster, table: Table) -> None:
    """stage 1's link at 1 Mbit/s (tbf, both ways, ~200 ms queued): slower, but every request
    ends right and nobody exits."""
    cluster.hosts.slow("s1", 1000)
    try:
        outcomes = load(cluster, 8, seed=7).join()
    finally:
        cluster.hosts.slow("s1", None)
    table.record("ring link at 1 Mbit/s (tbf)", outcomes, None)
    assert check(outcomes)["ok"] == 8
    assert cluster.stage_exited() == []
    cluster.assert_blocks_freed()


def test_a_frozen_host(cluster: Cluster, table: Table) -> None:
    """Every process of stage 1's host SIGSTOPped: for 1 s the group rides it out (all right); past
    ring_timeout_s stage 0 stops the group, requests end clean, and a restart serves again."""
    running = load(cluster, 6, seed=8)
    time.sleep(0.3)
    cluster.hosts.freeze("s1")
    time.sleep(1.0)
    cluster.hosts.thaw("s1")
    outcomes = running.join()
    table.record("stage 1 frozen (SIGSTOP) for 1 s", outcomes, None)
    assert check(outcomes)["ok"] == 6
    running = load(cluster, 8, seed=9, gap_s=0.3)
    time.sleep(0.3)
    assert cluster.hosts.freeze("s1")
    wait_stopped(cluster, hosts=["s0"])
    cluster.hosts.thaw("s1")
    t_heal = time.monotonic()
    wait_stopped(cluster)  # the thawed stage 1 finds its ring gone
    assert_503(cluster)
    cluster.restart_group()
    fault = "stage 1 frozen past ring_timeout_s"
    ready_after(cluster, t_heal, lambda s: table.record(fault, running.join(), s))
    assert check(running.join())["error"] >= 1
    assert_serves(cluster, seed=10)


@pytest.mark.parametrize("host", ["s0", "s1"])
def test_a_node_back_with_a_new_address(cluster: Cluster, table: Table, host: str) -> None:
    """The host's processes killed (the node is gone) under load; it comes back with another
    address; the group, restarted whole, finds it by name and serves right. Stage 0's node: the
    rendezvous' master and the router's upstream move; a follower's node: its announcement to
    the store and its ring links (stage 0's next peer) move."""
    running = load(cluster, 8, seed=11, gap_s=0.3)
    time.sleep(0.5)
    cluster.hosts.kill_host(host)
    wait_stopped(cluster)
    old = cluster.addr(host)
    new = cluster.hosts.readdress(host)
    t_back = time.monotonic()
    cluster.restart_group()
    fault = f"stage {host[1:]} back with a new address"
    ready_after(cluster, t_back, lambda s: table.record(fault, running.join(), s))
    assert check(running.join())["error"] >= 1
    assert new != old and cluster.addr(host) == new
    assert_serves(cluster, seed=12)
