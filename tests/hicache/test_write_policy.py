"""Which blocks go to L3, and who decides (engine/l3_writes.py, DESIGN.md sections 2 and 5).

Live groups on a real redis-server: under the default policy (second-hit) prompts seen once write
nothing to L3 on any stage; seen again, their blocks are written, and a fresh group reads them.
The plans carry every store: the blocks each stage wrote are exactly those the plans named, the
same on every stage; a stage handed a plan writes the blocks it names and no other. `always`
keeps write-through. Stage 0's decision itself, on the real classes: shared blocks (a cache hit,
another request's) are stored at once, a block known to be in L3 is not ordered again, the
pacing holds the backlog to the rate, and a backlog block the scheduler reuses leaves with the
plan being built.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from conftest import hf_greedy, record_plans
from hicache_support import GREEDY, L3_NO_L2, TIGHT, assert_no_leaks, run_llm, stage_keys, tier_stats
from pipeserve import LLM
from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.l3_writes import L3Writes, WriteSettings
from pipeserve.engine.plan import PageStore, StepPlan
from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.redis_tier import RedisTier
from pipeserve.hicache.stage_tiers import StageTiers
from pipeserve.hicache.writer import PageWriter
from pipeserve.local.redis_server import LocalRedis
from serving_support import wait_until


@pytest.fixture
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


def fresh_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that share no block with each other (random tokens, 20-40 of them)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randint(20, 40))] for _ in range(n)]


def hashes_in(client: redis.Redis, stage: int) -> set[str]:
    """The block hashes a stage wrote pages of (the hash tag of its keys)."""
    return {k.decode().split("{")[1].rstrip("}") for k in stage_keys(client, stage)}


def stored_hashes(plans: list[StepPlan]) -> set[str]:
    return {f"{s.block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}" for p in plans for s in p.l3_stores}


# --- live groups ---------------------------------------------------------------------
def test_a_first_sighting_stores_nothing_and_the_second_stores(llama_dir: Path, server: LocalRedis) -> None:
    client = redis.Redis.from_url(server.url)
    prompts = fresh_prompts(6, seed=1)
    want = [hf_greedy(llama_dir, p, GREEDY.max_tokens or 0) for p in prompts]
    with LLM(str(llama_dir), stages=2, **{**TIGHT, "hicache_url": server.url, **L3_NO_L2}) as llm:
        plans = record_plans(llm)
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        writes = llm.engine.scheduler.fetch.writes
        assert writes is not None
        assert writes.stats.first_sightings > 0
        assert writes.stats.ordered == 0 and not stored_hashes(plans)
        time.sleep(0.3)  # a stage that wrote on its own would have done so by now
        assert not stage_keys(client, 0) and not stage_keys(client, 1)

        # Seen again (L1 hits, or recomputed after L1 evicted them): stored, on every stage.
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert writes.stats.ordered > 0
        assert_no_leaks(llm)
    # The group closed: every writer drained. Each stage holds exactly the blocks the plans named.
    named = stored_hashes(plans)
    assert len(named) == writes.stats.ordered
    assert hashes_in(client, 0) == named and hashes_in(client, 1) == named

    # A fresh group (no L1, no L2) reads them from L3.
    outs2, stats, _ = run_llm(llama_dir, 2, prompts, hicache_url=server.url, **L3_NO_L2)
    assert outs2 == want
    assert stats.hit_tokens["l3"] > 0 and set(stats.loads) == {"ok"}, stats


def test_always_stores_on_first_computation(llama_dir: Path, server: LocalRedis) -> None:
    client = redis.Redis.from_url(server.url)
    prompts = fresh_prompts(4, seed=2)
    with LLM(
        str(llama_dir),
        stages=2,
        **{**TIGHT, "hicache_url": server.url, **L3_NO_L2},
        hicache_write_policy="always",
    ) as llm:
        plans = record_plans(llm)
        llm.generate(prompts, GREEDY)
        writes = llm.engine.scheduler.fetch.writes
        assert writes is not None and writes.stats.first_sightings == 0
        # Every full block with KV (the last sampled token has none), each once, preempted or not.
        assert writes.stats.ordered == sum((len(p) + 7) // 4 for p in prompts)
    named = stored_hashes(plans)
    assert named and hashes_in(client, 0) == named and hashes_in(client, 1) == named


def test_a_stage_stores_only_the_blocks_the_plan_names(server: LocalRedis) -> None:
    """A follower's side on its own: a pool whose blocks are all full and hashed on stage 0 (it
    cannot know), a plan naming one of them: that block's page is written, and nothing else."""
    layout = PageLayout("fpw", 1, 2, 4, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    tier = RedisTier(server.url)
    writer = PageWriter(RedisTier(server.url), layout)
    tiers = StageTiers(layout, 0, tier, writer, torch.device("cpu"))
    pool = torch.randn((2, 2, 8, 4, 2, 8), generator=torch.Generator().manual_seed(0))
    try:
        tiers.execute(StepPlan(1, [], [], [], l3_stores=[PageStore(5, 0xB5)]), pool)
        tiers.execute(StepPlan(2, [], [], []), pool)  # a plan without stores writes nothing
        writer.close(timeout_s=10)
        client = redis.Redis.from_url(server.url)
        assert hashes_in(client, 1) == {f"{0xB5:016x}"}
        got = tier.load(layout, [0xB5])
        assert got.ok and torch.equal(got.pages[0], pool[:, :, 5])  # block 5's content, as it was
    finally:
        tiers.close()


# --- stage 0's decision, on the real classes -------------------------------------------
def test_the_policy_orders_a_block_on_its_second_sighting() -> None:
    w = L3Writes(WriteSettings("second-hit"), page_bytes=1000)
    assert not w.committed(3, 0xA1, shared=False)  # first sighting
    assert w.take(time.monotonic()) == [] and w.stats.first_sightings == 1
    assert w.committed(7, 0xA1, shared=False)  # the same chain hash again (another request)
    assert w.take(time.monotonic()) == [PageStore(7, 0xA1)]
    assert not w.committed(9, 0xA1, shared=False)  # ordered: known to be in L3, not again
    assert w.committed(4, 0xB2, shared=True)  # a cache hit or another request's block: at once
    assert w.take(time.monotonic()) == [PageStore(4, 0xB2)]
    w.forget(0xA1)  # a probe found it missing (a store dropped, Redis restarted)
    assert w.committed(9, 0xA1, shared=False)  # seen before: ordered again


def test_always_orders_every_block_at_once() -> None:
    w = L3Writes(WriteSettings("always"), page_bytes=1000)
    assert w.committed(1, 0xC1, shared=False) and w.committed(2, 0xC2, shared=False)
    assert w.take(time.monotonic()) == [PageStore(1, 0xC1), PageStore(2, 0xC2)]


def test_the_backlog_leaves_at_the_rate_oldest_first() -> None:
    # 10 KB/s, pages of 1 KB, a staging buffer of 4 KB: a burst of 2 pages, then 10 a second.
    w = L3Writes(WriteSettings("always", rate_bytes_s=10_000, buffer_bytes=4000), page_bytes=1000)
    for i in range(10):
        w.committed(i, 0x100 + i, shared=False)
    t0 = time.monotonic()
    assert [s.block_id for s in w.take(t0)] == [0, 1]
    assert w.take(t0) == [] and w.backlog == 8
    assert 0.09 <= w.wait_s(t0) <= 0.11
    assert [s.block_id for s in w.take(t0 + 0.101)] == [2]
    assert [s.block_id for s in w.take(t0 + 0.15)] == []
    assert [s.block_id for s in w.take(t0 + 0.201)] == [3]
    assert [s.block_id for s in w.take(t0 + 10)] == [4, 5]  # the burst again, not 10 s's worth
    assert w.stats.ordered == 6


def test_a_backlog_block_the_scheduler_reuses_leaves_with_that_plan() -> None:
    """The scheduler hands a block whose store is still paced to new content: the store goes with
    the plan being built (whose stores are read before its chunks write), however full the bucket."""
    bm = BlockManager(4, 4)
    w = L3Writes(WriteSettings("always", rate_bytes_s=1, buffer_bytes=1000), page_bytes=1000)
    bm.reuse_hook = w.reused
    (bid,) = bm.allocate(1)
    w.committed(bid, 0xD1, shared=False)
    t0 = time.monotonic()
    assert [s.block_id for s in w.take(t0)] == [bid]  # the burst: one page
    others = bm.allocate(3)
    for b in others:
        w.committed(b, 0xE0 + b, shared=False)
    assert w.take(t0) == [] and w.backlog == 3  # the bucket is empty
    bm.release_blocks(others[:1])
    assert bm.allocate(1) == others[:1]  # reused for new content in the plan being built
    assert w.take(t0) == [PageStore(others[0], 0xE0 + others[0])] and w.stats.forced == 1
    assert w.backlog == 2
    # Another one now would overflow the writers' buffers (a page's worth of debt already):
    # dropped here, and forgotten, so that its next sighting orders it again.
    bm.release_blocks(others[1:2])
    assert bm.allocate(1) == others[1:2]
    assert w.take(t0) == [] and w.stats.dropped_reused == 1 and w.backlog == 1
    assert not w.is_known(0xE0 + others[1]) and w.is_known(0xE0 + others[2])


def test_a_group_orders_every_paced_store_before_it_goes_idle(llama_dir: Path, server: LocalRedis) -> None:
    """A slow cap (a few pages a second): generate returns only once every ordered store was sent,
    and the stages wrote them all."""
    prompts = fresh_prompts(3, seed=3)
    kw = {**TIGHT, "hicache_url": server.url, **L3_NO_L2, "hicache_write_policy": "always"}
    with LLM(str(llama_dir), stages=1, **kw, hicache_write_mb_s=0.02, hicache_write_buffer_mb=0.01) as llm:
        writes = llm.engine.scheduler.fetch.writes
        assert writes is not None and writes.page_bytes > 0
        t0 = time.monotonic()
        llm.generate(prompts, GREEDY)
        assert writes.backlog == 0 and writes.stats.ordered > 5
        burst = max(writes.page_bytes, 5242)  # half the buffer, at least a page
        paced = (writes.stats.ordered * writes.page_bytes - burst) / 20_000
        assert time.monotonic() - t0 >= paced * 0.8
        assert tier_stats(llm).loads == {}
    client = redis.Redis.from_url(server.url)
    wait_until(lambda: len(stage_keys(client, 0)) == writes.stats.ordered, 10, "every ordered page written")
