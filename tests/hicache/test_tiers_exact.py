"""Greedy ids identical to transformers when prefixes come from L2 (host memory) and from L3 (Redis,
and a 3-master Redis Cluster), for S = 1, 2, 3, with chunked prefill and preemption in the mix; no
KV block leaked on any stage. The L3 runs price the load deadline by size only (base 0): a flat
deadline would answer every load late. They check the L3 mechanism, so every block is stored on its
first computation (`always`); the second-hit policy is tests/hicache/test_write_policy.py's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from conftest import hf_greedy
from hicache_support import L3_ONLY, family_prompts, run_llm, stage_keys
from pipeserve.local.ports import PortBook
from pipeserve.local.redis_server import LocalRedis, cluster_create


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


def _want(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_prefixes_from_l2_are_hf_exact(llama_dir: Path, stages: int) -> None:
    prompts = family_prompts(1024, seed=stages)
    # Twice the same prompts through one group: the second pass finds what L1 evicted in L2.
    outs, stats, preempted = run_llm(llama_dir, stages, prompts + prompts, host_cache_gb=0.001)
    assert outs == _want(llama_dir, prompts) * 2
    assert stats.hit_tokens["l2"] > 0, stats
    assert stats.hit_tokens["l3"] == 0
    assert preempted > 0, "the pool was meant to be too small for the batch"


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_prefixes_from_l3_are_hf_exact(llama_dir: Path, server: LocalRedis, stages: int) -> None:
    redis.Redis.from_url(server.url).flushall()
    prompts = family_prompts(1024, seed=10 + stages)
    want = _want(llama_dir, prompts)
    first, cold, preempted_cold = run_llm(llama_dir, stages, prompts, hicache_url=server.url, **L3_ONLY)
    assert first == want
    assert all(stage_keys(redis.Redis.from_url(server.url), k) for k in range(stages))
    # A new group (nothing in its L1, no L2): the prefixes come from Redis.
    again, warm, preempted = run_llm(llama_dir, stages, prompts, hicache_url=server.url, **L3_ONLY)
    assert again == want
    assert warm.hit_tokens["l3"] >= 40 * 3, warm  # at least each family's shared prefix once
    # The cold group may load a few blocks it wrote itself (a family's shared prefix evicted from
    # its small pool by a preemption before the family's next prompt is admitted); the new group
    # finds more: everything the cold one computed.
    assert cold.hit_tokens["l3"] < warm.hit_tokens["l3"], (cold, warm)
    assert set(warm.loads) == {"ok"}, warm.loads
    assert preempted_cold + preempted > 0  # (the warm pass's loads may stagger its admissions)


def test_prefixes_from_a_redis_cluster_are_hf_exact(llama_dir: Path) -> None:
    ports = PortBook()  # six ports (three servers, three cluster buses), all different
    nodes = [LocalRedis(cluster=True, ports=ports) for _ in range(3)]
    try:
        for n in nodes:
            n.start()
        cluster_create(nodes)
        prompts = family_prompts(1024, seed=30)
        want = _want(llama_dir, prompts)
        url = nodes[0].url
        assert run_llm(llama_dir, 2, prompts, hicache_url=url, **L3_ONLY)[0] == want
        outs, warm, _ = run_llm(llama_dir, 2, prompts, hicache_url=url, **L3_ONLY)
        assert outs == want
        assert warm.hit_tokens["l3"] >= 40 * 3 and set(warm.loads) == {"ok"}, warm
    finally:
        for n in nodes:
            n.stop()
