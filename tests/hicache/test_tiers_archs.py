"""HiCache's L2 (host) and L3 (Redis) loads on a windowed architecture (gemma2: a 12-token window on
its local layers, soft-capping) and a routed-experts one (mixtral): prefixes evicted to L2, or stored
in L3 and loaded back by a fresh group, give transformers' greedy ids. One stage each: the tiers'
S = 2, 3 runs are test_tiers_exact.py's (llama); what differs here is the layers the pages feed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from conftest import hf_greedy
from hicache_support import L3_ONLY, family_prompts, run_llm
from pipeserve.local.redis_server import LocalRedis

ARCHS = ["gemma2", "mixtral"]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


def _model(request: pytest.FixtureRequest, arch: str) -> tuple[Path, list[list[int]]]:
    # 2 families of 3: every prompt (45-55 tokens) runs past gemma2's window.
    return Path(request.getfixturevalue(f"{arch}_dir")), family_prompts(1024, seed=40, families=2)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefixes_from_l2_are_hf_exact(request: pytest.FixtureRequest, arch: str) -> None:
    model, prompts = _model(request, arch)
    outs, stats, _ = run_llm(model, 1, prompts + prompts, host_cache_gb=0.001)
    assert outs == [hf_greedy(model, p, 8) for p in prompts] * 2
    assert stats.hit_tokens["l2"] > 0, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_prefixes_from_l3_are_hf_exact(request: pytest.FixtureRequest, server: LocalRedis, arch: str) -> None:
    model, prompts = _model(request, arch)
    redis.Redis.from_url(server.url).flushall()
    want = [hf_greedy(model, p, 8) for p in prompts]
    assert run_llm(model, 1, prompts, hicache_url=server.url, **L3_ONLY)[0] == want
    again, warm, _ = run_llm(model, 1, prompts, hicache_url=server.url, **L3_ONLY)
    assert again == want
    assert warm.hit_tokens["l3"] >= 40 * 2, warm  # each family's shared prefix at least once
    assert set(warm.loads) == {"ok"}, warm.loads
