"""Replica picking: pure functions of GroupState, tested without gRPC."""

from __future__ import annotations

import random
from collections import Counter

from pipeserve.router.upstream.groups import GroupState, candidates
from pipeserve.router.upstream.policy import (
    affinity_key,
    pick,
    pick_least_load,
    pick_prefix_affinity,
    pick_round_robin,
    rendezvous,
)


def group(name: str, **kw) -> GroupState:
    return GroupState(**{"name": name, "target": f"127.0.0.1:{1000 + len(name)}", "ready": True, **kw})


def test_candidates_are_ready_not_down_not_excluded_in_name_order() -> None:
    gs = [group("b"), group("a"), group("c", ready=False), group("d", down_reason="killed"), group("e")]
    assert [g.name for g in candidates(gs)] == ["a", "b", "e"]
    assert [g.name for g in candidates(gs, exclude=["b"])] == ["a", "e"]
    assert candidates([group("x", ready=False)]) == []


def test_round_robin_cycles_and_handles_empty() -> None:
    gs = candidates([group("a"), group("b"), group("c")])
    assert [pick_round_robin(gs, t).name for t in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert pick_round_robin([], 3) is None


def test_least_load_counts_polled_load_plus_router_inflight_since_the_poll() -> None:
    a = group("a", running=3, waiting=1)  # polled 4
    b = group("b", running=1, waiting=0, inflight=4, inflight_at_poll=1)  # 1 polled + 3 started since
    c = group("c", running=2, waiting=0, inflight=0, inflight_at_poll=2)  # 2 polled, both finished since
    assert (a.load, b.load, c.load) == (4, 4, 0)
    assert pick_least_load([a, b, c]).name == "c"
    c.inflight = 5  # the router just sent 5 there: fresher than any poll
    assert pick_least_load([a, b, c]).name in ("a", "b")


def test_least_load_ties_break_on_kv_use_then_rotate() -> None:
    a = group("a", running=1, kv_blocks_used=90, kv_blocks_total=100)
    b = group("b", running=1, kv_blocks_used=10, kv_blocks_total=100)
    assert pick_least_load([a, b]).name == "b"
    idle = [group("a"), group("b"), group("c")]
    assert {pick_least_load(idle, t).name for t in range(3)} == {"a", "b", "c"}
    assert pick_least_load([]) is None


def test_prefix_affinity_is_consistent_and_keyed_on_the_first_block() -> None:
    gs = candidates([group(f"g{i}") for i in range(4)])
    prompt = list(range(100, 140))
    first = pick_prefix_affinity(gs, prompt, overload=8).name
    assert all(pick_prefix_affinity(gs, prompt, overload=8).name == first for _ in range(5))
    # Only the first 16 tokens matter: requests sharing a system prompt land together.
    assert pick_prefix_affinity(gs, [*prompt[:16], 1, 2, 3], overload=8).name == first
    assert affinity_key(prompt) == affinity_key(prompt[:16]) != affinity_key(prompt[1:17])


def test_prefix_affinity_spreads_keys_and_a_leaving_group_moves_only_its_keys() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(16)] for _ in range(800)]
    gs = [group(f"g{i}") for i in range(4)]
    before = {i: rendezvous(gs, affinity_key(p)).name for i, p in enumerate(prompts)}
    share = Counter(before.values())
    assert set(share) == {"g0", "g1", "g2", "g3"} and min(share.values()) > 120  # roughly even
    after = {i: rendezvous(gs[:2] + gs[3:], affinity_key(p)).name for i, p in enumerate(prompts)}
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(before[i] == "g2" for i in moved)
    assert len(moved) == share["g2"]


def test_prefix_affinity_falls_back_to_least_load_when_the_affine_group_is_overloaded() -> None:
    gs = [group("g0"), group("g1"), group("g2")]
    prompt = [7] * 16
    home = pick_prefix_affinity(gs, prompt, overload=2)
    home.running = 2  # exactly `overload` above the least loaded: stays
    assert pick_prefix_affinity(gs, prompt, overload=2) is home
    home.running = 3  # beyond it: the least loaded group takes the request
    other = pick_prefix_affinity(gs, prompt, overload=2)
    assert other is not home and other.load == 0
    assert pick_prefix_affinity([], prompt, overload=2) is None


def test_pick_dispatches_on_policy() -> None:
    gs = candidates([group("a", running=5), group("b")])
    assert pick("round_robin", gs, [1], 0, 8).name == "a"
    assert pick("least_load", gs, [1], 0, 8).name == "b"
    assert pick("prefix_affinity", gs, [1], 0, 8) is pick_prefix_affinity(gs, [1], 8)
