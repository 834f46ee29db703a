"""Partitions between hosts, each under the mixed load (flow.py, oracle.py), healed after 1 s and
after 10 s (past ring_timeout_s and the wedge timeout): every request ends within its deadline,
right (transformers' ids) or with a clean OpenAI-shaped error, answered once; the group is Ready
within READY_AFTER_HEAL_S of the heal, serves right, holds 0 KV blocks, never diverged.

What the product does (docs/architecture.md, "Group stop"): a ring link silent past
`ring_timeout_s` stops the group (every stage exits 3) and the supervisor/operator restarts it
whole (here `Cluster.restart_group`, started at once: the new group forms when the link heals)
while the router answers clean 503s. A short cut is ridden out by TCP: nothing fails. A cut between
the router and stage 0 is the router's to handle: its Generate deadlines end the open calls, its
health polls take the group out of routing (503) and back once they answer; no stage exits.
One-way cuts drop one host's packets to the other (netns.Hosts.cut): the ring's return link, or
the forward link.
"""

from __future__ import annotations

import pytest
from checker import Outcome, Table
from cluster import FIRST_TOKEN_S, STREAM_IDLE_S, WEDGE_TIMEOUT_S, Cluster
from faults_support import FAULTS, cluster_fixture, session_cluster, table_fixture  # noqa: F401  (fixtures)
from flow import assert_serves, cut_and_heal

pytestmark = FAULTS
HEALS = [pytest.param(1.0, id="heal1s"), pytest.param(10.0, id="heal10s")]
PAST_WEDGE_S = WEDGE_TIMEOUT_S + 2


def test_the_harness_serves_across_hosts(cluster: Cluster) -> None:
    """No fault: every request right; the ring and Redis cross the bridge (stage 0 reaches Redis)."""
    assert_serves(cluster, seed=1)
    assert cluster.hosts.pids("redis"), "redis-server is not running in its namespace"
    assert cluster.l3_pages()[0] >= 1, "no block reached L3 with every stage's page"


@pytest.mark.parametrize("heal_s", HEALS)
def test_ring_partition(cluster: Cluster, table: Table, heal_s: float) -> None:
    """stage 0 <-> stage 1 (stage 1's link down, both ways)."""
    hosts = cluster.hosts
    counts = cut_and_heal(
        cluster,
        table,
        f"ring stage 0 <-> 1 cut, healed at {heal_s:g} s",
        lambda: hosts.link("s1", up=False),
        lambda: hosts.link("s1", up=True),
        heal_s,
        seed=2,
        stops=heal_s > 1,
    )
    if heal_s <= 1:
        assert counts["ok"] == sum(counts.values()), counts


@pytest.mark.parametrize(
    ("src", "dst", "heal_s"),
    [("s0", "s1", 1.0), ("s1", "s0", 10.0)],
    ids=["forward-heal1s", "return-heal10s"],
)
def test_ring_one_way_cut(cluster: Cluster, table: Table, src: str, dst: str, heal_s: float) -> None:
    """Only src's packets to dst dropped (the forward link s0 -> s1, or the return link s1 -> s0)."""
    hosts = cluster.hosts
    counts = cut_and_heal(
        cluster,
        table,
        f"ring one way {src} -> {dst} cut, healed at {heal_s:g} s",
        lambda: hosts.cut(src, dst),
        lambda: hosts.cut(src, dst, cut=False),
        heal_s,
        seed=3,
        stops=heal_s > 1,
    )
    if heal_s <= 1:
        assert counts["ok"] == sum(counts.values()), counts


@pytest.mark.parametrize("heal_s", [*HEALS, pytest.param(PAST_WEDGE_S, id="heal-past-wedge")])
def test_router_stage0_partition(cluster: Cluster, table: Table, heal_s: float) -> None:
    """The router's back link cut: past its Generate deadlines the open calls end with a clean
    error and new requests get 503; after the heal the same group (no restart) serves right. Past
    the wedge timeout too: a stage whose client is gone is not wedged (its work ends)."""
    hosts = cluster.hosts
    outcomes: list[Outcome] = []
    counts = cut_and_heal(
        cluster,
        table,
        f"router <-> stage 0 cut, healed at {heal_s:g} s",
        lambda: hosts.link("router", up=False),
        lambda: hosts.link("router", up=True),
        heal_s,
        seed=5,
        stops=False,
        outcomes=outcomes,
    )
    if heal_s <= 1:
        assert counts["ok"] == sum(counts.values()), counts
    else:
        assert counts["error"] >= 1, counts
    # every call ended by the router's own deadlines, not by the heal
    seconds = sorted(o.seconds for o in outcomes)
    assert seconds[-1] <= FIRST_TOKEN_S + STREAM_IDLE_S + 3, seconds
