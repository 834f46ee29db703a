"""L2's index on stage 0: LRU eviction, a hit compares tokens, a slot a load in the plan being built
reads is never handed to a save (executors write saves before they read loads), and the block
manager saves a cached block to L2 when L1 reuses it."""

from __future__ import annotations

from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.host_index import HostIndex
from pipeserve.engine.plan import BlockCopy
from pipeserve.engine.request import Request
from pipeserve.sampling_params import SamplingParams


def test_lru_eviction_and_token_check() -> None:
    idx = HostIndex(2)
    a, b, c = idx.save(1, (1,)), idx.save(2, (2,)), None
    assert {a, b} == {0, 1}
    assert idx.save(1, (1,)) is None  # already there: touched, not copied again
    c = idx.save(3, (3,))  # evicts 2, the least recently used
    assert c == b and idx.lookup(2, (2,)) is None
    assert idx.lookup(1, (9,)) is None  # same hash, other tokens: a collision is a miss
    assert idx.lookup(1, (1,)) == a
    assert idx.stats.evictions == 1 and idx.stats.hits == 1


def test_a_slot_read_by_this_plan_is_not_reused_by_a_save() -> None:
    idx = HostIndex(1)
    slot = idx.save(1, (1,))
    assert idx.lookup(1, (1,)) == slot  # pinned until end_plan
    assert idx.save(2, (2,)) is None and idx.stats.skipped == 1
    idx.end_plan()
    assert idx.save(2, (2,)) == slot


def test_the_block_manager_saves_what_l1_evicts() -> None:
    bm = BlockManager(2, 2, host=HostIndex(4))
    req = Request("r", [5, 6, 7, 8], SamplingParams(max_tokens=1))
    req.block_ids = bm.allocate(2)
    req.num_computed = 4
    bm.commit_full_blocks(req)
    bm.release(req)
    hashed = dict(bm.cached)
    assert len(hashed) == 2
    fresh = bm.allocate(2)  # both cached blocks reused: both saved to L2 in this plan
    saves = bm.take_plan_saves()
    assert sorted(c.block_id for c in saves) == sorted(fresh)
    assert all(isinstance(c, BlockCopy) for c in saves)
    assert bm.match_prefix([5, 6, 7, 8, 9])[0] == []
    slots = bm.match_host([5, 6, 7, 8, 9], 0, 0)  # the prefix continues in L2, in chain order
    assert len(slots) == 2 and {s for s, _ in slots} == {c.slot for c in saves}
    assert {h for _, h in slots} == set(hashed)
