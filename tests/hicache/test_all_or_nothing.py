"""All or nothing across stages: a prefix from L3 is used only if every stage loaded its part in time.

One stage's pages corrupted (checksum), its load delayed past the deadline (a slow Redis for that
stage), or one of its pages deleted: the group recomputes, the output stays HF-exact, the failure
is counted, and no KV block is left behind on any stage. A different layer split or checkpoint never
reads another's pages. Redis killed in the middle of a load and started again: no request fails or
hangs, and L3 comes back by itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from conftest import hf_greedy
from hicache_support import (
    GREEDY,
    L3_ONLY,
    TIGHT,
    assert_no_leaks,
    family_prompts,
    run_llm,
    stage_keys,
    tier_stats,
)
from pipeserve import LLM
from pipeserve.engine.plan import LoadOrder, StepPlan
from pipeserve.hicache.page import HEADER_BYTES, PageLayout
from pipeserve.hicache.redis_tier import RedisTier
from pipeserve.hicache.stage_tiers import StageTiers
from pipeserve.local.redis_server import LocalRedis
from pipeserve.model.demo import DemoSpec, write_demo_model
from pipeserve.ring.faults import ENV as FAULTS_ENV
from serving_support import wait_until


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


def _seed_l3(model: Path, url: str, prompts: list[list[int]], stages: int = 2, **kw) -> list[list[int]]:
    """Run the prompts once (their pages are written to L3); the HF-exact ids."""
    want = [hf_greedy(model, p, GREEDY.max_tokens or 0) for p in prompts]
    assert run_llm(model, stages, prompts, hicache_url=url, **{**L3_ONLY, **kw})[0] == want
    return want


def test_one_stage_with_corrupt_pages_means_recompute(llama_dir: Path, server: LocalRedis) -> None:
    prompts = family_prompts(1024, seed=40, families=2)
    want = _seed_l3(llama_dir, server.url, prompts)
    client = redis.Redis.from_url(server.url)
    keys = stage_keys(client, 1)
    assert keys and len(keys) == len(stage_keys(client, 0))
    g = torch.Generator().manual_seed(0)
    for key in keys:  # stage 1's K/V bytes replaced by other values; the header (checksum) kept
        value = client.get(key)
        assert value is not None
        noise = torch.randn((len(value) - HEADER_BYTES) // 4, generator=g).numpy().tobytes()
        client.set(key, value[:HEADER_BYTES] + noise)
    outs, stats, _ = run_llm(llama_dir, 2, prompts, hicache_url=server.url, **L3_ONLY)
    assert outs == want
    assert stats.loads["checksum"] > 0 and stats.loads["ok"] == 0, stats.loads
    assert stats.hit_tokens["l3"] == 0


def test_one_stage_late_means_recompute(
    llama_dir: Path, server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = family_prompts(1024, seed=41, families=2)
    want = _seed_l3(llama_dir, server.url, prompts)
    monkeypatch.setenv(FAULTS_ENV, '{"l3_delay_ms": 400, "l3_delay_rank": 1}')  # stage 1's Redis is slow
    outs, stats, _ = run_llm(
        llama_dir,
        2,
        prompts,
        hicache_url=server.url,
        host_cache_gb=0,
        hicache_load_base_ms=50,
        hicache_load_per_block_ms=1,
    )
    assert outs == want
    assert stats.loads["late"] > 0 and stats.loads["ok"] == 0, stats.loads
    assert stats.hit_tokens["l3"] == 0


def test_one_stage_missing_a_page_means_a_shorter_prefix(llama_dir: Path, server: LocalRedis) -> None:
    prompts = family_prompts(1024, seed=42, families=1, per_family=1)
    want = _seed_l3(llama_dir, server.url, prompts)
    client = redis.Redis.from_url(server.url)
    # Delete stage 1's page of the 4th block: L3 holds blocks 0..2 of this prompt for every stage.
    probe_stats = run_llm(llama_dir, 2, prompts, hicache_url=server.url, **L3_ONLY)[1]
    full = probe_stats.probe_hit_blocks
    assert full >= 10
    lay_keys = stage_keys(client, 1)
    tiers_keys = {k.split(b"{")[1] for k in lay_keys}
    assert len(tiers_keys) == len(lay_keys)
    from pipeserve.engine.block_manager import chain_hashes

    fourth = chain_hashes(prompts[0], 4, 0, 4, 0)[3]
    (victim,) = [k for k in lay_keys if k.endswith(f"{{{fourth:016x}}}".encode())]
    client.delete(victim)
    outs, stats, _ = run_llm(llama_dir, 2, prompts, hicache_url=server.url, **L3_ONLY)
    assert outs == want
    assert stats.probe_hit_blocks == 3 and stats.hit_tokens["l3"] == 3 * 4, stats


def test_a_load_of_a_missing_page_answers_missing_and_copies_nothing(server: LocalRedis) -> None:
    layout = PageLayout("fp", 0, 0, 2, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    tiers = StageTiers(layout, 0, RedisTier(server.url), None, torch.device("cpu"))
    pool = torch.zeros((2, 2, 8, 4, 2, 8))
    try:
        plan = StepPlan(1, [], [], [], l3_loads=[LoadOrder(7, [1, 2], [11, 12], 1000)])
        acks = tiers.execute(plan, pool)
        deadline = time.monotonic() + 5
        while not acks and time.monotonic() < deadline:
            time.sleep(0.01)
            acks = tiers.execute(StepPlan(2, [], [], [], poll=True), pool)
        assert [(a.load_id, a.status) for a in acks] == [(7, "missing")]
        assert not pool.any()
    finally:
        tiers.close()


def test_another_split_or_checkpoint_never_reads_a_page(
    llama_dir: Path, server: LocalRedis, tmp_path: Path
) -> None:
    prompts = family_prompts(1024, seed=43, families=1, per_family=2)
    _seed_l3(llama_dir, server.url, prompts, layer_split="0:1,1:4")
    same = run_llm(llama_dir, 2, prompts, hicache_url=server.url, layer_split="0:1,1:4", **L3_ONLY)[1]
    assert same.probe_hit_blocks > 0  # the control: the same split does read them
    other_split = run_llm(llama_dir, 2, prompts, hicache_url=server.url, layer_split="0:2,2:4", **L3_ONLY)[1]
    assert other_split.probe_hit_blocks == 0 and not other_split.loads
    other_model = write_demo_model(tmp_path / "seed1", DemoSpec(arch="llama", seed=1))
    _seed_l3(llama_dir, server.url, prompts, stages=1)
    outs, stats, _ = run_llm(other_model, 1, prompts, hicache_url=server.url, **L3_ONLY)
    assert stats.probe_hit_blocks == 0 and not stats.loads
    assert outs == [hf_greedy(other_model, p, GREEDY.max_tokens or 0) for p in prompts]


def test_redis_killed_mid_load_then_back(
    llama_dir: Path, server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = family_prompts(1024, seed=44, families=2, per_family=2)
    want = _seed_l3(llama_dir, server.url, prompts)
    monkeypatch.setenv(FAULTS_ENV, '{"l3_delay_ms": 1500, "l3_delay_rank": 1}')  # holds the load open
    kw = {**TIGHT, "hicache_url": server.url, "host_cache_gb": 0, "hicache_load_base_ms": 5000}
    with LLM(str(llama_dir), stages=2, **kw) as llm:
        result: list = []
        worker = threading.Thread(target=lambda: result.append(llm.generate(prompts, GREEDY)), daemon=True)
        worker.start()
        wait_until(lambda: tier_stats(llm).probe_hit_blocks > 0, 30, "an L3 load ordered")
        assert server.proc is not None
        server.proc.kill()  # Redis gone while stage 1 is still fetching
        server.proc.wait(5)
        worker.join(60)
        assert not worker.is_alive(), "generate hung after Redis died"
        assert [o.outputs[0].token_ids for o in result[0]] == want
        stats = tier_stats(llm)
        assert stats.loads["ok"] == 0 and sum(stats.loads.values()) > 0, stats.loads
        assert_no_leaks(llm)
        # Redis back (empty, on its port): the same group stores the same prompts again by itself
        # (stage 0 saw Redis down, so it forgets what it had written), once the writers' backoff
        # has passed.
        assert server.ensure_running()
        client = redis.Redis.from_url(server.url)

        def stored_again() -> bool:
            llm.generate(prompts, GREEDY)
            time.sleep(0.2)
            return len(stage_keys(client, 1)) >= 20

        wait_until(stored_again, 30, "stage 1's pages written again", interval_s=0.1)
    monkeypatch.delenv(FAULTS_ENV)
    outs, stats, _ = run_llm(llama_dir, 2, prompts, hicache_url=server.url, **L3_ONLY)
    assert outs == want
    assert stats.loads["ok"] > 0, stats.loads


def test_redis_evicting_pages_only_causes_misses(llama_dir: Path) -> None:
    with LocalRedis(maxmemory_mb=2) as small:  # allkeys-lru: old pages make room for new ones
        prompts = family_prompts(1024, seed=46, families=12, per_family=3)
        want = [hf_greedy(llama_dir, p, GREEDY.max_tokens or 0) for p in prompts]
        for _ in range(2):
            outs, _, _ = run_llm(llama_dir, 2, prompts, hicache_url=small.url, **L3_ONLY)
            assert outs == want
        info = redis.Redis.from_url(small.url).info("stats")
        assert info["evicted_keys"] > 0, "Redis was meant to run out of memory"
