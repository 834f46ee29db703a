"""A stage that cannot load from L3 in time pauses the group's L3 loads (hicache/directory.py).

Stage 0 reaching Redis does not mean every stage does: with a follower cut off from Redis, every
request stage 0 ordered a load for waited out the load's deadline and then recomputed. After one
such load ("unavailable" or "late"), probes are answered 0 (misses, no round trip) for a backoff
that doubles while loads keep failing and resets after a load every stage answered "ok". A data
error (a missing page, a bad checksum) pauses nothing. On a real redis-server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from hicache_support import GREEDY, TIGHT, assert_no_leaks, family_prompts, run_llm, tier_stats
from pipeserve import LLM
from pipeserve.hicache.backoff import Backoff
from pipeserve.hicache.directory import LoadDeadline, RedisDirectory
from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.redis_tier import RedisTier
from pipeserve.local.redis_server import LocalRedis
from pipeserve.ring.faults import ENV as FAULTS_ENV
from serving_support import wait_until

LAYOUT = PageLayout("fp", 0, 0, 1, block_size=4, kv_heads=1, head_dim=4, dtype=torch.float32)
BACKOFF_S = 0.3


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


def _found(directory: RedisDirectory, hashes: list[int]) -> int:
    """One probe, its answer awaited (the directory answers on its own thread)."""
    directory.probe("r", hashes)
    got: list[tuple[str, int]] = []
    wait_until(lambda: bool(got.extend(directory.answers()) or got), 5, "the probe's answer", interval_s=0.01)
    return got[0][1]


def test_the_backoff_doubles_per_failure_in_a_row_ignores_repeats_and_resets_on_success() -> None:
    b = Backoff(1.0, 3.0)
    assert b.failed(now=0.0) and b.waiting(0.5) and not b.waiting(1.0)  # the base: 1 s
    assert not b.failed(now=0.5) and not b.waiting(1.0)  # told again within the wait: the same wait
    assert not b.failed(now=1.0) and b.waiting(2.9) and not b.waiting(3.0)  # the next in a row: 2 s
    assert not b.failed(now=3.0) and b.waiting(5.9) and not b.waiting(6.0)  # 4 s, capped at 3
    assert b.succeeded() and not b.down and not b.waiting(6.5) and not b.succeeded()
    assert b.failed(now=10.0) and not b.waiting(11.0)  # the base again


def test_a_failed_load_pauses_probes_and_an_ok_load_resets_the_backoff(server: LocalRedis) -> None:
    tier = RedisTier(server.url)
    tier.store(LAYOUT, 11, torch.ones(LAYOUT.shape), 4)
    directory = RedisDirectory(tier, [LAYOUT], LoadDeadline(), backoff_s=BACKOFF_S, backoff_max_s=8.0)
    try:
        assert _found(directory, [11]) == 1
        for data_error in ("missing", "checksum"):
            directory.load_ended(data_error)
            assert _found(directory, [11]) == 1 and directory.paused_probes == 0
        t0 = time.monotonic()
        directory.load_ended("late")
        directory.load_ended("unavailable")  # ordered before the pause: the same failure, not a second
        assert _found(directory, [11]) == 0 and directory.paused_probes == 1
        wait_until(lambda: _found(directory, [11]) == 1, 5, "loads tried again after the backoff")
        assert time.monotonic() - t0 >= BACKOFF_S
        directory.load_ended("late")  # the first load after the pause fails too: twice as long
        t1 = time.monotonic()
        wait_until(lambda: _found(directory, [11]) == 1, 5, "loads tried again after the doubled backoff")
        assert time.monotonic() - t1 >= 2 * BACKOFF_S
        directory.load_ended("ok")  # every stage loaded: the next failure pauses for the base again
        directory.load_ended("late")
        t2 = time.monotonic()
        wait_until(lambda: _found(directory, [11]) == 1, 5, "loads tried again after the base backoff")
        assert time.monotonic() - t2 < 2 * BACKOFF_S
    finally:
        directory.close()


def test_a_follower_that_cannot_load_in_time_pauses_the_groups_loads(
    llama_dir: Path, server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = family_prompts(1024, seed=47, families=3, per_family=1)
    want = [hf_greedy(llama_dir, p, GREEDY.max_tokens or 0) for p in prompts]
    l3 = dict(host_cache_gb=0, hicache_write_policy="always", hicache_url=server.url)
    assert run_llm(llama_dir, 2, prompts, **l3)[0] == want  # every prompt's pages in L3
    monkeypatch.setenv(FAULTS_ENV, '{"l3_delay_ms": 400, "l3_delay_rank": 1}')  # stage 1's Redis is slow
    kw = {**TIGHT, **l3, "hicache_load_base_ms": 50, "hicache_load_per_block_ms": 1}
    with LLM(str(llama_dir), stages=2, **kw) as llm:
        out = llm.generate(prompts[:1], GREEDY)  # its prefix is in L3: stage 1 answers "late"
        directory = llm.engine.scheduler.fetch.l3
        assert isinstance(directory, RedisDirectory)
        assert tier_stats(llm).loads["late"] == 1 and directory.loads_paused
        out += llm.generate(prompts[1:], GREEDY)  # paused: misses, recomputed, no wait for a load
        assert [o.outputs[0].token_ids for o in out] == want
        assert directory.loads_paused  # no load every stage answered "ok" since
        assert_no_leaks(llm)
