"""The steps every fault test takes: a mixed load in the background, the fault, the heal, then the
checker's assertions (checker.py) and the group Ready again within READY_AFTER_HEAL_S of the heal,
serving right with 0 KV blocks held on every stage and no stage ever DIVERGED."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import httpx
from checker import Load, Outcome, Table, check
from cluster import READY_AFTER_HEAL_S, RING_TIMEOUT_S, WEDGE_TIMEOUT_S, Cluster
from oracle import cases

STOP_S = RING_TIMEOUT_S + WEDGE_TIMEOUT_S + 10  # a group stop, however it is detected, is over by then


def load(c: Cluster, n: int, seed: int, gap_s: float = 0.1, lo: int = 10, hi: int = 40) -> Load:
    mixed = cases(c.model_dir, n, seed, lo, hi)
    return Load(c.url, str(c.model_dir), mixed, concurrency=4, gap_s=gap_s).start()


def assert_serves(c: Cluster, seed: int) -> None:
    """A fresh load all answered right (the group serves, its compilers warm), then every stage
    holds 0 blocks."""
    c.wait_compilers()
    counts = check(load(c, 6, seed).join())
    assert counts["ok"] == 6, counts
    c.assert_blocks_freed()
    c.assert_never_diverged()


def assert_503(c: Cluster) -> None:
    r = httpx.post(
        c.url + "/v1/completions",
        json={"model": str(c.model_dir), "prompt": [5, 6, 7], "max_tokens": 2},
        timeout=10,
    )
    assert r.status_code == 503 and r.json()["error"]["message"], r.text


def wait_stopped(c: Cluster, timeout_s: float = STOP_S, hosts: list[str] | None = None) -> None:
    """Every stage (or those of `hosts`) has exited: a group stop takes all of them."""
    want = set(hosts or c.stage_hosts)
    deadline = time.monotonic() + timeout_s
    while not want <= set(c.stage_exited()):
        assert time.monotonic() < deadline, f"group did not stop: exited {c.stage_exited()}"
        time.sleep(0.1)


def ready_after(c: Cluster, t_heal: float, record: Callable[[float], object] = lambda s: None) -> float:
    """Seconds from the heal until every stage and the router are ready (measured at once, the
    load still running); `record(seconds)` before the bound is asserted (the table keeps it)."""
    c.wait_ready(timeout_s=READY_AFTER_HEAL_S + 60)
    ready_s = round(time.monotonic() - t_heal, 2)
    record(ready_s)
    assert ready_s <= READY_AFTER_HEAL_S, f"Ready {ready_s}s after the heal (bound {READY_AFTER_HEAL_S}s)"
    return ready_s


def cut_and_heal(
    c: Cluster,
    table: Table,
    fault: str,
    cut: Callable[[], None],
    heal: Callable[[], None],
    heal_s: float,
    seed: int,
    stops: bool,
    n: int = 12,
    outcomes: list[Outcome] | None = None,
) -> Counter[str]:
    """The fault from 0.5 s into a load of n requests until `heal_s` after it. `stops`: the group
    must stop (every stage exits), the router answers 503, and the operator's answer, a whole-group
    restart, is started at once: it forms once the link heals. Otherwise no stage may exit."""
    running = load(c, n, seed, gap_s=0.25)
    time.sleep(0.5)
    cut()
    t_cut = time.monotonic()
    if stops:
        wait_stopped(c)
        assert_503(c)
        c.restart_group()
    time.sleep(max(0.0, t_cut + heal_s - time.monotonic()))
    heal()
    t_heal = time.monotonic()
    ready_after(c, t_heal, record=lambda s: table.record(fault, running.join(), s))
    done = running.join()
    if outcomes is not None:
        outcomes += done  # the caller's own assertions
    counts = check(done)
    if stops:
        assert counts["error"] >= 1, counts  # the requests in flight at the stop
    else:
        assert c.stage_exited() == [], f"stages exited without a group stop being due: {c.exit_codes()}"
    assert_serves(c, seed + 1000)
    return counts
