"""Helpers for HiCache tests: LLM groups with L2/L3 settings, tier statistics, leak checks, Redis pages."""

from __future__ import annotations

import random
from pathlib import Path

import redis

from pipeserve import LLM, SamplingParams
from pipeserve.engine.prefix_loads import TierStats

# A small pool (32 blocks of 4 tokens) under 4 concurrent requests of ~60 tokens: L1 evicts and
# preempts; chunks of 24 tokens split every prompt.
TIGHT = dict(
    block_size=4,
    max_model_len=120,
    num_kv_blocks=32,
    max_num_batched_tokens=24,
    max_num_seqs=4,
    num_threads=1,
)
GREEDY = SamplingParams(temperature=0, max_tokens=8)

# L3 alone (no L2). A load's deadline is not what these tests measure, so it is 5 s rather than a
# few hundred ms: under make test-stress a 1-page load from a Redis Cluster took more than 200 ms
# and was answered 'late' (the group recomputed, the test wanted every load 'ok'). The tests of
# late loads set their own deadlines.
L3_NO_L2 = dict(host_cache_gb=0, hicache_load_base_ms=5000)
# ... with every block stored on its first computation.
L3_ONLY = dict(L3_NO_L2, hicache_write_policy="always")


def family_prompts(vocab: int, seed: int, families: int = 3, per_family: int = 3) -> list[list[int]]:
    """`families` shared prefixes of 40 tokens, each continued by `per_family` suffixes of 5-15."""
    rng = random.Random(seed)
    out = []
    for _ in range(families):
        prefix = [rng.randrange(3, vocab) for _ in range(40)]
        out += [
            prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(5, 15))] for _ in range(per_family)
        ]
    return out


def tier_stats(llm: LLM) -> TierStats:
    return llm.engine.scheduler.fetch.stats


def assert_no_leaks(llm: LLM) -> None:
    """Every KV block back in stage 0's pool, no L3 load pending, and no stage holding a block."""
    eng = llm.engine
    assert eng.num_free_blocks == eng.num_total_blocks, (eng.num_free_blocks, eng.num_total_blocks)
    assert not eng.scheduler.fetch.pending
    held = [(r.rank, r.blocks_held, r.num_reqs) for r in eng.stage_reports]
    assert all(b == 0 and n == 0 for _, b, n in held), held


def run_llm(
    model: Path, stages: int, prompts: list[list[int]], **kw
) -> tuple[list[list[int]], TierStats, int]:
    """Generate greedily with a fresh group; (token ids per prompt, stage 0's tier stats, preemptions)."""
    with LLM(str(model), stages=stages, **{**TIGHT, **kw}) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert_no_leaks(llm)
        return [o.outputs[0].token_ids for o in outs], tier_stats(llm), llm.engine.scheduler.num_preemptions


def stage_keys(client: redis.Redis, stage: int) -> list[bytes]:
    """Every page key of one stage (any model) in a single Redis."""
    return sorted(client.scan_iter(match=f"pipeserve:*:*:{stage}:{{*}}", count=1000))
