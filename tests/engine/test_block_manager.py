"""BlockManager: reference counts, LRU eviction, chained prefix hashes."""

from __future__ import annotations

from pipeserve.engine.block_manager import BlockManager, chain_hash
from pipeserve.engine.request import Request
from pipeserve.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def _fill(bm: BlockManager, req: Request) -> None:
    req.block_ids = bm.allocate(bm.blocks_needed(req.num_tokens))
    req.num_computed = req.num_tokens
    bm.commit_full_blocks(req)


def test_chain_hash_depends_on_prefix() -> None:
    a = chain_hash(0, [1, 2])
    assert chain_hash(a, [3, 4]) != chain_hash(chain_hash(0, [9, 9]), [3, 4])
    assert chain_hash(a, [3, 4]) == chain_hash(chain_hash(0, [1, 2]), [3, 4])


def test_prefix_match_leaves_last_token_and_checks_tokens() -> None:
    bm = BlockManager(8, 4)
    r = _req("r", list(range(12)))
    _fill(bm, r)
    assert bm.match_prefix(list(range(12)))[0] == r.block_ids[:2]  # not the block with the last token
    assert bm.match_prefix(list(range(13)))[0] == r.block_ids[:3]
    assert bm.match_prefix([0, 1, 2, 3, 99, 5, 6, 7, 8])[0] == r.block_ids[:1]
    assert bm.match_prefix([7, 1, 2, 3, 4, 5, 6, 7, 8])[0] == []


def test_release_returns_blocks_and_lru_evicts_oldest_first() -> None:
    bm = BlockManager(6, 2)
    a, b = _req("a", [1, 2, 3, 4, 5]), _req("b", [7, 8, 9, 10, 11])
    _fill(bm, a)
    _fill(bm, b)
    assert bm.num_free == 0
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 6
    # The tail blocks (2: [5], 5: [11]) hold no full-block hash: they are taken first, most
    # recently freed first, and no cached prefix is evicted for them.
    assert bm.allocate(2) == [5, 2]
    assert bm.stats.evictions == 0
    # Then the cached blocks, least recently freed first: a's before b's, tail before prefix.
    assert bm.allocate(1) == [1]
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == [0]  # block 1 ([3, 4]) evicted, block 0 kept
    assert bm.match_prefix([7, 8, 9, 10, 11])[0] == [3, 4]
    assert bm.stats.evictions == 1


def test_recycled_blocks_before_never_used_ones() -> None:
    """Requests that come and go without a cache reuse the same few blocks: on a CPU the pool is
    committed as its pages are first written, and resident memory must follow the working set,
    not the number of requests served (handing out never-used blocks first grew it by each
    request's KV until the pool was spent)."""
    for caching in (False, True):
        bm = BlockManager(1000, 4, enable_prefix_caching=caching)
        used: set[int] = set()
        for i in range(50):
            r = _req(f"r{i}", [i * 100 + t for t in range(9)])  # fresh tokens: no prefix hit
            _fill(bm, r)
            used.update(r.block_ids)
            bm.release(r)
        # without a cache: one request's 3 blocks; with one, 2 full blocks kept per request + 1
        assert len(used) == (3 if not caching else 2 * 50 + 1), caching
        assert bm.num_free == 1000


def test_shared_blocks_are_refcounted() -> None:
    bm = BlockManager(6, 2)
    a = _req("a", [1, 2, 3, 4, 5])
    _fill(bm, a)
    hits = bm.match_prefix([1, 2, 3, 4, 9])[0]
    bm.take_cached(hits)
    b = _req("b", [1, 2, 3, 4, 9])
    b.block_ids = hits + bm.allocate(1)
    bm.release(a)
    assert all(bm.blocks[h].ref_count == 1 for h in hits)
    assert bm.num_free == 6 - 3
    bm.release(b)
    assert bm.num_free == 6


def test_taking_a_free_cached_block_counts_against_capacity() -> None:
    bm = BlockManager(3, 2)
    a = _req("a", [1, 2, 3, 4, 5])
    _fill(bm, a)
    bm.release(a)
    hits = bm.match_prefix([1, 2, 3, 4, 6])[0]
    assert len(hits) == 2
    assert bm.can_allocate(1, hits) and not bm.can_allocate(2, hits)
